"""What the prefill and decode workers share: configuration, model and engine set-up, the gRPC server,
registration in Redis with heartbeats, and the graceful stop."""
