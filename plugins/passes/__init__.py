"""Transformation passes over the network IR and the standard pipeline that runs them."""

from plugserve.plugins.passes.cleanup import eliminate_dead_nodes
from plugserve.plugins.passes.decompose import decompose_divide
from plugserve.plugins.passes.folding import fold_constants, fold_shapes
from plugserve.plugins.passes.fusion import (
    FUSED_DOMAIN,
    fold_conv_batchnorm,
    fuse_activations,
    fuse_conv_pool,
    fuse_gelu,
    fuse_relu_relu,
)
from plugserve.plugins.passes.inline import inline_functions
from plugserve.plugins.passes.manager import Pass, PassContext, PassManager
from plugserve.plugins.passes.precision import convert_f16_to_f32
from plugserve.plugins.passes.transformer import fuse_transformer
from plugserve.plugins.passes.types import infer_extension_types

__all__ = [
    "FUSED_DOMAIN",
    "Pass",
    "PassContext",
    "PassManager",
    "standard_pipeline",
]


def standard_pipeline() -> PassManager:
    """The order matters: inline first so later passes see plain ops; fold before fusing."""
    return PassManager(
        [
            ("infer_extension_types", infer_extension_types),
            ("inline_functions", inline_functions),
            ("convert_f16_to_f32", convert_f16_to_f32),
            ("fold_shapes", fold_shapes),
            ("fold_constants", fold_constants),
            ("fold_shapes_again", fold_shapes),
            ("fold_constants_again", fold_constants),
            ("decompose_divide", decompose_divide),
            ("fold_conv_batchnorm", fold_conv_batchnorm),
            ("fuse_relu_relu", fuse_relu_relu),
            ("fuse_activations", fuse_activations),
            ("fuse_conv_pool", fuse_conv_pool),
            ("fuse_gelu", fuse_gelu),
            ("fuse_transformer", fuse_transformer),
            ("eliminate_dead_nodes", eliminate_dead_nodes),
        ]
    )
