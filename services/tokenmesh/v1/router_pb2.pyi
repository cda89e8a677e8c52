import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_NOT_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_UNREACHABLE: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_NOT_SERVING: WorkerState
WORKER_STATE_UNREACHABLE: WorkerState

class GetRoutingTableRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoutingEntry(_message.Message):
    __slots__ = ("address", "weight", "state", "in_flight", "served_total", "reason", "triton_url", "concurrency_limit", "found_by", "link")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRITON_URL_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    FOUND_BY_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    address: str
    weight: float
    state: WorkerState
    in_flight: int
    served_total: int
    reason: str
    triton_url: str
    concurrency_limit: int
    found_by: str
    link: str
    def __init__(self, address: _Optional[str] = ..., weight: _Optional[float] = ..., state: _Optional[_Union[WorkerState, str]] = ..., in_flight: _Optional[int] = ..., served_total: _Optional[int] = ..., reason: _Optional[str] = ..., triton_url: _Optional[str] = ..., concurrency_limit: _Optional[int] = ..., found_by: _Optional[str] = ..., link: _Optional[str] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("workers", "version", "received_at", "propagation_ms", "queued", "process_index", "processes")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    PROPAGATION_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[RoutingEntry]
    version: int
    received_at: _timestamp_pb2.Timestamp
    propagation_ms: float
    queued: int
    process_index: int
    processes: int
    def __init__(self, workers: _Optional[_Iterable[_Union[RoutingEntry, _Mapping]]] = ..., version: _Optional[int] = ..., received_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., propagation_ms: _Optional[float] = ..., queued: _Optional[int] = ..., process_index: _Optional[int] = ..., processes: _Optional[int] = ...) -> None: ...

class WorkerWeight(_message.Message):
    __slots__ = ("address", "weight", "state", "reason", "triton_url", "concurrency_limit")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRITON_URL_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    address: str
    weight: float
    state: WorkerState
    reason: str
    triton_url: str
    concurrency_limit: int
    def __init__(self, address: _Optional[str] = ..., weight: _Optional[float] = ..., state: _Optional[_Union[WorkerState, str]] = ..., reason: _Optional[str] = ..., triton_url: _Optional[str] = ..., concurrency_limit: _Optional[int] = ...) -> None: ...

class WeightTable(_message.Message):
    __slots__ = ("version", "workers", "decided_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerWeight]
    decided_at: _timestamp_pb2.Timestamp
    def __init__(self, version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerWeight, _Mapping]]] = ..., decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WeightAck(_message.Message):
    __slots__ = ("version", "applied")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    def __init__(self, version: _Optional[int] = ..., applied: _Optional[bool] = ...) -> None: ...
