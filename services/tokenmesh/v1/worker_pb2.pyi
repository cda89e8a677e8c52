from google.rpc import status_pb2 as _status_pb2
from tokenmesh.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CLASS_UNSPECIFIED: _ClassVar[ErrorClass]
    ERROR_CLASS_INVALID_REQUEST: _ClassVar[ErrorClass]
    ERROR_CLASS_UNAVAILABLE: _ClassVar[ErrorClass]
    ERROR_CLASS_TIMEOUT: _ClassVar[ErrorClass]
    ERROR_CLASS_OUT_OF_MEMORY: _ClassVar[ErrorClass]
    ERROR_CLASS_BACKEND: _ClassVar[ErrorClass]
    ERROR_CLASS_MODEL_NOT_FOUND: _ClassVar[ErrorClass]
    ERROR_CLASS_DEVICE_LOST: _ClassVar[ErrorClass]
ERROR_CLASS_UNSPECIFIED: ErrorClass
ERROR_CLASS_INVALID_REQUEST: ErrorClass
ERROR_CLASS_UNAVAILABLE: ErrorClass
ERROR_CLASS_TIMEOUT: ErrorClass
ERROR_CLASS_OUT_OF_MEMORY: ErrorClass
ERROR_CLASS_BACKEND: ErrorClass
ERROR_CLASS_MODEL_NOT_FOUND: ErrorClass
ERROR_CLASS_DEVICE_LOST: ErrorClass

class WorkerCommand(_message.Message):
    __slots__ = ("start", "cancel", "first_seq", "tokens_before", "resumable", "timeout_s", "trace_context", "stream_interval_ms")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    start: _inference_pb2.GenerateRequest
    cancel: CancelGeneration
    first_seq: int
    tokens_before: int
    resumable: bool
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    stream_interval_ms: int
    def __init__(self, start: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelGeneration, _Mapping]] = ..., first_seq: _Optional[int] = ..., tokens_before: _Optional[int] = ..., resumable: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., stream_interval_ms: _Optional[int] = ...) -> None: ...

class CancelGeneration(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("chunk", "end", "error", "seq")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    end: GenerationEnd
    error: GenerationError
    seq: int
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., end: _Optional[_Union[GenerationEnd, _Mapping]] = ..., error: _Optional[_Union[GenerationError, _Mapping]] = ..., seq: _Optional[int] = ...) -> None: ...

class LinkCommands(_message.Message):
    __slots__ = ("commands", "credit_stream", "credit_bytes")
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_STREAM_FIELD_NUMBER: _ClassVar[int]
    CREDIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[LinkCommand]
    credit_stream: _containers.RepeatedScalarFieldContainer[int]
    credit_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, commands: _Optional[_Iterable[_Union[LinkCommand, _Mapping]]] = ..., credit_stream: _Optional[_Iterable[int]] = ..., credit_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkCommand(_message.Message):
    __slots__ = ("stream", "start", "cancel", "detach", "window_bytes")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    stream: int
    start: WorkerCommand
    cancel: CancelGeneration
    detach: LinkDetach
    window_bytes: int
    def __init__(self, stream: _Optional[int] = ..., start: _Optional[_Union[WorkerCommand, _Mapping]] = ..., cancel: _Optional[_Union[CancelGeneration, _Mapping]] = ..., detach: _Optional[_Union[LinkDetach, _Mapping]] = ..., window_bytes: _Optional[int] = ...) -> None: ...

class LinkDetach(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkEvents(_message.Message):
    __slots__ = ("settings", "chunk_stream", "chunk_seq", "chunk_text", "chunk_tokens", "engine_ttft_ms", "ends", "chunk_logprobs")
    class EngineTtftMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class ChunkLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ChunkLogprobs
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ChunkLogprobs, _Mapping]] = ...) -> None: ...
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STREAM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SEQ_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TEXT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    settings: LinkSettings
    chunk_stream: _containers.RepeatedScalarFieldContainer[int]
    chunk_seq: _containers.RepeatedScalarFieldContainer[int]
    chunk_text: _containers.RepeatedScalarFieldContainer[str]
    chunk_tokens: _containers.RepeatedScalarFieldContainer[int]
    engine_ttft_ms: _containers.ScalarMap[int, float]
    ends: _containers.RepeatedCompositeFieldContainer[LinkEnd]
    chunk_logprobs: _containers.MessageMap[int, ChunkLogprobs]
    def __init__(self, settings: _Optional[_Union[LinkSettings, _Mapping]] = ..., chunk_stream: _Optional[_Iterable[int]] = ..., chunk_seq: _Optional[_Iterable[int]] = ..., chunk_text: _Optional[_Iterable[str]] = ..., chunk_tokens: _Optional[_Iterable[int]] = ..., engine_ttft_ms: _Optional[_Mapping[int, float]] = ..., ends: _Optional[_Iterable[_Union[LinkEnd, _Mapping]]] = ..., chunk_logprobs: _Optional[_Mapping[int, ChunkLogprobs]] = ...) -> None: ...

class ChunkLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class LinkEnd(_message.Message):
    __slots__ = ("stream", "event", "status")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stream: int
    event: WorkerEvent
    status: _status_pb2.Status
    def __init__(self, stream: _Optional[int] = ..., event: _Optional[_Union[WorkerEvent, _Mapping]] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class LinkSettings(_message.Message):
    __slots__ = ("protocol", "default_window_bytes", "max_batch_bytes", "max_streams")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    default_window_bytes: int
    max_batch_bytes: int
    max_streams: int
    def __init__(self, protocol: _Optional[int] = ..., default_window_bytes: _Optional[int] = ..., max_batch_bytes: _Optional[int] = ..., max_streams: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "after_seq")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    after_seq: int
    def __init__(self, request_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("text", "token_count", "engine_ttft_ms", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_count: int
    engine_ttft_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_count: _Optional[int] = ..., engine_ttft_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerationEnd(_message.Message):
    __slots__ = ("finish_reason", "usage", "token_count")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _inference_pb2.FinishReason
    usage: _inference_pb2.Usage
    token_count: int
    def __init__(self, finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_inference_pb2.Usage, _Mapping]] = ..., token_count: _Optional[int] = ...) -> None: ...

class GenerationError(_message.Message):
    __slots__ = ("error_class", "message")
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error_class: ErrorClass
    message: str
    def __init__(self, error_class: _Optional[_Union[ErrorClass, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StatsPing(_message.Message):
    __slots__ = ("ping_id",)
    PING_ID_FIELD_NUMBER: _ClassVar[int]
    ping_id: int
    def __init__(self, ping_id: _Optional[int] = ...) -> None: ...

class DeviceStats(_message.Message):
    __slots__ = ("index", "name", "memory_used_bytes", "memory_total_bytes", "utilization_percent")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., utilization_percent: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("ping_id", "in_flight", "concurrency_limit", "serving", "served_total", "tokens_total", "devices", "triton_url", "oom_total", "backend_restarts", "state_reason", "ttft_ms", "itl_ms", "tokens_per_s", "cpus", "triton_pending", "triton_queue_ms", "ttft_baseline_ms")
    PING_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TRITON_URL_FIELD_NUMBER: _ClassVar[int]
    OOM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    TRITON_PENDING_FIELD_NUMBER: _ClassVar[int]
    TRITON_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_BASELINE_MS_FIELD_NUMBER: _ClassVar[int]
    ping_id: int
    in_flight: int
    concurrency_limit: int
    serving: bool
    served_total: int
    tokens_total: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStats]
    triton_url: str
    oom_total: int
    backend_restarts: int
    state_reason: str
    ttft_ms: float
    itl_ms: float
    tokens_per_s: float
    cpus: _containers.RepeatedScalarFieldContainer[int]
    triton_pending: int
    triton_queue_ms: float
    ttft_baseline_ms: float
    def __init__(self, ping_id: _Optional[int] = ..., in_flight: _Optional[int] = ..., concurrency_limit: _Optional[int] = ..., serving: _Optional[bool] = ..., served_total: _Optional[int] = ..., tokens_total: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceStats, _Mapping]]] = ..., triton_url: _Optional[str] = ..., oom_total: _Optional[int] = ..., backend_restarts: _Optional[int] = ..., state_reason: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., itl_ms: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., cpus: _Optional[_Iterable[int]] = ..., triton_pending: _Optional[int] = ..., triton_queue_ms: _Optional[float] = ..., ttft_baseline_ms: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("models", "triton_url", "cuda_visible_devices", "triton_pid", "concurrency_limit")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TRITON_URL_FIELD_NUMBER: _ClassVar[int]
    CUDA_VISIBLE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    TRITON_PID_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ModelInfo]
    triton_url: str
    cuda_visible_devices: str
    triton_pid: int
    concurrency_limit: int
    def __init__(self, models: _Optional[_Iterable[_Union[_inference_pb2.ModelInfo, _Mapping]]] = ..., triton_url: _Optional[str] = ..., cuda_visible_devices: _Optional[str] = ..., triton_pid: _Optional[int] = ..., concurrency_limit: _Optional[int] = ...) -> None: ...
