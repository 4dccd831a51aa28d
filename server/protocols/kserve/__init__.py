"""KServe v2 / Triton's gRPC protocol: the servicer (``service.py``), its message converters
(``convert.py``) and the typed-contents decoder (``contents.py``)."""
