"""The TORCH device (torch on the CPU) and the GPU device (torch on CUDA: ``GPU``, ``GPU.0``,
``GPU.1``...): ONNX converted node by node (:mod:`.ops`) into a program of torch steps
(:mod:`.program`). Both are the same code; TORCH is what CI tests, GPU what a CUDA machine
serves with.

PyTorch programs (TorchScript files, torch.export's ``.pt2``) load whole, as one node
(:mod:`.programs`); their inputs and outputs come from the model's configuration. A program is
code: it loads through :meth:`TorchPlugin.load_trusted` / :meth:`~TorchPlugin.import_trusted`
only (a model from the operator), and ``load_network`` / ``import_network`` refuse it with
PermissionDenied; QueryNetwork reads its listing and never loads it.

Precision is explicit (:mod:`.config`): float32 values compute in f32 (IEEE: TF32 off), f16 or
bf16; the GPU's default is f16, the CPU's f32, and ``EXECUTION_MODE_HINT=ACCURACY`` is f32 on
both. Without torch (or, for GPU, without a CUDA build of it or an NVIDIA driver) the
constructor raises and the Core lists the device unavailable with the reason; it reads torch's
installed files for that, and imports torch at the device's first load or query (9 s and
190 MB that no server start pays otherwise, ``backend``).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from plugserve.plugins import memory
from plugserve.plugins.api import (
    BackendUnavailable,
    InvalidArgument,
    Model,
    Plugin,
    Unsupported,
    available_cores,
)
from plugserve.plugins.ir import Graph, load_model, read_model
from plugserve.plugins.model_copies import serialized
from plugserve.plugins.passes.sizes import check_load_constants
from plugserve.plugins.shapecheck import shape_model
from plugserve.plugins.torch import backend, devmem
from plugserve.plugins.torch.compiled import TorchCompiledNetwork
from plugserve.plugins.torch.config import (
    DTYPES,
    GpuConfiguration,
    TorchConfiguration,
    precision,
)
from plugserve.plugins.torch.decoder import TorchDecoder, load_decoder
from plugserve.plugins.torch.ops.registry import converters
from plugserve.plugins.torch.program import Program
from plugserve.plugins.torch.programs import (
    TorchProgram,
    program_kind,
    read_program,
    refuse_untrusted,
)
from plugserve.plugins.torch.query import supported_nodes, unsupported_nodes

__all__ = ["GpuPlugin", "TorchPlugin"]


class TorchPlugin(Plugin):
    name = "TORCH"
    config_class = TorchConfiguration
    cancellation = "before each node"
    #: the precision a load computes in when neither the hint nor ACCURACY says
    default_precision = "f32"

    def __init__(self) -> None:
        super().__init__()
        self.version = backend.installed()  # raises, saying how to install torch, without it
        major = self.version.split(".")[0]
        self.architecture = f"{platform.machine() or 'unknown'}-torch{major}"

    @property
    def torch(self) -> Any:
        """torch, imported at the device's first load or query (``backend``: not at start)."""
        return backend.torch_module()

    # --- the device a load runs on

    def _device(self, config: Any) -> Any:
        return self.torch.device("cpu")

    def _compute(self, config: Any) -> tuple[str, Any]:
        chosen = precision(config, self.default_precision)
        return chosen, getattr(self.torch, DTYPES[chosen])

    # --- networks

    def _graph(self, model: Model) -> tuple[Graph, bytes, Any]:
        proto, _ = read_model(model)  # external data inlined here, safely
        graph = load_model(proto)
        check_load_constants(graph, self.name)
        return graph, serialized(proto), proto

    def _compile(
        self, graph: Graph, data: bytes, cfg: Any, name: str | None = None
    ) -> TorchCompiledNetwork:
        device = self._device(cfg)
        devmem.refuse_failed(device, f"model {name or graph.name!r} cannot load")
        chosen, compute = self._compute(cfg)
        refused = unsupported_nodes(graph, self.torch, device, compute)
        if refused:
            shown = "; ".join(f"node {n!r}: {why}" for n, why in list(refused.items())[:8])
            more = f" (and {len(refused) - 8} more)" if len(refused) > 8 else ""
            raise Unsupported(
                f"model {graph.name!r} has nodes {self.name} cannot run: {shown}{more}; "
                f"HETERO:{self.name},NUMPY runs them on NUMPY"
            )
        # the weights are charged to the device's memory before they are copied to it
        itemsize = int(compute.itemsize)
        memory = devmem.device_memory(self.torch, device, cfg.get("DEVICE_MEMORY_BUDGET"))
        weights = memory.charge_weights(
            devmem.weights_nbytes(graph.initializers, itemsize), f"model {graph.name!r}"
        )
        try:
            program = Program(graph, self.torch, device, compute)
            # and what the program holds beside them: folded constants, kept moved values
            held = memory.charge_weights(
                program.device_nbytes, f"model {graph.name!r} (folded constants, kept shape values)"
            )
        except BaseException:
            weights.release()
            raise
        network = TorchCompiledNetwork(
            self,
            cfg,
            name or graph.name,
            list(graph.inputs),
            list(graph.outputs),
            program,
            data,
            chosen,
            device,
        )
        network.memory = memory
        network.activations = devmem.Activations(graph, itemsize)
        devmem.hold_while_alive(network, weights)
        devmem.hold_while_alive(network, held)
        return network

    def _compile_program(
        self, data: bytes, cfg: Any, name: str, trusted: bool
    ) -> TorchCompiledNetwork:
        """A PyTorch program, whole; it computes in f32 unless the hint says otherwise (its own
        constants may be f32: the converters' f16 default is for ONNX graphs). ``trusted``:
        the program is the operator's, else it is refused before anything of it is loaded."""
        if not trusted:
            raise refuse_untrusted(program_kind(data), name)
        device = self._device(cfg)
        devmem.refuse_failed(device, f"model {name!r} cannot load")
        chosen = precision(cfg, "f32")
        program = TorchProgram(
            data,
            cfg.get("MODEL_TENSORS"),
            self.torch,
            device,
            getattr(self.torch, DTYPES[chosen]),
            name,
            trusted=True,
        )
        return TorchCompiledNetwork(
            self, cfg, name, program.inputs, program.outputs, program, data, chosen, device
        )

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> TorchCompiledNetwork:
        """An ONNX model from anyone; a PyTorch program is refused (PermissionDenied)."""
        return self._load(model, config, trusted=False)

    def load_trusted(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> TorchCompiledNetwork:
        """An ONNX model or a PyTorch program from the operator."""
        return self._load(model, config, trusted=True)

    @memory.giving_back
    def _load(
        self, model: Model, config: Mapping[str, Any] | None, trusted: bool
    ) -> TorchCompiledNetwork:
        cfg = self.merged_config(config)
        program = read_program(model)
        if program is not None:
            return self._compile_program(program, cfg, _program_name(model), trusted)
        graph, data, proto = self._graph(model)
        network = self._compile(graph, data, cfg)
        network.shape_model = shape_model(proto)
        return network

    def load_decoder(
        self,
        folder: Path,
        model_config: Mapping[str, Any],
        config: Mapping[str, Any] | None,
        capacity: int,
        slots: Callable[[int], int],
    ) -> tuple[TorchDecoder, int, dict[str, Any]]:
        """A safetensors folder's decoder (:mod:`.decoder`) on this device's torch device
        (``GPU.1``: card 1), configured by this device's keys."""
        cfg = self.merged_config(config)
        device = self._device(cfg)
        devmem.refuse_failed(device, f"model {folder.name!r} cannot load")
        return load_decoder(folder, model_config, cfg, device, capacity, slots)

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        cfg = self.merged_config(config, strict=False)
        program = read_program(model)
        if program is not None:  # one node: all or nothing, HETERO cannot cut it
            # its listing says what it is; loading it would run its code, whoever sent it
            kind = program_kind(program)
            name = _program_name(model)
            node = f"{kind} program" if name == "program" else f"{name} ({kind} program)"
            return {f"{node}, run whole": self.name}
        return self._query_graph(load_model(model), cfg)[0]

    def query_with_reasons(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        if read_program(model) is not None:
            return self.query_network(model, config), {}
        return self._query_graph(load_model(model), self.merged_config(config, strict=False))

    def _query_graph(self, graph: Graph, cfg: Any) -> tuple[dict[str, str], dict[str, str]]:
        """What a query answers of a graph: its supported nodes and why the others are not."""
        check_load_constants(graph, self.name)
        _, compute = self._compute(cfg)
        refused = unsupported_nodes(graph, self.torch, self._device(cfg), compute)
        return {name: self.name for name in sorted(supported_nodes(graph, refused))}, refused

    def unsupported_nodes(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        cfg = self.merged_config(config, strict=False)
        if read_program(model) is not None:
            return {}  # a program loads whole or not at all: query_network says which
        _, compute = self._compute(cfg)
        return unsupported_nodes(load_model(model), self.torch, self._device(cfg), compute)

    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> TorchCompiledNetwork:
        """An exported ONNX network from anyone; an exported program (its archive) is
        refused (PermissionDenied)."""
        return self._import(data, config, trusted=False)

    def import_trusted(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> TorchCompiledNetwork:
        """An exported network or program from the operator (the Core's model cache)."""
        return self._import(data, config, trusted=True)

    def _import(
        self, data: bytes, config: Mapping[str, Any] | None, trusted: bool
    ) -> TorchCompiledNetwork:
        header, payload, cfg = self._unpack(data, config)
        if header.get("program"):
            name = str(header.get("network_name") or "model")
            return self._compile_program(payload, cfg, name, trusted)
        import onnx

        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(payload)
            graph = load_model(proto)
        except Exception as exc:
            raise InvalidArgument(f"exported network is corrupt: {exc}") from None
        return self._compile(graph, payload, cfg, str(header.get("network_name") or graph.name))

    # --- metrics

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "SUPPORTED_OPS"]

    def device_name(self) -> str:
        return backend.cpu_full_name()

    def capabilities(self) -> list[str]:
        return backend.cpu_capabilities()

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        if name == "SUPPORTED_OPS":
            return converters.ops()
        if name == "RANGE_FOR_STREAMS":
            return (1, available_cores())
        return super()._metric(name, options)


def _program_name(model: Model) -> str:
    """A program's network name: its file's name without the suffix (``model`` for Triton's
    ``model.pt``), ``program`` for bytes; the server names a repository's network itself."""
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        return Path(model).stem or "program"
    return "program"


class GpuPlugin(TorchPlugin):
    """CUDA GPUs: ``GPU`` is the first, ``GPU.<n>`` the n-th (DEVICE_ID), as OpenVINO users
    address Intel GPUs."""

    name = "GPU"
    config_class = GpuConfiguration
    default_precision = "f16"

    def __init__(self) -> None:
        super().__init__()
        cuda = backend.cuda_build()
        if cuda is None:
            raise BackendUnavailable(
                f"torch {self.version} is a CPU-only build (no CUDA); for GPUs: "
                f"{backend.INSTALL_CUDA}"
            )
        if not backend.driver_present():
            raise BackendUnavailable(
                f"torch {self.version} (CUDA {cuda}) sees no CUDA device (no GPU, no NVIDIA "
                "driver, or CUDA_VISIBLE_DEVICES hides them)"
            )
        self._cards: list[backend.CudaCard] | None = None

    @property
    def cards(self) -> list[backend.CudaCard]:
        """The CUDA cards, asked of torch at first use (torch is imported then)."""
        if self._cards is None:
            self._cards = backend.require_cuda()
            backend.ieee_fp32(self.torch)  # f32 is IEEE float32 on every card (no TF32)
            major = self.version.split(".")[0]
            self.architecture = f"{self._cards[0].architecture}-torch{major}"
        return self._cards

    def _unpack(self, data: bytes, config: Any) -> Any:
        self.cards  # noqa: B018 (the architecture an import must match is the card's)
        return super()._unpack(data, config)

    def _compile(self, *args: Any, **kwargs: Any) -> TorchCompiledNetwork:
        self.cards  # noqa: B018 (TF32 off before the first network)
        return super()._compile(*args, **kwargs)

    def _compile_program(
        self, data: bytes, cfg: Any, name: str, trusted: bool
    ) -> TorchCompiledNetwork:
        if trusted:  # (one refused touches no card)
            self.cards  # noqa: B018 (TF32 off before the first network)
        return super()._compile_program(data, cfg, name, trusted)

    def _card(self, device_id: Any) -> backend.CudaCard:
        text = str(device_id or "0").strip() or "0"
        try:
            index = int(text)
            return self.cards[index]
        except (ValueError, IndexError):
            raise InvalidArgument(
                f"device GPU.{text}: no such GPU; GPUs: "
                + ", ".join(f"GPU.{c.index} ({c.name})" for c in self.cards)
            ) from None

    def _device(self, config: Any) -> Any:
        return self.torch.device("cuda", self._card(config.get("DEVICE_ID")).index)

    def device_name(self) -> str:
        return self._full_name(self.cards[0])

    def _full_name(self, card: backend.CudaCard) -> str:
        return (
            f"{card.name} (torch {self.version}, CUDA {self.torch.version.cuda}, "
            f"compute capability {card.capability[0]}.{card.capability[1]})"
        )

    def supported_metrics(self) -> list[str]:
        return [
            *super().supported_metrics(),
            "GPU_DEVICE_TOTAL_MEM_SIZE",
            "GPU_COMPUTE_CAPABILITY",
            "DEVICE_UUID",
        ]

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        card = self._card(options.get("DEVICE_ID") or self.config.get("DEVICE_ID"))
        if name == "AVAILABLE_DEVICES":
            return [str(c.index) for c in self.cards]
        if name == "FULL_DEVICE_NAME":
            return self._full_name(card)
        if name == "GPU_DEVICE_TOTAL_MEM_SIZE":
            return card.total_memory
        if name == "GPU_COMPUTE_CAPABILITY":
            return f"{card.capability[0]}.{card.capability[1]}"
        if name == "DEVICE_UUID":
            return card.uuid
        if name == "OPTIMIZATION_CAPABILITIES":
            return backend.cuda_capabilities(card)
        if name == "DEVICE_ARCHITECTURE":
            self.cards  # noqa: B018
            return self.architecture
        if name == "RANGE_FOR_STREAMS":
            return (1, 8)
        return super()._metric(name, options)
