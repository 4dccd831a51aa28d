"""The RAY device plugin: a network compiled and run on a node of a Ray cluster."""

from plugserve.plugins.ray.plugin import RayPlugin

__all__ = ["RayPlugin"]
