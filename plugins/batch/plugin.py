"""The BATCH device: ``BATCH:D(n)`` gathers concurrent requests into batches run on D.

Requests to one network that arrive together are concatenated along the first dimension, up
to ``BATCH_SIZE`` rows or until ``BATCH_TIMEOUT_MS`` (default 2 ms) after the first request of
the batch, run once on the device's network, and the outputs are split back to their callers.
Requests whose shapes differ beyond the first dimension are never mixed. A model is accepted
only if every input and output has a dynamic first dimension and no op couples the rows of a
batch (dynamic quantization's one scale per tensor). The compiled network's metric
``BATCH_SIZE_COUNTS`` counts the batches run by size (rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plugserve.plugins.api import (
    CompiledNetwork,
    InvalidArgument,
    Model,
    device_refusals,
)
from plugserve.plugins.batch.compiled import BatchCompiledNetwork, row_coupling, unbatchable
from plugserve.plugins.batch.config import BatchConfiguration
from plugserve.plugins.ir import load_model, read_model, zip_archive
from plugserve.plugins.virtual import VirtualPlugin

__all__ = ["BatchPlugin"]


class BatchPlugin(VirtualPlugin):
    name = "BATCH"
    config_class = BatchConfiguration
    cancellation = "queued: at once; a batch: once all its requests are"
    CAPABILITIES = ("EXPORT_IMPORT", "BATCHED_BLOB")

    def _child_names(self, config: Mapping[str, Any]) -> list[str]:
        device = config.get("DEVICE_PRIORITIES") or self._config.get("DEVICE_PRIORITIES")
        return [str(device)] if device else []

    def _device(self, cfg: BatchConfiguration) -> str:
        device = cfg.device()
        if not device:
            raise InvalidArgument("BATCH needs a device: use BATCH:DEVICE(N), e.g. BATCH:ORT(8)")
        plugin = self._devices().plugin(device)  # NotFound names an unknown device
        if plugin.name in ("MULTI", "AUTO", "HETERO", "BATCH"):
            raise InvalidArgument(f"BATCH: device {device!r} is virtual; batch a real device")
        return device

    def _wrap(
        self, cfg: BatchConfiguration, device: str, network: CompiledNetwork
    ) -> BatchCompiledNetwork:
        why = unbatchable(network.inputs, "input") or unbatchable(network.outputs, "output")
        if why:
            network.close()
            raise InvalidArgument(
                f"model {network.name!r} cannot be batched: {why}; BATCH needs a dynamic first "
                "(batch) dimension on every input and output"
            )
        return BatchCompiledNetwork(self, cfg, device, network)

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> BatchCompiledNetwork:
        return self._load(model, config, trusted=False)

    def load_trusted(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> BatchCompiledNetwork:
        """A model from the operator (a repository program with dynamic batching): its
        device loads it as one."""
        return self._load(model, config, trusted=True)

    def _load(
        self, model: Model, config: Mapping[str, Any] | None, trusted: bool
    ) -> BatchCompiledNetwork:
        cfg = self.merged_config(config)
        device = self._device(cfg)
        # a PyTorch program (a zip archive, TORCH's and GPU's) cannot be read here: its rows
        # are trusted to be independent, as Triton's dynamic batcher trusts every model's
        graph = None if zip_archive(model) else read_model(model)[0].graph
        why = row_coupling(graph) if graph is not None else ""
        if why:
            raise InvalidArgument(
                f"model {graph.name!r} cannot be batched: {why}, so a request's result "
                "would depend on the requests batched with it; serve it without BATCH"
            )
        network = self._devices().load_network(model, device, cfg.child(device), trusted=trusted)
        return self._wrap(cfg, device, network)

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        cfg = self.merged_config(config, strict=False)
        device = self._device(cfg)
        return self._devices().query_network(model, device, cfg.child(device))

    def refusals(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the nodes the batched device cannot run."""
        cfg = self.merged_config(config, strict=False)
        device = self._device(cfg)
        if zip_archive(model):  # a PyTorch program is one node: its query says where it runs
            return []
        proto, _ = read_model(model)
        nodes = [n.name for n in load_model(proto).nodes]
        child = cfg.child_strings(device)  # parsed by the device, whose errors say why
        return device_refusals(self._devices(), proto, device, child, nodes)

    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> BatchCompiledNetwork:
        """Import a device's export (see :meth:`BatchCompiledNetwork.export`) on the device
        named by ``BATCH:<device>(n)`` and batch it."""
        return self._import(data, config, trusted=False)

    def import_trusted(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> BatchCompiledNetwork:
        """:meth:`import_network` of the operator's blob (the model cache of a trusted load)."""
        return self._import(data, config, trusted=True)

    def _import(
        self, data: bytes, config: Mapping[str, Any] | None, trusted: bool
    ) -> BatchCompiledNetwork:
        cfg = self.merged_config(config)
        device = self._device(cfg)
        network = self._devices().import_network(
            data, device, cfg.child_strings(device), trusted=trusted
        )
        return self._wrap(cfg, device, network)

    def device_name(self) -> str:
        return "BATCH: concurrent requests gathered into batches on one device"
