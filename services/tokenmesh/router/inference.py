"""``tokenmesh.v1.Inference`` on the router: Generate with failover, Resume, Cancel, ListModels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tokenmesh.errors import (
    CALLER_ERROR_CLASSES,
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
    from_generation_error,
)
from tokenmesh.router.admission import FAILOVER, Admission, level
from tokenmesh.router.config import RouterConfig
from tokenmesh.router.pool import WorkerEntry, WorkerPool, prefix_key
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant"})


class _Live:
    """A generation in progress on this router."""

    def __init__(self) -> None:
        self.call: grpc.aio.StreamStreamCall[Any, Any] | None = None
        self.cancel_requested = False


class _WorkerFailed(Exception):
    """The worker could not run the generation; another worker may."""


@dataclass
class _Progress:
    """What of a generation has reached the caller (survives failover)."""

    seq: int = 0
    """Last seq sent."""
    text: list[str] = field(default_factory=list)
    """Text pieces sent, in order."""
    tokens: int = 0
    """Tokens sent."""
    migrations: int = 0
    """Times the generation moved to another worker after output began."""
    started: float = field(default_factory=time.monotonic)
    """When the router received the request."""
    timing: inference_pb2.Timing = field(default_factory=inference_pb2.Timing)
    """Where the time to the first token went (sent on the final chunk)."""


def _continuation(base: inference_pb2.GenerateRequest, progress: _Progress) -> inference_pb2.GenerateRequest | None:
    """The request that continues base after what progress delivered (None: nothing left to generate).

    A raw prompt is extended by the delivered text; a chat gets it as (the end
    of) a trailing assistant message, which the model continues. The seed and
    every other setting stay; max_tokens shrinks by what was delivered.
    """
    if progress.seq == 0:
        return base
    remaining = base.max_tokens - progress.tokens
    if remaining <= 0:
        return None
    forward = inference_pb2.GenerateRequest()
    forward.CopyFrom(base)
    forward.max_tokens = remaining
    delivered = "".join(progress.text)
    if base.messages:
        if base.messages[-1].role == "assistant":
            forward.messages[-1].content += delivered
        else:
            forward.messages.add(role="assistant", content=delivered)
    else:
        forward.prompt = base.prompt + delivered
    return forward


def _chunk(event: worker_pb2.WorkerEvent, request_id: str, model: str) -> inference_pb2.GenerateChunk:
    """The caller's chunk for a worker's chunk or end event (seq from the worker)."""
    if event.WhichOneof("event") == "chunk":
        return inference_pb2.GenerateChunk(
            request_id=request_id, seq=event.seq, text=event.chunk.text, token_count=event.chunk.token_count,
            model=model,
        )
    end = event.end
    return inference_pb2.GenerateChunk(
        request_id=request_id, seq=event.seq, token_count=end.token_count, finish_reason=end.finish_reason,
        usage=end.usage, model=model,
    )


class _StallWatchdog:
    """Cancels a worker call that sends nothing for too long (then ``stalled`` says why).

    One timer per stream that re-arms itself, instead of a timeout around
    every read: a read per token is the router's hot path. Only time spent
    waiting for a read counts: while the router waits for a slow caller, the
    worker is not stalled.
    """

    def __init__(self, call: grpc.aio.StreamStreamCall[Any, Any], first_s: float, between_s: float) -> None:
        self._call = call
        self._loop = asyncio.get_running_loop()
        self._limit = first_s
        self._between = between_s
        self._since = self._loop.time()
        self._reading = True
        self.stalled = ""
        self._timer = self._loop.call_at(self._since + first_s, self._check)

    def reading(self) -> None:
        """A read begins: silence counts from now."""
        self._since = self._loop.time()
        self._reading = True

    def fed(self) -> None:
        """The read returned an event."""
        self._reading = False
        if self._limit != self._between:  # the first event: from the TTFT limit to the stall limit
            self._limit = self._between
            self._timer.cancel()
            self._timer = self._loop.call_at(self._loop.time() + self._between, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if not self._reading:  # the router is busy with the caller: look again later
            self._timer = self._loop.call_at(now + self._limit, self._check)
            return
        due = self._since + self._limit
        if now < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.stalled = f"stalled: no output for {self._limit:g} s"
        self._call.cancel()

    def stop(self) -> None:
        """No more checks."""
        self._timer.cancel()


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate, Resume, Cancel, ListModels."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        stubs: dict[str, worker_pb2_grpc.WorkerStub],
        admission: Admission,
    ) -> None:
        self._config = config
        self._pool = pool
        self._admission = admission
        self._stubs = stubs
        self.live: dict[str, _Live] = {}
        self.idle = asyncio.Event()
        """Set while no generation or resume is being streamed by this router (the drain waits for it)."""
        self.idle.set()
        self.draining = False
        """Set when the router drains: new generations and resumes get UNAVAILABLE."""
        self._background: set[asyncio.Task[None]] = set()
        self._spares: dict[str, Any] = {}
        """Per worker, a Generate call opened ahead of need (see _worker_call)."""

    def _worker_call(self, address: str) -> Any:  # a Worker/Generate StreamStreamCall (the stub is untyped)
        """A Generate call to the worker: the spare opened ahead if it is still open, else a new one.

        Opening a bidi call (HTTP/2 stream, initial metadata, the worker's
        handler) took about 0.5 ms of the first token's path; a spare has done
        that while the previous generation ran. It carries no deadline: the
        caller's goes in the start command (timeout_s).
        """
        spare = self._spares.pop(address, None)
        if spare is not None and not spare.done():
            return spare
        return self._stubs[address].Generate()

    def _open_spare(self, address: str) -> None:
        if address not in self._spares:  # stubs are never removed: the address has one
            self._spares[address] = self._stubs[address].Generate()

    def close_spares(self) -> None:
        """Cancel the calls opened ahead (the router is stopping)."""
        for call in self._spares.values():
            call.cancel()
        self._spares.clear()

    def _validate(self, req: inference_pb2.GenerateRequest) -> inference_pb2.ModelInfo:
        if bool(req.prompt) == bool(req.messages):
            if req.prompt:
                raise InvalidArgument("set either prompt or messages, not both")
            raise InvalidArgument("empty request: set prompt, or messages with at least one {role, content}")
        size = len(req.prompt.encode()) + sum(len(m.content.encode()) for m in req.messages)
        if size > self._config.max_prompt_bytes:
            raise InvalidArgument(
                f"prompt is {size} bytes; the limit is {self._config.max_prompt_bytes} bytes: shorten it"
            )
        for i, message in enumerate(req.messages):
            if message.role not in ROLES:
                raise InvalidArgument(f"messages[{i}].role is {message.role!r}; use one of {', '.join(sorted(ROLES))}")
        if req.HasField("temperature") and not (req.temperature >= 0 and math.isfinite(req.temperature)):
            raise InvalidArgument(f"temperature must be >= 0, got {req.temperature}")
        if req.HasField("top_p") and not (0 < req.top_p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {req.top_p}")
        if req.priority not in inference_pb2.Priority.values():
            raise InvalidArgument(f"unknown priority {req.priority}; use PRIORITY_LOW, _NORMAL or _HIGH")
        model = self._pool.resolve_model(req.model)
        if req.HasField("max_tokens") and not (1 <= req.max_tokens <= model.max_context):
            raise InvalidArgument(
                f"max_tokens must be 1..{model.max_context} (the context size of {model.name!r}), got {req.max_tokens}"
            )
        return model

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Admit, pick a worker, relay its chunks with seq 1..N; fail over when a worker fails."""
        self._refuse_if_draining()
        model = self._validate(request)
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.live:
            raise AlreadyExists(f"request_id {request_id!r} is live already; use a new id, or Resume it")
        base = inference_pb2.GenerateRequest()
        base.CopyFrom(request)
        base.request_id = request_id
        base.model = model.name
        if not request.HasField("max_tokens"):
            base.max_tokens = min(self._config.default_max_tokens, model.max_context)
        live = self._begin(request_id)
        progress = _Progress()
        attempts = 0
        tenant = request.labels.get("tenant", "")
        key = prefix_key(request)
        try:
            while True:
                forward = _continuation(base, progress)
                if forward is None:
                    # Every requested token reached the caller; only the end was lost.
                    yield inference_pb2.GenerateChunk(
                        request_id=request_id, seq=progress.seq + 1, model=model.name,
                        finish_reason=inference_pb2.FINISH_REASON_LENGTH,
                        usage=inference_pb2.Usage(completion_tokens=progress.tokens),
                        migrations=progress.migrations, timing=progress.timing,
                    )
                    return
                # Workers that just failed are avoided (suspended) for a while. The
                # first attempt fails fast when no worker is live at all and
                # queues when all are busy; a failover waits, ahead of the queue.
                waited = time.monotonic()
                entry = await self._acquire(model.name, request, tenant, key, context, failover=attempts > 0)
                if attempts == 0:
                    progress.timing.queue_ms = (time.monotonic() - waited) * 1000
                attempts += 1
                try:
                    relay = self._relay(entry, forward, live, context, progress, resumable=bool(request.request_id))
                    async with contextlib.aclosing(relay):
                        async for chunk in relay:
                            yield chunk
                    return
                except _WorkerFailed as failure:
                    self._pool.suspend(entry, self._config.stall_timeout_s, str(failure))
                    if attempts > self._config.max_migrations:
                        raise Unavailable(
                            f"generation {request_id} failed on {attempts} workers; last: {failure}"
                        ) from failure
                    if progress.seq == 0:
                        # Nothing reached the caller yet: simply run it elsewhere.
                        log.warning("worker %s could not start %s: %s", entry.address, request_id, failure)
                        continue
                    progress.migrations += 1
                    log.warning(
                        "worker %s failed %s after seq %d (%s); continuing on another worker",
                        entry.address, request_id, progress.seq, failure,
                    )
                finally:
                    self._admission.release(entry, tenant)
        finally:
            self._end(request_id)

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable("this router is draining (shutting down); send the call to another router")

    def _begin(self, request_id: str) -> _Live:
        """Count a stream of request_id as live on this router."""
        live = self.live[request_id] = _Live()
        self.idle.clear()
        return live

    def _end(self, request_id: str) -> None:
        del self.live[request_id]
        if not self.live:
            self.idle.set()

    async def _acquire(
        self,
        model: str,
        request: inference_pb2.GenerateRequest,
        tenant: str,
        key: str,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        failover: bool,
    ) -> WorkerEntry:
        """A worker slot through admission, within the caller's deadline."""
        timeout = self._config.failover_wait_s if failover else self._config.queue_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        lvl = FAILOVER if failover else level(request.priority)
        if not failover:
            return await self._admission.acquire(model, lvl, tenant, timeout, key)
        # A failover also waits for a live worker to come back, not only for a free slot.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                self._pool.require_live(model)
            except Unavailable:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.1)
                continue
            return await self._admission.acquire(model, lvl, tenant, max(0.01, deadline - loop.time()), key)

    async def _relay(
        self,
        entry: WorkerEntry,
        forward: inference_pb2.GenerateRequest,
        live: _Live,
        context: grpc.aio.ServicerContext[Any, Any],
        progress: _Progress,
        *,
        resumable: bool,
    ) -> AsyncGenerator[inference_pb2.GenerateChunk, None]:
        """Run forward on entry's worker, its chunks numbered after progress.seq.

        Raises _WorkerFailed when the worker is at fault (it died, stalled, or
        reported a backend failure), so the caller's stream can continue
        elsewhere. When the caller goes away from a resumable generation (one
        with a caller-chosen request_id) the worker keeps it for Resume;
        otherwise the worker is told to stop.
        """
        call = self._worker_call(entry.address)
        live.call = call
        watchdog = _StallWatchdog(call, self._config.ttft_timeout_s, self._config.stall_timeout_s)
        received = False
        finished = False
        detach = False
        start = worker_pb2.WorkerCommand(
            start=forward, first_seq=progress.seq + 1, tokens_before=progress.tokens, resumable=resumable
        )
        remaining = context.time_remaining()
        if remaining is not None:
            start.timeout_s = remaining
        try:
            await call.write(start)
            self._open_spare(entry.address)  # for the next generation, while this one waits for its first token
            if live.cancel_requested:
                await call.write(worker_pb2.WorkerCommand(cancel=worker_pb2.CancelGeneration(reason="Cancel")))
            while True:
                watchdog.reading()
                event = await call.read()
                if event is grpc.aio.EOF:
                    raise _WorkerFailed("worker closed the stream without an end")
                watchdog.fed()
                received = True
                kind = event.WhichOneof("event")
                if kind == "error":
                    finished = True
                    if event.error.error_class in CALLER_ERROR_CLASSES:
                        raise from_generation_error(event.error)
                    raise _WorkerFailed(event.error.message)
                if event.seq != progress.seq + 1:
                    raise _WorkerFailed(f"worker sent seq {event.seq}, expected {progress.seq + 1}")
                if event.seq == 1:
                    if event.chunk.HasField("engine_ttft_ms"):
                        progress.timing.engine_ttft_ms = event.chunk.engine_ttft_ms
                    progress.timing.router_ttft_ms = (time.monotonic() - progress.started) * 1000
                progress.seq = event.seq
                if kind == "chunk":
                    progress.text.append(event.chunk.text)
                    progress.tokens += event.chunk.token_count
                    yield _chunk(event, forward.request_id, forward.model)
                    continue
                finished = True
                entry.served_total += 1
                final = _chunk(event, forward.request_id, forward.model)
                final.migrations = progress.migrations
                final.timing.CopyFrom(progress.timing)
                yield final
                return
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded("the deadline passed before the generation finished") from exc
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise InvalidArgument(exc.details() or str(code)) from exc
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and received:
                # Mid-stream: the caller reads too slowly (the worker's replay buffer overflowed).
                raise ResourceExhausted(exc.details() or "caller too slow") from exc
            raise _WorkerFailed(f"{code.name}: {exc.details()}") from exc
        except asyncio.CancelledError:
            if watchdog.stalled:
                raise _WorkerFailed(watchdog.stalled) from None
            detach = resumable  # the caller went away
            raise
        except GeneratorExit:
            detach = resumable  # the caller went away
            raise
        finally:
            watchdog.stop()
            live.call = None
            call.cancel()
            if not finished and not detach:
                self._cancel_on_worker(entry.address, forward.request_id)

    def _cancel_on_worker(self, address: str, request_id: str) -> None:
        """Tell a worker to stop a generation, in the background.

        The deadline is long on purpose: a stalled (e.g. SIGSTOPped) worker
        gets the cancel when it runs again, and does not go on generating a
        stream that moved elsewhere.
        """
        stub = self._stubs.get(address)
        if stub is None:
            return

        async def cancel() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=60)

        task = asyncio.create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def Resume(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Find the worker holding request_id; replay chunks after after_seq, then follow live."""
        request_id = request.request_id
        if not request_id:
            raise InvalidArgument("request_id is required")
        # A caller that cancels its stream and resumes at once can overtake the
        # teardown of its old stream here: give that a moment to finish.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        while request_id in self.live and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if request_id in self.live:
            raise AlreadyExists(f"generation {request_id!r} is being streamed by this router already")
        self._refuse_if_draining()
        self._begin(request_id)  # so Generate and Cancel see it is being streamed here
        try:
            for entry in sorted(self._pool.entries.values(), key=lambda e: not e.healthy):
                call = self._stubs[entry.address].Attach(
                    worker_pb2.AttachRequest(request_id=request_id, after_seq=request.after_seq),
                    timeout=context.time_remaining(),
                )
                try:
                    event = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                        raise OutOfRange(exc.details() or "after_seq out of range") from exc
                    continue  # not there (NOT_FOUND) or not reachable
                try:
                    while event is not grpc.aio.EOF:
                        if event.WhichOneof("event") == "error":
                            if event.error.error_class in CALLER_ERROR_CLASSES:
                                raise from_generation_error(event.error)
                            raise Unavailable(f"generation {request_id} failed on its worker: {event.error.message}")
                        yield _chunk(event, request_id, "")
                        if event.WhichOneof("event") == "end":
                            return
                        event = await call.read()
                except grpc.aio.AioRpcError as exc:
                    raise Unavailable(
                        f"worker {entry.address} holding {request_id} failed during Resume ({exc.code().name}); "
                        "a resumed stream is not moved to another worker"
                    ) from exc
                finally:
                    call.cancel()
                raise Unavailable(f"worker {entry.address} ended {request_id} without an end")
            raise NotFound(
                f"no worker holds generation {request_id!r}: unknown id, cancelled, or finished "
                "longer ago than the resume grace period"
            )
        finally:
            self._end(request_id)

    async def Cancel(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.CancelResponse:
        """Stop a generation: on this router's stream, or on whichever worker holds it."""
        live = self.live.get(request.request_id)
        if live is not None:
            live.cancel_requested = True
            if live.call is not None:
                with contextlib.suppress(grpc.aio.UsageError, grpc.aio.AioRpcError):
                    await live.call.write(worker_pb2.WorkerCommand(cancel=worker_pb2.CancelGeneration(reason="Cancel")))
                return inference_pb2.CancelResponse(cancelled=True)
        cancelled = False
        for address, stub in self._stubs.items():
            try:
                await stub.Cancel(inference_pb2.CancelRequest(request_id=request.request_id), timeout=5)
                cancelled = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.debug("Cancel of %s on %s: %s", request.request_id, address, exc.code().name)
        if not cancelled:
            raise NotFound(f"no live generation with request_id {request.request_id!r}")
        return inference_pb2.CancelResponse(cancelled=True)

    async def ListModels(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> inference_pb2.ListModelsResponse:
        """Models of the live workers."""
        response = inference_pb2.ListModelsResponse()
        for _, (info, count) in sorted(self._pool.models().items()):
            model = response.models.add()
            model.CopyFrom(info)
            model.workers = count
        return response
