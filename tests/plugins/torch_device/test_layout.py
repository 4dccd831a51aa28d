"""Channels-last convolutions (plugins/torch/layout.py) on CUDA at f16/bf16 change strides only,
never values; on the CPU and at f32 nothing changes. Here: the CPU path is untouched (weights
as they were, cuDNN's benchmark flag not set, outputs identical to a program built with the
layout off); and the CUDA path's conversion, run on the CPU (``layout.wanted`` widened for
the test, at f32), holds the Conv weights channels-last and gives the same outputs as the
plain layout."""

from __future__ import annotations

import numpy as np
import pytest
from models import small_cnn

from plugserve.plugins.ir import load_model
from plugserve.plugins.torch import layout
from plugserve.plugins.torch.program import Program

torch = pytest.importorskip("torch", reason="the TORCH device needs torch")

X = np.random.default_rng(3).normal(size=(2, 3, 16, 16)).astype(np.float32)


def _weights(program: Program) -> list:
    return [t for t in program.template if t is not None and t.dim() == 4]


@pytest.fixture
def benchmark_flag():
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cudnn.benchmark = before


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_the_cpu_path_is_unchanged(compute, benchmark_flag):
    dtype = getattr(torch, compute)
    assert not layout.wanted(torch, torch.device("cpu"), dtype)
    program = Program(load_model(small_cnn(batch="n")), torch, torch.device("cpu"), dtype)
    weights = _weights(program)
    assert len(weights) == 2 and all(w.is_contiguous() for w in weights)
    assert torch.backends.cudnn.benchmark is False
    assert not layout.wanted(torch, torch.device("cuda", 0), torch.float32)  # f32 on CUDA too
    assert layout.wanted(torch, torch.device("cuda", 0), torch.float16)


def test_channels_last_gives_the_same_outputs(monkeypatch, benchmark_flag):
    graph = load_model(small_cnn(batch="n"))
    cpu = torch.device("cpu")
    plain = Program(graph, torch, cpu, torch.float32).run([X])[0]
    monkeypatch.setattr(layout, "wanted", lambda torch, device, compute: device.type == "cpu")
    nhwc = Program(load_model(small_cnn(batch="n")), torch, cpu, torch.float32)
    weights = _weights(nhwc)
    assert len(weights) == 2
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    assert not all(w.is_contiguous() for w in weights)  # really converted
    assert torch.backends.cudnn.benchmark is True  # a network with convolutions
    np.testing.assert_allclose(nhwc.run([X])[0], plain, rtol=1e-5, atol=1e-6)
