"""plugserve's client: the plugin API of a running server over gRPC, numpy in and out."""

from plugserve.client.client import AsyncClient, Client, Sequence

__all__ = ["AsyncClient", "Client", "Sequence"]
