"""Generated protobuf/gRPC modules (``make protos``); do not edit."""
