"""HTTP/1.1 plumbing every REST adapter shares: the asyncio server, offload, server-sent events."""
