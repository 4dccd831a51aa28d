"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the
OpenAI port, a thin face over the OpenAI face's chat path: ``request`` (an Anthropic body
checked and made into the chat request), ``routes`` (decode, call the chat path, encode),
``answer`` (the chat answer as Anthropic's message or its events) and ``errors`` (Anthropic's
error body). docs/anthropic.md describes the API and what plugserve decided where it differs.
"""

from plugserve.server.protocols.openai.anthropic.routes import AnthropicRoutes

__all__ = ["AnthropicRoutes"]
