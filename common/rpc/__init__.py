"""What every pdserve gRPC service shares: server bootstrap (health, reflection) and the one converter
between protobuf messages and the engine's dataclasses."""
