"""plugserve's client: talks to a running server over gRPC (arrives with the server issue)."""
