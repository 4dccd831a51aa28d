"""The NUMPY device plugin: plugserve's reference plugin on its own numpy kernels."""

from plugserve.plugins.numpy.plugin import Extension, NumpyPlugin

__all__ = ["Extension", "NumpyPlugin"]
