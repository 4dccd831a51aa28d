"""Protocol adapters (KServe v2 over gRPC and REST, OpenAI, plugserve.v1) and their plumbing:
decode, call, encode."""
