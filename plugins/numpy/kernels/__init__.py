"""NUMPY's kernels for the ONNX standard domains (and onnxruntime's contrib ops its tools
write: :mod:`contrib`, :mod:`decoder`), one family of ops per module.

Importing this package registers every kernel in :data:`registry.default_registry`.
"""

from plugserve.plugins.numpy.kernels import (  # noqa: F401  (imported to register kernels)
    contrib,
    control,
    conv,
    decoder,
    elementwise,
    fused,
    gemm,
    image,
    ml,
    ml_classifiers,
    ml_encoders,
    ml_trees,
    pool,
    quantize,
    random,
    reduce,
    rnn,
    sequence,
    signal,
    strings,
    tensor,
    training,
    vision,
)
from plugserve.plugins.numpy.kernels.registry import (
    REQUIRED,
    KernelContext,
    Registry,
    default_registry,
    register,
)

__all__ = ["REQUIRED", "KernelContext", "Registry", "default_registry", "register"]
