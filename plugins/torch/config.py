"""TORCH's and GPU's configuration: the common keys plus the precision float32 values compute
in (INFERENCE_PRECISION_HINT) and, for the GPU, whether its input shapes are replayed as CUDA
graphs."""

from __future__ import annotations

from plugserve.plugins.api import ConfigKey, Configuration

__all__ = ["PRECISIONS", "GpuConfiguration", "TorchConfiguration"]

PRECISIONS = ("f32", "f16", "bf16")


def _precision(value: str) -> str:
    text = str(value).strip().lower()
    if text not in ("", *PRECISIONS):
        raise ValueError("expected f32, f16 or bf16 (empty: the device's default)")
    return text


_HINT_DOC = (
    "the precision float32 values compute in: f32, f16 or bf16; empty (the default): {default}. "
    "EXECUTION_MODE_HINT=ACCURACY computes f32 whatever this says. f32 is IEEE float32 "
    "everywhere (TF32 is never used)"
)


def _graphs(value: str) -> int:
    count = int(str(value).strip() or 0)
    if count < 0:
        raise ValueError("expected the number of shapes kept as graphs per stream (0: none)")
    return count


def _shapes(value: str) -> str:
    from plugserve.plugins.torch.graphs import parse_shapes

    parse_shapes(value)  # checked at set, parsed again by each stream's request
    return str(value).strip()


def _graph_keys(default: int) -> tuple[ConfigKey, ...]:
    return (
        ConfigKey(
            "CUDA_GRAPHS",
            default,
            _graphs,
            doc=f"input shapes (shapes and dtypes) each stream keeps captured as CUDA graphs, "
            f"the least recently used evicted; 0: none (default {default}). On the CPU the same "
            "cache runs the eager program through static buffers (the tested twin)",
        ),
        ConfigKey(
            "CUDA_GRAPH_SHAPES",
            "",
            _shapes,
            doc="input shapes captured when each stream starts, before any request: shape "
            "sets separated by ';', the inputs' shapes in input order by ',', dimensions by "
            "'x' (1x3x224x224;8x3x224x224)",
        ),
    )


class TorchConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        *_graph_keys(0),
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "",
            _precision,
            doc=_HINT_DOC.format(default="f32 on the CPU"),
        ),
    )


class GpuConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        *_graph_keys(8),
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "",
            _precision,
            doc=_HINT_DOC.format(
                default="f16 on a GPU (the fastest within the tolerance the device claims, "
                "1e-2 relative; as OPENVINO's bf16 default)"
            ),
        ),
    )


def precision(config: Configuration, default: str) -> str:
    """The precision a load computes in: f32 under ACCURACY, else the hint, else ``default``."""
    if config.get("EXECUTION_MODE_HINT") == "ACCURACY":
        return "f32"
    return config.get("INFERENCE_PRECISION_HINT") or default
