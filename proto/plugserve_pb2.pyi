from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "dim_names", "has_shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIM_NAMES_FIELD_NUMBER: _ClassVar[int]
    HAS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dim_names: _containers.RepeatedScalarFieldContainer[str]
    has_shape: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dim_names: _Optional[_Iterable[str]] = ..., has_shape: bool = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("name", "available", "reason", "full_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FULL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: bool
    reason: str
    full_name: str
    def __init__(self, name: _Optional[str] = ..., available: bool = ..., reason: _Optional[str] = ..., full_name: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ...) -> None: ...

class GetMetricRequest(_message.Message):
    __slots__ = ("device", "name", "network", "version")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    device: str
    name: str
    network: str
    version: int
    def __init__(self, device: _Optional[str] = ..., name: _Optional[str] = ..., network: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetMetricResponse(_message.Message):
    __slots__ = ("value_json",)
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    value_json: str
    def __init__(self, value_json: _Optional[str] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ("device", "key")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    device: str
    key: str
    def __init__(self, device: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("config",)
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: _containers.ScalarMap[str, str]
    def __init__(self, config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SetConfigRequest(_message.Message):
    __slots__ = ("device", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    device: str
    config: _containers.ScalarMap[str, str]
    def __init__(self, device: _Optional[str] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SetConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelSource(_message.Message):
    __slots__ = ("onnx", "repository_path")
    ONNX_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_PATH_FIELD_NUMBER: _ClassVar[int]
    onnx: bytes
    repository_path: str
    def __init__(self, onnx: _Optional[bytes] = ..., repository_path: _Optional[str] = ...) -> None: ...

class QueryNetworkRequest(_message.Message):
    __slots__ = ("model", "device", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    model: ModelSource
    device: str
    config: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[_Union[ModelSource, _Mapping]] = ..., device: _Optional[str] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class QueryNetworkResponse(_message.Message):
    __slots__ = ("supported", "unsupported", "subgraphs", "refusals")
    class SupportedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class UnsupportedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    SUBGRAPHS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    supported: _containers.ScalarMap[str, str]
    unsupported: _containers.ScalarMap[str, str]
    subgraphs: _containers.RepeatedCompositeFieldContainer[Subgraph]
    refusals: _containers.RepeatedCompositeFieldContainer[Refusal]
    def __init__(self, supported: _Optional[_Mapping[str, str]] = ..., unsupported: _Optional[_Mapping[str, str]] = ..., subgraphs: _Optional[_Iterable[_Union[Subgraph, _Mapping]]] = ..., refusals: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("node", "device", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    device: str
    reason: str
    def __init__(self, node: _Optional[str] = ..., device: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Subgraph(_message.Message):
    __slots__ = ("device", "nodes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    device: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class NetworkInfo(_message.Message):
    __slots__ = ("name", "version", "device", "inputs", "outputs", "config", "persisted", "max_batch_size", "precision")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    device: str
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    config: _containers.ScalarMap[str, str]
    persisted: bool
    max_batch_size: int
    precision: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., device: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., config: _Optional[_Mapping[str, str]] = ..., persisted: bool = ..., max_batch_size: _Optional[int] = ..., precision: _Optional[str] = ...) -> None: ...

class LoadNetworkRequest(_message.Message):
    __slots__ = ("name", "model", "device", "config", "persist", "version")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: ModelSource
    device: str
    config: _containers.ScalarMap[str, str]
    persist: bool
    version: int
    def __init__(self, name: _Optional[str] = ..., model: _Optional[_Union[ModelSource, _Mapping]] = ..., device: _Optional[str] = ..., config: _Optional[_Mapping[str, str]] = ..., persist: bool = ..., version: _Optional[int] = ...) -> None: ...

class LoadNetworkResponse(_message.Message):
    __slots__ = ("network", "loaded_from_cache")
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    LOADED_FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    network: NetworkInfo
    loaded_from_cache: bool
    def __init__(self, network: _Optional[_Union[NetworkInfo, _Mapping]] = ..., loaded_from_cache: bool = ...) -> None: ...

class UnloadNetworkRequest(_message.Message):
    __slots__ = ("name", "version", "remove_from_repository")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FROM_REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    remove_from_repository: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., remove_from_repository: bool = ...) -> None: ...

class UnloadNetworkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNetworksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNetworksResponse(_message.Message):
    __slots__ = ("networks",)
    NETWORKS_FIELD_NUMBER: _ClassVar[int]
    networks: _containers.RepeatedCompositeFieldContainer[NetworkInfo]
    def __init__(self, networks: _Optional[_Iterable[_Union[NetworkInfo, _Mapping]]] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("number", "name", "start", "end")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    number: int
    name: str
    start: bool
    end: bool
    def __init__(self, number: _Optional[int] = ..., name: _Optional[str] = ..., start: bool = ..., end: bool = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("network", "version", "id", "inputs", "outputs", "sequence")
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    network: str
    version: int
    id: str
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    sequence: Sequence
    def __init__(self, network: _Optional[str] = ..., version: _Optional[int] = ..., id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., sequence: _Optional[_Union[Sequence, _Mapping]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("id", "network", "version", "outputs")
    ID_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    network: str
    version: int
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, id: _Optional[str] = ..., network: _Optional[str] = ..., version: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class InferStreamResponse(_message.Message):
    __slots__ = ("id", "response", "error", "more")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    id: str
    response: InferResponse
    error: Status
    more: bool
    def __init__(self, id: _Optional[str] = ..., response: _Optional[_Union[InferResponse, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., more: bool = ...) -> None: ...

class ExportNetworkRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ExportNetworkResponse(_message.Message):
    __slots__ = ("blob",)
    BLOB_FIELD_NUMBER: _ClassVar[int]
    blob: bytes
    def __init__(self, blob: _Optional[bytes] = ...) -> None: ...

class ImportNetworkRequest(_message.Message):
    __slots__ = ("name", "blob", "device", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    blob: bytes
    device: str
    config: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., blob: _Optional[bytes] = ..., device: _Optional[str] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetPerformanceCountsRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PerfCount(_message.Message):
    __slots__ = ("node_name", "op_type", "status", "exec_type", "real_time_s", "device", "original_names", "count")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    OP_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXEC_TYPE_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_NAMES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    op_type: str
    status: str
    exec_type: str
    real_time_s: float
    device: str
    original_names: _containers.RepeatedScalarFieldContainer[str]
    count: int
    def __init__(self, node_name: _Optional[str] = ..., op_type: _Optional[str] = ..., status: _Optional[str] = ..., exec_type: _Optional[str] = ..., real_time_s: _Optional[float] = ..., device: _Optional[str] = ..., original_names: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ...) -> None: ...

class GetPerformanceCountsResponse(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedCompositeFieldContainer[PerfCount]
    def __init__(self, counts: _Optional[_Iterable[_Union[PerfCount, _Mapping]]] = ...) -> None: ...
