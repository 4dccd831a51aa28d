"""The Hugging Face folder as a model format (``server/control/formats.py``): a decoder folder
becomes a :class:`GenerativeNetwork`, a sentence-transformers folder its encoder graph as a plain
network on the device asked for. Declared in pyproject.toml under ``plugserve.formats``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plugserve.plugins.api import CompiledNetwork
from plugserve.server.apps.generate.embeddings import encoder_graph
from plugserve.server.apps.generate.folder import is_transformers_folder
from plugserve.server.apps.generate.network import load_generative
from plugserve.server.control.formats import FolderFormat

__all__ = ["TRANSFORMERS"]


def _claims(folder: Path) -> bool:
    return is_transformers_folder(folder)


def _load(core: Any, folder: str, device: str, config: Any) -> CompiledNetwork:
    graph = encoder_graph(folder)  # a sentence-transformers folder: a plain network
    if graph is not None:
        return core.load_network(str(graph), device, config)
    return load_generative(core, folder, device, config, core.format_settings.get("transformers"))


TRANSFORMERS = FolderFormat("transformers", _claims, _load)
