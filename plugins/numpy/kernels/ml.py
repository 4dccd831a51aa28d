"""The ai.onnx.ml domain."""

from __future__ import annotations
