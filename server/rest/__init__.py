"""KServe v2 over HTTP/REST on its own port: the routes and their handlers (``server.py``),
HTTP/1.1 on httptools (``http_server.py``), JSON and binary tensors (``convert.py``), large
JSON in a helper process (``offload.py``), Triton's generate extension (``generate.py``) and
server-sent events (``sse.py``)."""
