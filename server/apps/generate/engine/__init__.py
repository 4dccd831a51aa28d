"""The generation engine: its loop, scheduler, runner (and the pipelined step), the KV
cache, the answers it streams, its statistics, spans and warm-up; it calls the decoder the
Plugin API declares (``plugins/decoding.py``) and nothing of a device's."""
