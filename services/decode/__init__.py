"""The decode worker: holds KV reservations, receives KV from prefill workers, decodes with continuous
batching and streams tokens to the router."""
