"""One rule for how an attempt on a worker ended: the worker failed (fail over) or the caller erred (end with it)."""

from __future__ import annotations

import grpc
import pytest

from tokenmesh.errors import InvalidArgument, MeshError, NotFound, ResourceExhausted, Unavailable, rpc_error
from tokenmesh.router._outcome import AT_LIMIT, WorkerFailed, outcome
from tokenmesh.router._resume import _not_moved
from tokenmesh.v1 import worker_pb2


def status(code: grpc.StatusCode, details: str = "details") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_stream_closed_without_an_end_is_the_workers_failure() -> None:
    ended = outcome(None, "w:1", received=True)
    assert isinstance(ended, WorkerFailed) and ended.kind == "closed"
    assert str(ended) == "worker closed the stream without an end"


@pytest.mark.parametrize(
    ("error_class", "kind"),
    [
        (worker_pb2.ERROR_CLASS_BACKEND, "backend"),
        (worker_pb2.ERROR_CLASS_OUT_OF_MEMORY, "out_of_memory"),
        (worker_pb2.ERROR_CLASS_UNAVAILABLE, "unavailable"),
        (worker_pb2.ERROR_CLASS_TIMEOUT, "timeout"),
        (worker_pb2.ERROR_CLASS_DEVICE_LOST, "device_lost"),
    ],
)
def test_a_worker_error_event_of_the_workers_classes_fails_over_labelled_by_class(error_class: int, kind: str) -> None:
    ended = outcome(worker_pb2.GenerationError(error_class=error_class, message="it broke"), "w:1", received=True)
    assert isinstance(ended, WorkerFailed) and ended.kind == kind and str(ended) == "it broke"


@pytest.mark.parametrize(
    ("error_class", "error_type"),
    [
        (worker_pb2.ERROR_CLASS_INVALID_REQUEST, InvalidArgument),
        (worker_pb2.ERROR_CLASS_MODEL_NOT_FOUND, NotFound),
    ],
)
def test_a_worker_error_event_about_the_request_ends_the_stream_with_the_callers_error(
    error_class: int, error_type: type[MeshError]
) -> None:
    ended = outcome(worker_pb2.GenerationError(error_class=error_class, message="bad stop"), "w:1", received=False)
    assert type(ended) is error_type
    assert ended.message == "bad stop" and ended.metadata == {"worker": "w:1"}


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ],
)
@pytest.mark.parametrize("received", [False, True])
def test_a_status_about_the_request_is_the_callers_before_and_after_output(
    code: grpc.StatusCode, received: bool
) -> None:
    ended = outcome(status(code, "no such model"), "w:1", received=received)
    assert isinstance(ended, MeshError) and ended.grpc_code == code and ended.message == "no such model"


def test_worker_at_limit_before_output_is_busy_not_failed_and_resource_exhausted_after_is_a_slow_caller() -> None:
    at_limit = rpc_error(ResourceExhausted("worker is at its limit of 8", reason="WORKER_AT_LIMIT").status())
    before = outcome(at_limit, "w:1", received=False)
    assert isinstance(before, WorkerFailed) and before.kind == AT_LIMIT
    after = outcome(status(grpc.StatusCode.RESOURCE_EXHAUSTED, "replay buffer full"), "w:1", received=True)
    assert isinstance(after, MeshError) and after.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_resource_exhausted_before_output_without_the_workers_reason_is_a_failure() -> None:
    # gRPC's own RESOURCE_EXHAUSTED (a message over the size limit, a stream limit) is no worker at its limit.
    before = outcome(
        status(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max"), "w:1", received=False
    )
    assert isinstance(before, WorkerFailed) and before.kind == "resource_exhausted"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED])
def test_any_other_status_is_the_workers_failure_named_by_its_code(code: grpc.StatusCode) -> None:
    ended = outcome(status(code, "connection reset"), "w:1", received=True)
    assert isinstance(ended, WorkerFailed) and ended.kind == code.name.lower()
    assert str(ended) == f"{code.name}: connection reset"


def test_resume_reports_a_worker_failure_as_unavailable_and_passes_the_callers_error_on() -> None:
    failure = WorkerFailed("UNAVAILABLE: gone", "unavailable")
    reported = _not_moved(failure, "w:1", "rid")
    assert isinstance(reported, Unavailable) and reported.__cause__ is failure
    assert reported.message == (
        "worker w:1 holding rid failed during Resume (UNAVAILABLE: gone); "
        "a resumed stream is not moved to another worker"
    )
    caller = InvalidArgument("bad")
    assert _not_moved(caller, "w:1", "rid") is caller
