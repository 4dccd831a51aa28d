"""Quantize/dequantize and the integer convolution and matmul ops."""

from __future__ import annotations
