"""The converters, one small function per ONNX op, registered on import (see
:mod:`.registry`). All are written here against torch's own operators; onnx2torch was not
used: it converts none of If, LSTM/GRU, GlobalMaxPool, Greater/LessOrEqual, DequantizeLinear
or Constant-node weights (issue 49's measurements), and a converter of our own refuses exactly
what it does not compute, which QueryNetwork needs."""

from plugserve.plugins.torch.ops import (  # noqa: F401  (each registers its converters)
    attention,
    elementwise,
    nn,
    quantize,
    reduce,
    rnn,
    signal,
    state,
    tensor,
    vision,
)
