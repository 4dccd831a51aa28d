"""The TORCH and GPU devices: ONNX converted node by node to torch operations, run on the CPU
(TORCH) or on a CUDA GPU (GPU, GPU.0, GPU.1 ...). torch is imported at a device's first load,
not at start; plugserve without torch lists both devices unavailable with the reason and runs
the others."""

from plugserve.plugins.torch.plugin import GpuPlugin, TorchPlugin

__all__ = ["GpuPlugin", "TorchPlugin"]
