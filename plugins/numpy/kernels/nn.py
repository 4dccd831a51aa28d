"""Convolution, pooling, Gemm and MatMul."""

from __future__ import annotations
