"""The OPENVINO device plugin: ONNX compiled and run by the openvino runtime on the CPU."""

from plugserve.plugins.openvino.plugin import OpenvinoPlugin

__all__ = ["OpenvinoPlugin"]
