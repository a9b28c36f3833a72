"""The prefill worker: batches prompts, streams each layer's KV to a decode worker as soon as it is computed,
and returns the first token."""
