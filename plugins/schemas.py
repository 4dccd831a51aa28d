"""Schemas of the ONNX-domain ops that onnxruntime defines and onnx does not.

onnxruntime registers a few of its own ops in the default ONNX domain, and its tools write them
there: onnxruntime-genai's model builder puts ``SimplifiedLayerNormalization`` (RMS
normalization) at the head of every Llama, Qwen or Phi decoder it exports. onnx's checker
refuses a model with a default-domain op it does not know ("No Op registered for
SimplifiedLayerNormalization with domain_version of 22"), so such a model could not be loaded
at all, on any device. Registering the op's schema with onnx (as onnxruntime's contrib schema
defines it: inputs, outputs, attributes, and the output's type and shape taken from the input)
lets the checker and shape inference accept it; each device then runs it or refuses it as it
does any op. Registration happens once, when this module is imported, and only for ops onnx
does not already define.
"""

from __future__ import annotations

from onnx import defs

__all__ = ["register_onnxruntime_schemas"]

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(double)", "tensor(bfloat16)"]


def _same_as_input(ctx: defs.InferenceContext) -> None:  # type: ignore[name-defined]
    """Y has X's element type and shape (onnxruntime's inference for these ops; the scale's
    type equals X's in every model its tools write)."""
    ctx.set_output_type(0, ctx.get_input_type(0))


def _simplified_layer_normalization() -> defs.OpSchema:
    param = defs.OpSchema.FormalParameter
    optional = defs.OpSchema.FormalParameterOption.Optional
    attr = defs.OpSchema.Attribute
    schema = defs.OpSchema(
        "SimplifiedLayerNormalization",
        "",
        1,
        "RMS normalization over the axes from `axis` on, times `scale` (onnxruntime's).",
        inputs=[param("X", "T"), param("scale", "V")],
        outputs=[param("Y", "V"), param("inv_std_var", "U", param_option=optional)],
        type_constraints=[
            ("T", _FLOATS, "input"),
            ("U", ["tensor(float)", "tensor(double)", "tensor(bfloat16)"], "statistics"),
            ("V", _FLOATS, "output and scale"),
        ],
        attributes=[
            attr("axis", defs.OpSchema.AttrType.INT, "first normalized axis", required=False),
            attr("epsilon", defs.OpSchema.AttrType.FLOAT, "added to the variance", required=False),
            attr("stash_type", defs.OpSchema.AttrType.INT, "statistics' type", required=False),
        ],
    )
    schema.set_type_and_shape_inference_function(_same_as_input)
    return schema


_SCHEMAS = {"SimplifiedLayerNormalization": _simplified_layer_normalization}


def register_onnxruntime_schemas() -> None:
    """Register each schema onnx lacks (idempotent: a known op is left as onnx has it)."""
    for name, make in _SCHEMAS.items():
        if not defs.has(name, ""):
            defs.register_schema(make())


register_onnxruntime_schemas()
