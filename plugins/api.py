"""The Plugin API: what every device plugin implements and what users of plugserve call.

It follows the OpenVINO plugin guide (``shared/seeds``): a :class:`Plugin` is a device that
loads or imports networks, a :class:`CompiledNetwork` is a network compiled for that device,
and an :class:`InferRequest` runs it. Errors are typed so that the server can map every one of
them to a gRPC status in one place and users can catch what they can act on.

This module is the public face: users, the server and the plugins import from here. Each job
lives in a module of its own, each importing only those before it:

- ``errors``: the typed errors (and ``listing``, for their messages)
- ``configuration``: config keys, their parsers, a device's parsed :class:`Configuration`
- ``inputs``: :class:`TensorSpec` and the checks of inputs against it
- ``run_context``: :class:`RunContext`, the request a device runs as it is told it (handed to
  ``InferRequest.infer_checked`` and its siblings; the cancellation token rides in it)
- ``base``: the :class:`Plugin`, :class:`CompiledNetwork` and :class:`InferRequest` bases and
  the :class:`Devices` protocol (above ``cancel``, ``run_context``, ``streams`` and ``blob``)
- ``responses``: :class:`Response` and :class:`ResponseSender`, for decoupled networks
- ``virtual``: what the virtual devices share (``refusal_reasons``, ``device_refusals``)

What a generative network asks of a device has modules of its own, above ``base``, imported
by the generation engine and the devices that run a folder's weights (``Plugin.load_decoder``):

- ``decoding``: the :class:`~plugserve.plugins.decoding.Decoder` the engine calls (the cache,
  the forwards, the sampler, a pipelined step's ``launch`` and ``fetch``) and its
  ``CacheLayout``
- ``sampling``: the sampling rules every decoder's sampler keeps (the host's, on numpy)
"""

from __future__ import annotations

from plugserve.plugins.base import (
    STATE_PAIRS,
    Callback,
    CallConfig,
    CompiledNetwork,
    Devices,
    InferRequest,
    KnownDevice,
    Model,
    PerfCount,
    Plugin,
    VariableState,
    check_state_pairs,
    initial_value,
    joined_precision,
    parse_state_pairs,
)
from plugserve.plugins.configuration import (
    BOOL,
    ConfigKey,
    Configuration,
    available_cores,
    cpu_name,
)
from plugserve.plugins.errors import (
    BackendUnavailable,
    Cancelled,
    DeadlineExceeded,
    DeviceOutOfMemory,
    FailedPrecondition,
    InferenceError,
    InvalidArgument,
    InvalidInput,
    InvalidModel,
    NotFound,
    PermissionDenied,
    PlugserveError,
    QueueFull,
    ResourceExhausted,
    Unsupported,
    listing,
)
from plugserve.plugins.inputs import (
    TensorSpec,
    check_element_type,
    check_input_shape,
    check_inputs,
    names_of,
    refuse_non_tensors,
)
from plugserve.plugins.responses import Response, ResponseSender
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.virtual import device_refusals, refusal_reasons

__all__ = [
    "BOOL",
    "STATE_PAIRS",
    "BackendUnavailable",
    "CallConfig",
    "Callback",
    "Cancelled",
    "CompiledNetwork",
    "ConfigKey",
    "Configuration",
    "DeadlineExceeded",
    "DeviceOutOfMemory",
    "Devices",
    "FailedPrecondition",
    "InferRequest",
    "InferenceError",
    "InvalidArgument",
    "InvalidInput",
    "InvalidModel",
    "KnownDevice",
    "Model",
    "NotFound",
    "PerfCount",
    "PermissionDenied",
    "Plugin",
    "PlugserveError",
    "QueueFull",
    "ResourceExhausted",
    "Response",
    "ResponseSender",
    "RunContext",
    "TensorSpec",
    "Unsupported",
    "VariableState",
    "available_cores",
    "check_element_type",
    "check_input_shape",
    "check_inputs",
    "check_state_pairs",
    "cpu_name",
    "device_refusals",
    "initial_value",
    "joined_precision",
    "listing",
    "names_of",
    "parse_state_pairs",
    "refusal_reasons",
    "refuse_non_tensors",
]
