"""The router: the public gRPC API; tokenizes, picks a decode then a prefill worker, and relays the stream."""
