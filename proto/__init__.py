"""Wire contracts: generated protobuf/gRPC modules (``primerl.proto.v1``) and the ZMQ framing module."""
