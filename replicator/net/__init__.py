"""gRPC plumbing, security (token, TLS) and CPU priority shared by every replicator service."""
