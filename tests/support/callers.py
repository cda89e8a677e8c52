"""The callers of the chaos rows (tests/support/chaos.py): generations back to back, through ``tokenmesh.client``
or through the gateway's SSE with ``X-Request-Id``, and what each saw of each generation (:class:`Trace`)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
import orjson

from tests.support.cluster import GATEWAY_PORT, Cluster
from tokenmesh.client import Client
from tokenmesh.errors import MeshError, ResourceExhausted
from tokenmesh.v1 import inference_pb2

POLL_S = 0.05
"""How often a wait on the callers looks again."""
SSE_RESUME_S = 30.0
"""How long an SSE caller keeps asking again after a dropped connection or a gateway that could not take it
(within the workers' 30 s resume grace)."""


@dataclass
class Trace:
    """What one caller saw of one generation."""

    started: float = field(default_factory=time.monotonic)
    """time.monotonic() when the caller asked for it."""
    arrivals: list[float] = field(default_factory=list)
    """time.monotonic() of each chunk."""
    seq_ok: bool = True
    tokens: int = 0
    completion_tokens: int = 0
    finish: int = 0
    migrations: int = 0
    """Moves to another worker (the final chunk's; an SSE caller does not see them)."""
    error: str = ""
    refused_with_hint: bool = False
    """Refused (RESOURCE_EXHAUSTED, or 429) with a retry hint."""
    via_gateway: bool = False
    resumed: int = 0
    """Times an SSE caller resumed its stream after its connection dropped."""

    def add(self, chunk: inference_pb2.GenerateChunk) -> None:
        """Account for one chunk."""
        self.arrived(chunk.seq)
        self.tokens += chunk.token_count
        if chunk.finish_reason:
            self.finish = chunk.finish_reason
            self.completion_tokens = chunk.usage.completion_tokens
            self.migrations = chunk.migrations

    def arrived(self, seq: int) -> None:
        """A chunk numbered seq arrived now."""
        self.arrivals.append(time.monotonic())
        self.seq_ok &= seq == len(self.arrivals)

    @property
    def admitted(self) -> bool:
        """The mesh started it (a chunk arrived)."""
        return bool(self.arrivals)

    def broken(self, tokens: int) -> bool:
        """Admitted, then an error, a seq gap or repeat, or not the tokens asked for."""
        whole = self.seq_ok and self.finish != 0 and self.tokens == self.completion_tokens == tokens
        return self.admitted and (bool(self.error) or not whole)

    def gaps(self, after: float = 0.0, *, from_start: bool = False) -> list[float]:
        """Seconds between consecutive chunks (from_start: the wait for the first chunk too), for each chunk that
        arrived after ``after``."""
        times = [self.started, *self.arrivals] if from_start else self.arrivals
        pairs = zip(times, times[1:], strict=False)
        return [b - a for a, b in pairs if b > after]


def request(label: str, index: int, tokens: int) -> inference_pb2.GenerateRequest:
    """A generation of exactly ``tokens`` tokens, with a prompt of its own (the prefix policy spreads them)."""
    return inference_pb2.GenerateRequest(
        prompt=f"{label} caller {index}: once upon a time", max_tokens=tokens, ignore_eos=True, seed=index
    )


async def call(client: Client, req: inference_pb2.GenerateRequest, trace: Trace, timeout_s: float) -> None:
    """One caller: read the generation to its end into trace (an error is recorded, not raised)."""
    try:
        async for chunk in client.generate(req, timeout=timeout_s):
            trace.add(chunk)
    except MeshError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        trace.refused_with_hint = isinstance(exc, ResourceExhausted) and exc.retry_delay is not None


async def sse_call(
    http: httpx.AsyncClient, req: inference_pb2.GenerateRequest, request_id: str, trace: Trace, timeout_s: float
) -> None:
    """One caller through the gateway: ``POST /v1/completions`` streamed with ``X-Request-Id``, read to ``[DONE]``
    into trace. As a browser's EventSource does, a connection that drops is resumed after the last event id seen
    (``Last-Event-ID``), and a gateway that cannot take the request (503 while it drains, no connection while it
    restarts) is asked again, for up to SSE_RESUME_S. Tokens are counted in the text (the synthetic model's tokens
    are words)."""
    trace.via_gateway = True
    body = {
        "model": "synthetic",
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "seed": req.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    retry_until = 0.0
    while True:
        headers = {"X-Request-Id": request_id}
        if trace.arrivals:
            headers["Last-Event-ID"] = f"{request_id}:{len(trace.arrivals)}"
        status = 0
        try:
            async with http.stream("POST", "/v1/completions", json=body, headers=headers, timeout=timeout_s) as answer:
                status = answer.status_code
                if status == 200:
                    trace.error = ""
                    if await _read_events(answer, trace):
                        return
                    trace.error = "the stream ended before [DONE]"
                else:
                    trace.error = f"HTTP {status}: {(await answer.aread())[:200]!r}"
                    trace.refused_with_hint = status == 429 and "retry-after" in answer.headers
        except httpx.TransportError as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
        if not trace.arrivals and status not in (0, 502, 503, 504):
            return  # refused for good (429 included: the row counts its hint)
        retry_until = retry_until or time.monotonic() + SSE_RESUME_S
        if time.monotonic() > retry_until:
            return
        trace.resumed += bool(trace.arrivals)
        await asyncio.sleep(0.5)  # the gateway notices a dropped connection and detaches the generation


async def _read_events(answer: httpx.Response, trace: Trace) -> bool:
    """Read SSE events into trace; True at ``[DONE]`` (False: the body ended without it).

    A chunk's events count once its id arrived (on its last event): a stream resumed after that id replays none
    of them, one cut before it replays them all.
    """
    fields: dict[str, str] = {}
    pending = Trace()
    async for line in answer.aiter_lines():
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
            continue
        data = fields.get("data", "")
        if data == "[DONE]":
            return True
        if data:
            _take_event(orjson.loads(data), pending)
        if "id" in fields:
            trace.arrived(int(fields["id"].rpartition(":")[2]))
            trace.tokens += pending.tokens
            trace.finish = trace.finish or pending.finish
            trace.completion_tokens = pending.completion_tokens or trace.completion_tokens
            pending = Trace()
        if pending.error:
            trace.error = pending.error
        fields = {}
    return False


def _take_event(event: dict[str, Any], into: Trace) -> None:
    if "error" in event:
        into.error = f"error event: {event['error']}"
    for choice in event.get("choices", []):
        into.tokens += len(choice.get("text", "").split())
        if choice.get("finish_reason"):
            into.finish = 1
    if usage := event.get("usage"):
        into.completion_tokens = usage["completion_tokens"]


class Callers:
    """``streams`` callers, each running generations of ``tokens`` tokens back to back until :meth:`finish`
    (then each ends its generation): through ``tokenmesh.client`` to every router, the first ``via_gateway`` of
    them through the gateway's SSE instead. Used as ``async with``: leaving cancels what still runs.

    Args:
        cluster: the cluster.
        label: in every prompt and request id.
        streams: callers.
        tokens: tokens per generation.
        via_gateway: callers through the gateway.

    """

    traces: list[Trace]
    """Every generation so far, in the order they began."""
    _cluster: Cluster
    _label: str
    _streams: int
    _tokens: int
    _via_gateway: int
    _timeout_s: float
    _ids: str
    """The start of every X-Request-Id (one of the gateway's allowed characters only, new for each Callers)."""
    _stop: asyncio.Event
    _tasks: list[asyncio.Task[None]]
    _client: Client
    _http: httpx.AsyncClient

    def __init__(self, cluster: Cluster, label: str, *, streams: int, tokens: int, via_gateway: int = 0) -> None:
        self.traces = []
        self._cluster = cluster
        self._label = label
        self._streams = streams
        self._tokens = tokens
        self._via_gateway = via_gateway
        self._timeout_s = 3 * tokens / cluster.config.tokens_per_s + 120
        self._ids = f"{re.sub(r'[^A-Za-z0-9._~-]+', '-', label)[:80]}-{time.time_ns() % 10**12:x}"
        self._stop = asyncio.Event()
        self._tasks = []
        self._client = Client([r.address for r in cluster.routers])
        gateway = f"http://{cluster.services['gateway'].pod.address}:{GATEWAY_PORT}" if via_gateway else ""
        self._http = httpx.AsyncClient(base_url=gateway, limits=httpx.Limits(max_connections=None))

    async def __aenter__(self) -> Callers:
        await self._client.__aenter__()
        for index in range(self._streams):
            self._tasks.append(asyncio.create_task(self._caller(index, index < self._via_gateway)))
        await asyncio.sleep(0)  # each caller has begun its first generation
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()
        await self._client.__aexit__(kind, exc, tb)

    async def _caller(self, index: int, via_gateway: bool) -> None:
        while not self._stop.is_set():
            trace = Trace()
            self.traces.append(trace)
            req = request(f"{self._label} {index}", len(self.traces), self._tokens)
            if via_gateway:
                request_id = f"{self._ids}-{index}-{len(self.traces)}"
                await sse_call(self._http, req, request_id, trace, self._timeout_s)
            else:
                await call(self._client, req, trace, self._timeout_s)

    async def streaming(self, chunks: int = 3, timeout_s: float = 120) -> None:
        """Until every generation got ``chunks`` chunks or ended."""
        await until_streaming(list(self.traces), chunks, timeout_s)

    def streaming_now(self, within_s: float = 2.0) -> int:
        """Generations streaming now: admitted, not ended, a chunk within the last within_s."""
        now = time.monotonic()
        return sum(
            bool(t.arrivals) and not t.finish and not t.error and now - t.arrivals[-1] <= within_s for t in self.traces
        )

    async def finish(self) -> None:
        """Stop starting generations and wait until each caller's last one ended."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def until_streaming(traces: list[Trace], chunks: int = 3, timeout_s: float = 120) -> None:
    """Until every generation got ``chunks`` chunks or ended."""
    deadline = time.monotonic() + timeout_s
    while not all(len(t.arrivals) >= chunks or t.error or t.finish for t in traces):
        if time.monotonic() > deadline:
            raise TimeoutError(f"generations not streaming after {timeout_s:g} s")
        await asyncio.sleep(POLL_S)
