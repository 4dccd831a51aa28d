"""What every tracing test imports: tritonclient's gRPC client and the OTLP receiver
(``otlp.py``, whose import needs the OpenTelemetry packages). Importing this module skips the
test module that imports it, with the install line, when either is missing."""

import pytest

grpcclient = pytest.importorskip(
    "tritonclient.grpc", reason="pip install 'tritonclient[grpc,http]'"
)
otlp = pytest.importorskip(
    "otlp",
    reason="the OpenTelemetry packages: pip install 'plugserve[trace]'",
    exc_type=ImportError,
)
