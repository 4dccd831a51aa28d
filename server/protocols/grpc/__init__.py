"""gRPC plumbing every gRPC adapter shares: handlers, the call gate, wrapping, reflection."""
