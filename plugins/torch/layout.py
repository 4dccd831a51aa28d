"""Channels-last convolutions on CUDA at f16 and bf16 (issue 49's vision target: ResNet-50 f16
at batch 32 at least as fast as torch's own eager forward, which runs channels-last).

On Hopper and Ampere, cuDNN's f16/bf16 convolutions are NHWC kernels: given NCHW tensors it
transposes around each convolution, typically 1.3-2x slower on ResNet-50. So, where a network
runs on a CUDA device in f16 or bf16 (:func:`wanted`):

* its 4-D Conv weights that are initializers are held ``torch.channels_last`` (once, at load:
  :func:`weights_channels_last`);
* each 2-D Conv makes its input channels-last when it is not (the network's input, once: Conv,
  BatchNormalization, Relu, Add, MaxPool and GlobalAveragePool keep the layout, so later
  convolutions find it so) (:func:`input_channels_last`);
* ``torch.backends.cudnn.benchmark`` is on (:func:`benchmark`): cuDNN times its algorithms at
  a shape's first run and keeps the fastest. It is set at the load of such a network, for the
  process, not around one lane's warm-up: it is a process-wide flag, which toggling from one
  request's thread would change under every other lane's concurrent runs anyway; a lane's
  first (eager) run of a shape is then its benchmark, and the CUDA graph captured at the
  shape's second request bakes in the algorithms chosen. It changes which algorithm runs,
  not the arithmetic's precision (f32 stays IEEE, TF32 off: ``backend.ieee_fp32``), so an f32
  network loaded beside may differ from the heuristics' choice by rounding only.

A layout is only strides: every op computes the same values either way (the CPU twin test,
tests/plugins/torch_device/test_layout.py, runs the conversion on the CPU and compares). On the CPU,
and in f32 anywhere, nothing here applies: the CPU path is unchanged.
"""

from __future__ import annotations

from typing import Any

__all__ = ["benchmark", "input_channels_last", "wanted", "weights_channels_last"]


def wanted(torch: Any, device: Any, compute: Any) -> bool:
    """Whether a network on ``device`` computing in ``compute`` runs its convolutions
    channels-last."""
    return device.type == "cuda" and compute in (torch.float16, torch.bfloat16)


def weights_channels_last(torch: Any, graph: Any, slots: dict[str, int], template: list) -> int:
    """Hold the 4-D weights of the graph's Conv nodes channels-last in ``template`` (the
    program's initializer tensors by slot); how many were converted."""
    converted = 0
    for node in graph.nodes:
        if node.op_type != "Conv" or len(node.inputs) < 2:
            continue
        slot = slots.get(node.inputs[1])
        tensor = template[slot] if slot is not None else None
        if tensor is None or tensor.dim() != 4:
            continue
        if not tensor.is_contiguous(memory_format=torch.channels_last):
            template[slot] = tensor.contiguous(memory_format=torch.channels_last)
            converted += 1
    return converted


def input_channels_last(torch: Any, x: Any) -> Any:
    """A 4-D convolution input as channels-last (a no-op when it is already)."""
    if x.dim() == 4 and not x.is_contiguous(memory_format=torch.channels_last):
        return x.contiguous(memory_format=torch.channels_last)
    return x


def benchmark(torch: Any, graph: Any) -> None:
    """cuDNN's benchmark on, for a network with convolutions (the module's docstring)."""
    if any(node.op_type in ("Conv", "ConvTranspose") for node in graph.nodes):
        torch.backends.cudnn.benchmark = True
