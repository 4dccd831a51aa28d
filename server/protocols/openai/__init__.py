"""The OpenAI-compatible API over the generation engine (and embeddings over encoders).

One module a job: ``protocol`` (request bodies checked field by field), ``serving`` (the
routes: check, render, tokenize, generate through the data plane, encode), ``encode`` (response
bodies, stream chunks, logprobs formats, usage), ``grammar`` (``response_format`` as
constrained decoding with llguidance), ``embeddings`` (sentence-transformers folders' encoders)
and ``errors`` (OpenAI's error body); ``anthropic/`` is Anthropic's Messages API over the
chat path (docs/anthropic.md). docs/openai.md describes the API and what plugserve decided
where OpenAI is silent.
"""

from plugserve.server.protocols.openai.serving import OpenAIRoutes

__all__ = ["OpenAIRoutes"]
