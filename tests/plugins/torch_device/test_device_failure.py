"""A sticky CUDA error (plugins/torch/devmem.py) makes the device unusable for the process:
the classifier knows CUDA's sticky errors by their words; the request that met one fails
UNAVAILABLE and the device is marked failed (logged CRITICAL once); then the device's
requests and loads are refused UNAVAILABLE naming the first error, and its networks are not
ready, saying why, which the server's readiness reports. Errors that are not sticky (out of
memory, an invalid argument) leave the device serving. On TORCH, through the plugin API: the
device is marked failed by the same function a GPU request's failure calls."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from models import mlp

from plugserve.plugins.api import BackendUnavailable, DeviceOutOfMemory, InferenceError
from plugserve.plugins.torch import devmem

torch = pytest.importorskip("torch", reason="the TORCH device needs torch")

STICKY_MESSAGES = [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...",
    "CUDA error: device-side assert triggered",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
    "CUDA error: an illegal instruction was encountered",
    "CUDA error: uncorrectable ECC error encountered",
]
NOT_STICKY = [
    "CUDA out of memory. Tried to allocate 640.00 GiB",
    "CUDA error: invalid argument",
    "CUDA error: operation not permitted when stream is capturing",
    "index 10 is out of bounds for dimension 0 with size 10",
]


@pytest.mark.parametrize("text", STICKY_MESSAGES)
def test_sticky_errors_are_known_by_their_words(text):
    assert devmem.sticky_error(text)


@pytest.mark.parametrize("text", NOT_STICKY)
def test_other_errors_are_not_sticky(text):
    assert not devmem.sticky_error(text)


class _Network:
    """What _device_failure reads of a compiled network (its name, device and torch)."""

    def __init__(self, device) -> None:
        self.name = "m"
        self.torch_device = device
        self.program = type("P", (), {"torch": torch})()


@pytest.fixture
def cuda9():
    """A CUDA device no machine here has (only its name is used), forgotten afterwards."""
    device = torch.device("cuda", 9)
    yield device
    devmem._failed.pop(str(device), None)


def test_a_sticky_error_fails_the_request_unavailable_and_marks_the_device(cuda9, caplog):
    network = _Network(cuda9)
    cause = RuntimeError(STICKY_MESSAGES[1])
    with caplog.at_level(logging.CRITICAL, logger=devmem.__name__):
        plain = InferenceError("node x: boom")
        assert devmem._device_failure(plain, network) is plain  # not the device's: as it is
        wrapped = InferenceError("network 'm': node g (Gather): ...")
        wrapped.__cause__ = cause
        failure = devmem._device_failure(wrapped, network)
        assert isinstance(failure, BackendUnavailable), failure
        assert "device-side assert" in str(failure) and "GPU.9" in str(failure)
        devmem._device_failure(cause, network)  # a second one: still marked, logged once
    assert devmem.device_failure(cuda9) == "CUDA error: device-side assert triggered"
    assert sum("GPU.9 failed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(BackendUnavailable, match=r"GPU\.9 failed earlier.*device-side assert"):
        devmem.refuse_failed(cuda9, "a request of model 'm'")


def test_out_of_memory_and_other_cuda_errors_leave_the_device_serving(cuda9):
    network = _Network(cuda9)
    oom = devmem._device_failure(RuntimeError(NOT_STICKY[0]), network)
    assert isinstance(oom, DeviceOutOfMemory)
    other = devmem._device_failure(RuntimeError(NOT_STICKY[1]), network)
    assert isinstance(other, InferenceError) and not isinstance(other, BackendUnavailable)
    assert devmem.device_failure(cuda9) is None
    devmem.refuse_failed(cuda9, "a request")  # not refused


def test_a_failed_device_refuses_requests_and_loads_and_its_networks_are_not_ready(core):
    network = core.load_network(mlp(), "TORCH")
    request = network.create_infer_request()
    x = np.ones((2, 32), np.float32)
    request.infer({"x": x})
    assert network.ready() and network.unready_reasons() == []
    device = network.torch_device
    try:
        devmem.mark_failed(device, "CUDA error: an illegal memory access was encountered")
        assert not network.ready()
        (reason,) = network.unready_reasons()
        assert "illegal memory access" in reason and "restart" in reason, reason
        with pytest.raises(BackendUnavailable, match="illegal memory access"):
            request.infer({"x": x})
        with pytest.raises(BackendUnavailable, match="cannot load"):
            core.load_network(mlp(seed=1), "TORCH")
    finally:
        devmem._failed.pop(str(device), None)
    request.infer({"x": x})  # (the mark forgotten: the test leaves the device as it found it)


def test_ieee_fp32_turns_tf32_off_and_every_getter_still_answers():
    """plugins/torch/backend.ieee_fp32: TF32 off for matmuls, convolutions and RNNs, the matmul
    precision "highest" even after a library lowered it, and every getter, legacy and new,
    answers without torch's "mix of the legacy and new APIs" error."""
    from plugserve.plugins.torch.backend import ieee_fp32

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        ieee_fp32(torch)
        assert torch.get_float32_matmul_precision() == "highest"
        matmul = torch.backends.cuda.matmul
        assert matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
        if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
            assert matmul.fp32_precision == "ieee"
            assert torch.backends.cudnn.conv.fp32_precision != "tf32"
            assert torch.backends.cudnn.rnn.fp32_precision != "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_generation_engines_decoder_and_sampler_mark_a_sticky_error_too(cuda9):
    """The engine's decoder and sampler run outside a network's request: sticky_failure is
    their classification (the same words, the same marking); a CPU device never fails so, and
    an error that is not sticky is left to their own InferenceError."""
    from plugserve.plugins.torch.sampler import TorchSampler

    assert devmem.sticky_failure(RuntimeError(STICKY_MESSAGES[0]), torch.device("cpu"), "x") is None
    assert devmem.sticky_failure(RuntimeError(NOT_STICKY[1]), cuda9, "a step") is None
    assert devmem.device_failure(cuda9) is None
    failure = devmem.sticky_failure(RuntimeError(STICKY_MESSAGES[0]), cuda9, "a step")
    assert isinstance(failure, BackendUnavailable) and "illegal memory access" in str(failure)
    with pytest.raises(BackendUnavailable, match=r"a step: GPU\.9 failed earlier"):
        devmem.refuse_failed(cuda9, "a step")
    # the sampler's fetch, where an asynchronous CUDA error surfaces, answers so
    sampler = TorchSampler(None, "cpu")
    sampler.device = cuda9  # only its name: the error below never touches the card
    drawn = type("Drawn", (), {"rows": [], "bad": {}, "asked": [], "live": [0], "error": None})()
    drawn.rows, drawn.error = [object()], RuntimeError(STICKY_MESSAGES[1])
    bad: dict = {}
    drawn.bad = bad
    sampler.fetched(drawn, {})
    assert isinstance(bad[0], BackendUnavailable), bad
