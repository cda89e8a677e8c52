"""The Python client of ``tokenmesh.v1.Inference``: several routers, retries, transparent resume.

A generation is one iterator of chunks whatever happens to the routers under
it. Before the first chunk, transient failures (``UNAVAILABLE``: a router
down, draining or unreachable; ``RESOURCE_EXHAUSTED`` with the router's
retry hint) are retried on the next router under the mesh's one retry policy
(:mod:`tokenmesh.retry`: full jitter, at least the hint, one deadline). Once
chunks flow, a stream that breaks (the router killed, the connection cut) is
continued on another router with
``Resume(request_id, after_seq=<last seq seen>)``: the worker kept the
generation running for its resume grace, and the caller sees every ``seq``
exactly once. For that every generation gets a request id (a fresh one when
the caller gives none); a generation whose id the client made up is
cancelled when the caller stops reading, since nobody else could resume it.
Errors are the mesh's :class:`~tokenmesh.errors.MeshError` classes.

By default (``batched=True``) every generation and resume sent to a router
goes on one shared ``Inference/GenerateStream`` call to it
(:mod:`tokenmesh.client._stream`): one message per router step for all of
them instead of one per chunk per generation. A logical stream raises what
its own Generate call would, so everything above holds unchanged. A router
that predates the call (UNIMPLEMENTED), a request too big for one message,
and ``batched=False`` get one ``Generate``/``Resume`` call per generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any, Self

import grpc
from opentelemetry import trace

from tokenmesh.client._sessions import Sessions
from tokenmesh.client._stream import Call, OwnCall, Stream
from tokenmesh.config import address_error
from tokenmesh.discovery import join, literal_ip
from tokenmesh.errors import DeadlineExceeded, MeshError, Unavailable, from_rpc_error
from tokenmesh.links import Links
from tokenmesh.mux import BROKEN_CODES
from tokenmesh.retry import Backoff, Reconnect, StreamEnded, describe, is_transient
from tokenmesh.server import CHANNEL_OPTIONS
from tokenmesh.tls import open_channel
from tokenmesh.tracing import Tracing, inject
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


class Client:
    """Async client of the mesh's ``Inference`` service over several routers.

    Args:
        routers: ``host:port`` of each router, or one DNS name whose A records are the routers (looked up
            again whenever every address failed).
        retry_deadline_s: how long a generation may take to get going (retries before its first chunk) and,
            after a break, to be resumed.
        max_resumes: how many times one generation may be resumed after its stream broke.
        initial_backoff_s: upper bound of the first wait between attempts (it doubles, up to 2 s).
        credentials: TLS (or mutual TLS) to the routers, e.g. ``grpc.ssl_channel_credentials(ca, key, cert)``;
            None: plaintext.
        server_name: with credentials, the name to verify in the routers' certificates ('' = each address's host).
        tracing: RPC spans of its calls while on (a ``traceparent`` in a call's metadata is their parent).
        batched: every generation to a router on one shared ``Inference/GenerateStream`` call (falling back to
            ``Generate`` for a router that predates it); False: one ``Generate``/``Resume`` call per generation.

    """

    _names: tuple[str, ...]
    _addresses: list[str]
    _resolved_at: float
    _turn: int
    _links: Links
    """Per router: its channel and Inference stub."""
    retry_deadline_s: float
    max_resumes: int
    initial_backoff_s: float
    _background: set[asyncio.Task[Any]]
    _credentials: grpc.ChannelCredentials | None
    _tracing: Tracing | None
    batched: bool
    _sessions: Sessions
    """Per router: the shared GenerateStream call, or that it predates it."""

    def __init__(  # wide: keyword-only options, each with a default
        self,
        routers: str | Sequence[str],
        *,
        retry_deadline_s: float = 30.0,
        max_resumes: int = 8,
        initial_backoff_s: float = 0.05,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
        tracing: Tracing | None = None,
        batched: bool = True,
    ) -> None:
        names = tuple(a.strip() for a in (routers.split(",") if isinstance(routers, str) else routers) if a.strip())
        if not names:
            raise ValueError("give at least one router address host:port")
        for name in names:
            if problem := address_error(name):
                raise ValueError(f"router address {name!r}: {problem}")
        self._names = names
        self._addresses = list(names)
        self._resolved_at = 0.0
        self._turn = random.randrange(len(names))  # noqa: S311 - spreads clients over routers, not security
        options = CHANNEL_OPTIONS
        if server_name:  # the name on the routers' certificates, when they are called by address
            options = (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name))
        # Channels replaced by renew() stay open until close(): streams on them run on.
        self._links = Links(self._channel, options)
        self.retry_deadline_s = retry_deadline_s
        self.max_resumes = max_resumes
        self.initial_backoff_s = initial_backoff_s
        self._background = set()
        self._credentials = credentials
        self._tracing = tracing
        self.batched = batched
        self._sessions = Sessions(self._generate_stream)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel (cancels still on their way are given a moment)."""
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        await self._sessions.close()
        await self._links.close()

    def renew(self, credentials: grpc.ChannelCredentials) -> None:
        """New credentials (renewed certificates) for every call from now on.

        Each router gets a new channel; the old ones stay open until :meth:`close`,
        so streams already running finish on them (a GenerateStream call there is closed once its last stream
        ended; a router that predated it is asked again).
        """
        self._credentials = credentials
        self._links.renew()
        self._sessions.renew()

    # -- routers ------------------------------------------------------------

    async def _resolve(self) -> None:
        """Expand DNS names into the routers behind them (IP hosts are taken as they are)."""
        loop = asyncio.get_running_loop()
        found: list[str] = []
        for name in self._names:
            host, _, port = name.rpartition(":")
            if literal_ip(host):
                found.append(name)
                continue
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("router name %s does not resolve (%s); trying it as it is", name, exc)
                found.append(name)
                continue
            for info in infos:
                address = join(str(info[4][0]), port)
                if address not in found:
                    found.append(address)
        self._addresses = found or list(self._names)
        self._resolved_at = time.monotonic()

    async def _next_router(self, avoid: str = "") -> str:
        """The next router in turn (another than avoid when there is one)."""
        if not self._resolved_at:
            await self._resolve()
        self._turn += 1
        addresses = self._addresses
        address = addresses[self._turn % len(addresses)]
        if address == avoid and len(addresses) > 1:
            self._turn += 1
            address = addresses[self._turn % len(addresses)]
        return address

    def _channel(self, address: str, options: tuple[tuple[str, Any], ...]) -> grpc.aio.Channel:
        """A channel to a router with the credentials of now."""
        return open_channel(address, self._credentials, options, self._tracing)

    def _stub(self, address: str) -> inference_pb2_grpc.InferenceStub:
        return self._links.open(address).stub(inference_pb2_grpc.InferenceStub)

    def _generate_stream(self, address: str) -> Any:
        """A new GenerateStream call to the router (no deadline: each stream carries its own)."""
        return self._stub(address).GenerateStream()

    def _policy(self, what: str, deadline_s: float) -> Reconnect:
        """The mesh's retry policy (tokenmesh.retry) for one call: full jitter up to 2 s, one deadline."""
        # A library's retries stay quiet: the caller learns of a failure from the error it raises (a command such
        # as `tokenmesh bench` prints that one line), so no WARNING after warn_after failures.
        backoff = Backoff(initial_s=self.initial_backoff_s, max_s=2.0, deadline_s=deadline_s, warn_after=sys.maxsize)
        return Reconnect(what, ",".join(self._names), backoff, log, loud=False)

    async def _rediscover(self, failures: int) -> None:
        if failures % max(len(self._addresses), 1) == 0:
            await self._resolve()  # every router failed once: the name's records may have changed

    # -- calls --------------------------------------------------------------

    def generate(
        self,
        request: inference_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> AsyncGenerator[inference_pb2.GenerateChunk, None]:
        """Stream a generation's chunks, seq 1, 2, 3... each exactly once, across router failures.

        ``timeout`` bounds the whole generation (retries and resumes included); ``DeadlineExceeded`` after.
        ``metadata`` goes with every call (e.g. the caller's W3C ``traceparent``).
        Raises the mesh's error for a status that is not transient (``InvalidArgument``, ``NotFound``...),
        or the last transient one once ``retry_deadline_s`` passed without progress.
        """
        chosen = bool(request.request_id)
        # The iterator is _follow's own (no generator around it: one less frame per chunk).
        return self._follow(
            request if chosen else _with_id(request), None, timeout, metadata, cancel_unfinished=not chosen
        )

    def resume(
        self,
        request_id: str,
        after_seq: int = 0,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> AsyncGenerator[inference_pb2.GenerateChunk, None]:
        """Chunks of a generation after after_seq (replayed, then live), across router failures."""
        return self._follow(
            None, inference_pb2.ResumeRequest(request_id=request_id, after_seq=after_seq), timeout, metadata
        )

    async def _follow(
        self,
        request: inference_pb2.GenerateRequest | None,
        resume: inference_pb2.ResumeRequest | None,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]] = (),
        *,
        cancel_unfinished: bool = False,
    ) -> AsyncGenerator[inference_pb2.GenerateChunk, None]:
        """The chunks of request (Generate) or of resume (Resume), continued on other routers when a stream breaks.

        Which call goes next: Generate until a router may have started the generation; from then on
        Resume(after_seq=last seq yielded). A Resume that finds nothing before any chunk arrived (NOT_FOUND: the
        router that had it never reached a worker) goes back to Generate. With cancel_unfinished, a generation left
        before its final chunk (the caller stopped reading, or an error) is cancelled: nobody else knows its id.
        """
        end = None if timeout is None else time.monotonic() + timeout
        if request is not None:
            request_id, last, resuming = request.request_id, 0, False
        else:
            assert resume is not None
            request_id, last, resuming = resume.request_id, resume.after_seq, True
        policy = self._policy(f"generation {request_id}", self.retry_deadline_s)
        resumes = 0
        address = ""
        stay = finished = False
        call: Call | None = None
        try:
            while True:
                if not stay:
                    address = await self._next_router(avoid=address)
                stay = False
                broken: grpc.aio.AioRpcError | None = None
                try:
                    call = await self._open(
                        address, request_id, None if resuming else request, last, end, timeout, metadata
                    )
                    async for chunk in call:
                        if chunk.seq <= last:
                            continue  # a replay overlapping what the caller has
                        last = chunk.seq
                        policy.connected()
                        finished = bool(chunk.finish_reason)
                        yield chunk
                        if finished:
                            return
                except grpc.aio.AioRpcError as exc:
                    if resuming and exc.code() == grpc.StatusCode.NOT_FOUND and request is not None and last == 0:
                        resuming, stay = False, True  # nothing was started: start it now, on this router (it answers)
                        continue
                    resuming, broken = _after_break(exc, resuming, last), exc
                else:
                    resuming = True  # the stream ended without a final chunk
                if last:
                    resumes += 1
                await self._again(policy, broken, resumes, request_id, address, last, resuming)
        finally:
            self._leave(call, request_id, cancel=cancel_unfinished and not finished)

    def _leave(self, call: Call | None, request_id: str, *, cancel: bool) -> None:
        """Let go of the last attempt's call; with cancel, stop the generation (nobody else knows its id)."""
        if call is not None and call.let_go(cancel=cancel):
            return  # the cancel went on its GenerateStream call
        if cancel:
            self._cancel_later(request_id)

    async def _open(  # wide: one attempt's coordinates, read by the retry loop each time round
        self,
        address: str,
        request_id: str,
        request: inference_pb2.GenerateRequest | None,
        last: int,
        end: float | None,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
    ) -> Call:
        """Generate (request given), else Resume after last, on address within what is left of the timeout.

        A stream on the router's GenerateStream call when batched and the router serves it; else a call of its own.
        Raises the ``grpc.aio.AioRpcError`` a GenerateStream call failed to open with (as a Generate call would).
        """
        remaining = None if end is None else end - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"generation {request_id} did not finish within {timeout:g} s")
        if self.batched:
            stream = await self._start_stream(address, request_id, request, last, end, metadata)
            if stream is not None:
                return stream
        stub = self._stub(address)
        if request is None:
            follow = inference_pb2.ResumeRequest(request_id=request_id, after_seq=last)
            return OwnCall(stub.Resume(follow, timeout=remaining, metadata=tuple(metadata)))
        return OwnCall(stub.Generate(request, timeout=remaining, metadata=tuple(metadata)))

    async def _start_stream(
        self,
        address: str,
        request_id: str,
        request: inference_pb2.GenerateRequest | None,
        last: int,
        end: float | None,
        metadata: Sequence[tuple[str, str]],
    ) -> Stream | None:
        """A stream on the router's GenerateStream call; None where the generation needs a call of its own.

        That is: a router that predates GenerateStream, a request too big to share a message (it could not go on
        the call without ending it for every stream), and a start that waited for room (the router's max_streams)
        until the call ended.
        """
        session = await self._sessions.get(address)
        if session is None:
            return None
        if session.full():
            try:
                await asyncio.wait_for(session.slot(), None if end is None else max(0.0, end - time.monotonic()))
            except TimeoutError:
                raise DeadlineExceeded(f"generation {request_id}: no room on router {address} in time") from None
            if not session.open:
                return None
        command = inference_pb2.StreamCommand(metadata=dict(metadata))
        if self._tracing is not None and self._tracing.on and "traceparent" not in command.metadata:
            command.metadata.update(inject(trace.get_current_span()))  # a Generate call's span would have this parent
        if request is None:
            command.resume.request_id = request_id
            command.resume.after_seq = last
        else:
            command.generate.CopyFrom(request)
        if end is not None:
            command.timeout_s = max(0.001, end - time.monotonic())
        if command.ByteSize() > session.max_command_bytes:
            return None
        return session.start(command, end)

    async def _again(  # wide: what the retry loop knows of the attempt that broke, for its log line and policy
        self,
        policy: Reconnect,
        broken: grpc.aio.AioRpcError | None,
        resumes: int,
        request_id: str,
        address: str,
        last: int,
        resuming: bool,
    ) -> None:
        """Wait before the next attempt under the policy; raise the mesh's error once it gives up."""
        remaining = policy.remaining_s()
        try:
            failure = broken if broken is not None else StreamEnded(f"router {address} ended the stream early")
            if resumes > self.max_resumes or (remaining is not None and remaining <= 0):
                raise failure
            log.info(
                "generation %s: router %s failed after seq %d (%s); %s on another router",
                request_id,
                address,
                last,
                describe(broken) if broken else "stream ended early",
                "resuming" if resuming else "retrying",
            )
            # What may be tried again was decided by _after_break; the policy gives the wait and the deadline.
            await policy.failed(failure, retry_on=lambda _: True)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        except StreamEnded:
            raise Unavailable(
                f"generation {request_id}: router {address} ended the stream without a final chunk, too often"
            ) from None
        await self._rediscover(policy.failures)

    def _cancel_later(self, request_id: str) -> None:
        """Stop a generation nobody reads any more (in the background: the caller is leaving)."""
        with contextlib.suppress(RuntimeError):  # no running loop: the process is going away
            task = asyncio.get_running_loop().create_task(self._quiet_cancel(request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _quiet_cancel(self, request_id: str) -> None:
        with contextlib.suppress(MeshError, grpc.aio.AioRpcError, grpc.aio.UsageError):
            await self.cancel(request_id, timeout=2)

    async def cancel(self, request_id: str, *, timeout: float = 5.0) -> inference_pb2.CancelResponse:
        """Stop a generation wherever it runs (any router finds it)."""
        response: inference_pb2.CancelResponse = await self._unary(
            "Cancel", inference_pb2.CancelRequest(request_id=request_id), timeout
        )
        return response

    async def list_models(self, *, timeout: float = 5.0) -> inference_pb2.ListModelsResponse:
        """The models the mesh serves."""
        response: inference_pb2.ListModelsResponse = await self._unary(
            "ListModels", inference_pb2.ListModelsRequest(), timeout
        )
        return response

    async def _unary(self, method: str, request: Any, timeout: float) -> Any:
        """A unary call, tried on the next router while the failure is transient, within timeout."""
        policy = self._policy(method, timeout)
        address = ""
        while True:
            address = await self._next_router(avoid=address)
            try:
                return await getattr(self._stub(address), method)(
                    request, timeout=max(0.001, policy.remaining_s() or 0.0)
                )
            except grpc.aio.AioRpcError as exc:
                try:
                    await policy.failed(exc)
                except grpc.aio.AioRpcError:
                    raise from_rpc_error(exc) from exc
                await self._rediscover(policy.failures)


def _with_id(request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateRequest:
    copy = inference_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = uuid.uuid4().hex
    return copy


def _after_break(exc: grpc.aio.AioRpcError, resuming: bool, last: int) -> bool:
    """Whether the next attempt resumes after a stream broke with exc; raises the mesh's error if it ends here.

    Mid-stream, a status the router answered itself (its ErrorInfo) ends the
    generation (its worker failed for good, no live worker): only a broken
    connection is resumed. Before any chunk, a transient refusal
    (RESOURCE_EXHAUSTED with a retry hint) started nothing; anything else may have.
    """
    code = exc.code()
    started_maybe = code in BROKEN_CODES
    if (
        code == grpc.StatusCode.DEADLINE_EXCEEDED
        or not (started_maybe or is_transient(exc))
        or (last and from_rpc_error(exc).answered)
    ):
        raise from_rpc_error(exc) from exc
    return resuming or started_maybe
