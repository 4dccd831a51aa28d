"""The ORT device plugin: ONNX Runtime's CPU execution provider behind the plugserve API."""

from plugserve.plugins.ort.plugin import OrtPlugin

__all__ = ["OrtPlugin"]
