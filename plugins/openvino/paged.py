"""``PAGED_ATTENTION=YES``: an LLM's IR turned, at load, into the paged-attention form that
openvino-genai's continuous batching runs (OpenVINO Model Server's LLM engine).

Why. optimum-intel's stateful IR keeps the key/value cache in the model's variables, one
``[batch, heads, length, dim]`` tensor per layer: every row of a batch has the same length,
so rows of different lengths (the sequences of continuous batching, some in their prompt,
some decoding) cannot share a forward. openvino's ``SDPAToPagedAttention`` pass (Python:
``openvino._offline_transformations.paged_attention_transformation``) replaces each
ScaledDotProductAttention and its variables by a ``PagedAttentionExtension`` op reading and
writing a cache of blocks; the forward then takes any mix of sequences, each its own length.

The form after the pass, as the CPU plugin compiles it (openvino 2026.4):

- ``input_ids``, ``position_ids`` ``[tokens]`` i64: every sequence's new tokens, one after
  the other (tokens on the batch axis);
- ``past_lens`` ``[seqs]`` i32: the tokens each sequence already has in its blocks (its new
  ones are written after them); ``subsequence_begins`` ``[seqs + 1]`` i32: where each
  sequence's tokens start in ``input_ids``; ``block_indices`` ``[blocks]`` i32 and
  ``block_indices_begins`` ``[seqs + 1]`` i32: each sequence's blocks, in order;
  ``max_context_len`` i32 scalar: the longest ``past + new``;
- ``key_cache.N``, ``value_cache.N`` per layer: ``[blocks, kv_heads, block_size, head_dim]``
  in the element type the plugin chose (``KV_CACHE_PRECISION``: f16 under PERFORMANCE on an
  AVX2 CPU, f32 under ACCURACY; u8 adds its scales and zero points to the block: the key
  cache by channel ``[blocks, heads, block_size + 8, dim]``, the value by token
  ``[blocks, heads, block_size, dim + 8]``). ``block_size`` is 32 on the CPU. The op writes
  the new tokens' keys and values into these inputs in place: whoever runs the network binds
  them once and keeps them (``infer_into`` shares the arrays' memory).

Only the last token of each sequence needs its logits; openvino-genai gathers those rows
before the LM head's MatMul (its ``apply_gather_before_matmul_transformation``), as
:func:`gather_before_head` does here with the same input name, ``sampled_tokens_indices``
(i64 ``[seqs]``: indices into the tokens). Without it a 2,000-token prompt would compute
2,000 x vocabulary logits (131 MB at a 16 K vocabulary) to use one row. A head this does not
recognise is left whole (logits for every token; the caller picks the rows).

Score outputs, cache rotation, XAttention and the per-layer block tables the pass can add are
not asked for (no cache eviction here).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidModel

__all__ = ["PAGED_INPUTS", "SAMPLED", "gather_before_head", "to_paged"]

#: the inputs every paged form has, besides the ids, positions and caches
PAGED_INPUTS = (
    "past_lens",
    "subsequence_begins",
    "block_indices",
    "block_indices_begins",
    "max_context_len",
)
SAMPLED = "sampled_tokens_indices"
#: element-wise ops that may stand between the LM head's MatMul and the logits (a bias, a
#: final logit softcap as Gemma's, a Convert to f32), each with constants as its other inputs
_AFTER_HEAD = ("Convert", "Add", "Multiply", "Divide", "Tanh")


def to_paged(model: Any, name: str) -> None:
    """Rewrite ``model`` (an ``ov.Model``) into the paged form, in place."""
    from openvino._offline_transformations import paged_attention_transformation

    kinds = {op.get_type_name() for op in model.get_ordered_ops()}
    if "ScaledDotProductAttention" not in kinds:
        raise InvalidModel(
            f"model {name!r}: PAGED_ATTENTION needs a decoder whose attention is openvino's "
            "ScaledDotProductAttention with its key/value cache in the model (optimum-intel's "
            "stateful export: optimum-cli export openvino --task text-generation-with-past); "
            "this model has none"
        )
    try:
        paged_attention_transformation(model)
        model.validate_nodes_and_infer_types()
    except Exception as exc:
        raise InvalidModel(
            f"model {name!r}: openvino's paged-attention transformation failed: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
        ) from None
    names = {n for port in model.inputs for n in port.get_names()}
    missing = [n for n in ("input_ids", *PAGED_INPUTS) if n not in names]
    if missing or not any(n.startswith("key_cache.") for n in names):
        raise InvalidModel(
            f"model {name!r}: after the paged-attention transformation it lacks the inputs "
            f"{missing or ['key_cache.N']}; plugserve feeds input_ids (not embeddings) models"
        )
    gather_before_head(model)


def _constant_inputs(op: Any, keep: int) -> bool:
    return all(
        i == keep or op.input_value(i).get_node().get_type_name() == "Constant"
        for i in range(op.get_input_size())
    )


def gather_before_head(model: Any) -> bool:
    """Add ``sampled_tokens_indices`` and gather those tokens' hidden states before the LM
    head; False (the model unchanged) when the logits' MatMul is not found."""
    import openvino as ov
    from openvino import opset8

    result = next(
        (r for r in model.outputs if "logits" in r.get_names()), model.outputs[0]
    ).get_node()
    node = result.input_value(0).get_node()
    while node.get_type_name() in _AFTER_HEAD:
        # the chain goes through the one input that is not a Constant
        moving = [
            i
            for i in range(node.get_input_size())
            if node.input_value(i).get_node().get_type_name() != "Constant"
        ]
        if len(moving) != 1 or not _constant_inputs(node, moving[0]):
            return False
        node = node.input_value(moving[0]).get_node()
    if node.get_type_name() != "MatMul":
        return False
    hidden = node.input_value(0)
    rank = hidden.get_partial_shape().rank
    if rank.is_dynamic or rank.get_length() != 3:
        return False
    indices = opset8.parameter(ov.PartialShape([-1]), ov.Type.i64, name=SAMPLED)
    indices.output(0).get_tensor().set_names({SAMPLED})
    gathered = opset8.gather(hidden, indices, opset8.constant(np.int64(0)))
    node.input(0).replace_source_output(gathered.output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()
    return True
