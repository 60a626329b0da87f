"""The gRPC stubs generated from proto/pdserve/v1/generation.proto (tests/test_proto_stubs.py proves they
match it). Generated code: imports only protobuf and grpc."""
