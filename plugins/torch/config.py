"""TORCH's and GPU's configuration: the common keys plus the precision float32 values compute
in (INFERENCE_PRECISION_HINT), a PyTorch program's tensors (MODEL_TENSORS) and how many input
shapes are replayed as CUDA graphs (CUDA_GRAPHS).

One configuration for everything the device runs: an ONNX graph, a PyTorch program and a
safetensors folder's decoder (:mod:`.decoder`) read the same keys with the same meaning. Two
older spellings of the decoder's, from before it was the device's, are still read: the
precision's long names (``fp32``, ``float32``, ``fp16``, ``bfloat16``) and ``CUDA_GRAPHS``
as YES/NO (YES: :data:`GRAPHS_YES` shapes, NO: none)."""

from __future__ import annotations

from plugserve.plugins.api import ConfigKey, Configuration
from plugserve.plugins.torch.graphs import parse_shapes
from plugserve.plugins.torch.programs import parse_tensors

__all__ = ["DTYPES", "GRAPHS_YES", "PRECISIONS", "GpuConfiguration", "TorchConfiguration"]

#: each precision's torch dtype name (the one precision table: the device's loads and its
#: decoder's weights and cache)
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
PRECISIONS = tuple(DTYPES)
#: the precision's other spellings still read (the decoder's configuration before it was
#: the device's)
_ALIASES = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "bfloat16": "bf16"}
#: the shapes CUDA_GRAPHS=YES keeps captured (the decoder's old boolean; its shapes are at
#: most its 7 batch sizes times the widths to the context: YES kept every one of them)
GRAPHS_YES = 64


def _precision(value: str) -> str:
    text = str(value).strip().lower()
    text = _ALIASES.get(text, text)
    if text not in ("", *PRECISIONS):
        raise ValueError("expected f32, f16 or bf16 (empty: the device's default)")
    return text


_TENSORS_DOC = (
    "a PyTorch program's inputs and outputs (plugins/torch/programs.py), which a TorchScript "
    'file does not carry: JSON {"inputs": [[name, dtype, dims], ...], "outputs": [...]}, '
    "numpy dtype names, -1 a dimension of any size; a Triton repository's config.pbtxt fills "
    "it. Empty: a torch.export program's own signature. ONNX models ignore it"
)

_HINT_DOC = (
    "the precision float32 values compute in: f32, f16 or bf16; empty (the default): {default}. "
    "EXECUTION_MODE_HINT=ACCURACY computes f32 whatever this says. f32 is IEEE float32 "
    "everywhere (TF32 is never used)"
)


def _bytes(value: str) -> int:
    number = int(str(value).strip() or 0)
    if number < 0:
        raise ValueError("expected bytes >= 0 (0: the device's default)")
    return number


_BUDGET = ConfigKey(
    "DEVICE_MEMORY_BUDGET",
    0,
    _bytes,
    doc="bytes of the device's memory its networks' weights and requests' activations are "
    "charged against before they are allocated (devmem.py; the device's, shared by its "
    "networks): 0 (the default) is 90 % of the memory CUDA reports free on a GPU, none on "
    "the CPU",
)


def _graphs(value: str) -> int:
    text = str(value).strip().upper()
    if text in ("YES", "TRUE", "ON"):
        return GRAPHS_YES
    if text in ("NO", "FALSE", "OFF"):
        return 0
    count = int(text or 0)
    if count < 0:
        raise ValueError("expected the number of shapes kept as graphs per stream (0: none)")
    return count


def _shapes(value: str) -> str:
    parse_shapes(value)  # checked at set, parsed again by each stream's request
    return str(value).strip()


def _graph_keys(default: int) -> tuple[ConfigKey, ...]:
    return (
        ConfigKey(
            "CUDA_GRAPHS",
            default,
            _graphs,
            doc=f"input shapes (shapes and dtypes) each stream keeps captured as CUDA graphs, "
            f"the least recently used evicted; 0: none (default {default}); YES/NO (the "
            f"decoder's old spelling): {GRAPHS_YES}/0. A safetensors decoder's shapes are its "
            "decode steps' (batch size, keys read). On the CPU the same cache runs the eager "
            "program through static buffers (the tested twin)",
        ),
        ConfigKey(
            "CUDA_GRAPH_SHAPES",
            "",
            _shapes,
            doc="input shapes captured when each stream starts, before any request: shape "
            "sets separated by ';', the inputs' shapes in input order by ',', dimensions by "
            "'x' (1x3x224x224;8x3x224x224), or each named in any order (a=1x16,b=1x16: a "
            "config.pbtxt's graph_spec)",
        ),
    )


class TorchConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        _BUDGET,
        *_graph_keys(0),
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "",
            _precision,
            doc=_HINT_DOC.format(default="f32 on the CPU"),
        ),
        ConfigKey("MODEL_TENSORS", "", parse_tensors, doc=_TENSORS_DOC),
    )


class GpuConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        _BUDGET,
        *_graph_keys(8),
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "",
            _precision,
            doc=_HINT_DOC.format(
                default="f16 on a GPU (the fastest within the tolerance the device claims, "
                "1e-2 relative; as OPENVINO's bf16 default); a PyTorch program: f32"
            ),
        ),
        ConfigKey("MODEL_TENSORS", "", parse_tensors, doc=_TENSORS_DOC),
    )


def precision(config: Configuration, default: str) -> str:
    """The precision a load computes in: f32 under ACCURACY, else the hint, else ``default``."""
    if config.get("EXECUTION_MODE_HINT") == "ACCURACY":
        return "f32"
    return config.get("INFERENCE_PRECISION_HINT") or default
