"""Generated protobuf and gRPC stubs of the pdserve.v1 API (see protos/pdserve/v1)."""
