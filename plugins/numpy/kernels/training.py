"""The ai.onnx.preview.training domain and losses."""

from __future__ import annotations
