"""The decoders of graph models on the Plugin API: ONNX graphs (onnxruntime-genai's and
optimum's) on any ONNX device, and OpenVINO's paged IR; the torch decoder lives with its
device (``plugins/torch/decoder.py``)."""
