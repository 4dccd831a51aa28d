"""OPENVINO's configuration: the common keys plus the inference precision openvino computes in.

The defaults are openvino's own: ``EXECUTION_MODE_HINT=PERFORMANCE`` and no precision hint, so
a CPU with bf16 arithmetic (AVX512-BF16, AMX) computes in bf16, as OpenVINO Model Server
does; a model moved here from it runs as fast. ``ACCURACY`` (or ``INFERENCE_PRECISION_HINT=f32``)
gives the other devices' results.
"""

from __future__ import annotations

from typing import Any

from plugserve.plugins.api import BOOL, STATE_PAIRS, ConfigKey, Configuration, parse_state_pairs

__all__ = ["OpenvinoConfiguration", "compile_properties", "precision_name"]

PRECISIONS = ("f32", "bf16", "f16")
#: what the CPU plugin keeps a paged or stateful key/value cache in
KV_PRECISIONS = ("f32", "f16", "bf16", "u8")


def _precision(value: str) -> str:
    text = str(value).strip().lower()
    if text not in ("", *PRECISIONS):
        raise ValueError("expected f32, bf16 or f16 (empty: openvino's choice)")
    return text


def _kv_precision(value: str) -> str:
    text = str(value).strip().lower()
    if text not in ("", *KV_PRECISIONS):
        raise ValueError(f"expected {', '.join(KV_PRECISIONS)} (empty: openvino's choice)")
    return text


class OpenvinoConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "",
            _precision,
            doc=(
                "empty (default): openvino's choice for EXECUTION_MODE_HINT (bf16 on CPUs with "
                "it under PERFORMANCE, the model's own under ACCURACY); f32: results match the "
                "other devices; bf16 or f16: reduced precision (relative error about "
                "1e-3..1e-2; f16 falls back to bf16 on CPUs without f16 arithmetic)"
            ),
        ),
        ConfigKey(
            "UNBOUNDED_LOOPS",
            False,
            **BOOL,
            doc=(
                "YES: run Loops whose trip count comes from the request; openvino cannot stop "
                "a Loop once it runs, so a cancelled or late request keeps the device busy "
                "until the Loop ends (NO, the default: such Loops are left to other devices)"
            ),
        ),
        ConfigKey(
            "PAGED_ATTENTION",
            False,
            **BOOL,
            doc=(
                "YES: load an OpenVINO IR of a decoder (optimum-intel's stateful export) in "
                "openvino's paged-attention form, the one openvino-genai's continuous "
                "batching runs: rows of different lengths in one forward, the key/value "
                "cache in blocks the caller binds (plugins/openvino/paged.py)"
            ),
        ),
        ConfigKey(
            "KV_CACHE_PRECISION",
            "",
            _kv_precision,
            doc=(
                "the element type of a paged or stateful key/value cache: empty (default) is "
                "openvino's choice (f16 under PERFORMANCE on CPUs without bf16, the "
                "inference precision under ACCURACY), or f32, f16, bf16, u8"
            ),
        ),
        ConfigKey(
            STATE_PAIRS,
            {},
            parse_state_pairs,
            lambda pairs: ",".join(f"{i}:{o}" for i, o in pairs.items()),
            doc=(
                "state_input:state_output,...: openvino's MakeStateful turns each pair into a "
                "variable state kept in the infer request (query_state, reset_state)"
            ),
        ),
    )


def compile_properties(config: Configuration) -> dict[str, Any]:
    """The openvino CPU properties a configuration stands for (keys left at 0/"" are omitted)."""
    props: dict[str, Any] = {
        "EXECUTION_MODE_HINT": config.get("EXECUTION_MODE_HINT"),
        "PERF_COUNT": bool(config.get("PERF_COUNT")),
    }
    if config.get("INFERENCE_PRECISION_HINT"):
        props["INFERENCE_PRECISION_HINT"] = config.get("INFERENCE_PRECISION_HINT")
    if config.get("INFERENCE_PRECISION_HINT") == "f32":
        # openvino's CPU quantizes activations to int8 on the fly for models whose weights
        # are stored int8 (Cast + Mul before a MatMul): all-MiniLM-L6-v2 int8 came out 0.05
        # off on 96 % of its embedding. f32 promises the other devices' results: off
        # (ACCURACY turns it off itself).
        props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    if config.get("KV_CACHE_PRECISION"):
        props["KV_CACHE_PRECISION"] = config.get("KV_CACHE_PRECISION")
    if config.get("PERFORMANCE_HINT"):
        props["PERFORMANCE_HINT"] = config.get("PERFORMANCE_HINT")
    if config.get("NUM_STREAMS"):
        props["NUM_STREAMS"] = int(config.get("NUM_STREAMS"))
    if config.get("INFERENCE_NUM_THREADS"):
        props["INFERENCE_NUM_THREADS"] = int(config.get("INFERENCE_NUM_THREADS"))
    return props


#: openvino's element types as the precision names of INFERENCE_PRECISION_HINT; "dynamic" is
#: what ACCURACY reports: each op in the model's own types, f32 for an f32 model.
_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "dynamic": "f32", "f32": "f32"}


def precision_name(value: Any) -> str:
    """``<Type: 'bfloat16'>`` (or ``bf16``) -> ``bf16``: the name users and configs use."""
    text = str(value)
    inner = text.split("'")[1] if "'" in text else text
    return _NAMES.get(inner.strip().lower(), inner.strip().lower())
