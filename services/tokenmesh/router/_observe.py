"""What a generation on the router leaves besides its chunks: its metrics and its span, in one observer.

Generate tells an :class:`Observation` what happens (a slot after a wait, an
attempt on a worker, each chunk, a worker failure, the outcome) and never
asks whether tracing is on: with tracing off the tracer is OpenTelemetry's
no-op one, whose span records nothing and carries the caller's trace context
on to the worker. The per-chunk method is chosen once, when the span starts:
with a span that does not record it is the metrics' own, so the hot path does
no tracing work.

While the router traces, the generation's span is the child of its call's RPC
server span, and each attempt's worker call is opened for the generation
(not a spare) with the span's context in its metadata, so the call's RPC
spans and the worker's are its children. Not tracing, the caller's context
(if any) goes to the worker in the start command, on a spare call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import StatusCode

from tokenmesh.errors import MeshError, label
from tokenmesh.redaction import StreamRedactor, redact
from tokenmesh.router._metrics import GenerationMetrics
from tokenmesh.router._outcome import WorkerFailed
from tokenmesh.tracing import inject, operation, parent
from tokenmesh.v1 import inference_pb2


def generation_span(
    tracer: trace.Tracer,
    base: inference_pb2.GenerateRequest,
    metadata: Iterable[tuple[str, Any]] | None,
    *,
    policy: str,
    affinity: str,
    capture_content: bool,
) -> trace.Span:
    """The generation's span (GenAI semantic conventions), child of the call's RPC server span, else of the caller's.

    Under the RPC span it is an INTERNAL span; without one (tracing off, or the service excluded from RPC spans) it
    is the caller's SERVER span.

    Args:
        tracer: the router's tracer (the no-op one while tracing is off).
        base: the generation's request, as the router runs it (request_id and model set).
        metadata: the caller's gRPC metadata (its ``traceparent``).
        policy: the router's worker-selection policy.
        affinity: what places the request on a worker: 'session' (its session key), 'prefix' (its prompt prefix)
            or '' (neither: load alone).
        capture_content: put the prompt, redacted, into the span.

    """
    name = operation(bool(base.messages))
    context = parent(metadata)
    span = tracer.start_span(
        f"{name} {base.model}",
        context=context,
        kind=trace.SpanKind.INTERNAL if context is None else trace.SpanKind.SERVER,
        attributes={
            "gen_ai.operation.name": name,
            "gen_ai.system": "tokenmesh",
            "gen_ai.request.model": base.model,
            "gen_ai.request.max_tokens": base.max_tokens,
            "gen_ai.response.id": base.request_id,
            "tokenmesh.policy": policy,
            "tokenmesh.prefix_affinity": affinity == "prefix",
            "tokenmesh.session_affinity": affinity == "session",
        },
    )
    if capture_content and span.is_recording():  # opted in: the prompt, redacted
        prompt = base.prompt or "\n".join(f"{m.role}: {m.content}" for m in base.messages)
        span.add_event("gen_ai.user.message", {"gen_ai.prompt": redact(prompt)})
    return span


class Observation:
    """One generation's metrics and span: what happened to it, told as it happens.

    Args:
        track: the generation's metrics.
        span: its span (a non-recording one while tracing is off).
        capture_content: put the output, redacted as it streams, into the span.

    """

    track: GenerationMetrics
    span: trace.Span
    trace_context: dict[str, str]
    """The W3C headers that make the span the parent of the worker's (the caller's context when not recording)."""
    call_context: dict[str, str]
    """Recording: trace_context, for the metadata of a worker call of the generation's own; else empty (a spare)."""
    start_context: dict[str, str]
    """Not recording: trace_context, for the start command on a spare call; else empty (it is in the metadata)."""
    chunk: Callable[[inference_pb2.GenerateChunk, str], None]
    """Count (and, recording, trace) a chunk relayed from a worker: ``chunk(piece, worker_address)``."""
    _redactor: StreamRedactor | None
    """Redacts the output as it streams (None: no content capture, or a span that does not record)."""
    _output: list[str]
    """The redacted output so far (content capture only)."""

    def __init__(self, track: GenerationMetrics, span: trace.Span, *, capture_content: bool) -> None:
        self.track = track
        self.span = span
        self.trace_context = inject(span)
        recording = span.is_recording()
        # A spare was opened during an earlier generation: a traced one opens its own (its RPC spans in its trace).
        self.call_context, self.start_context = (self.trace_context, {}) if recording else ({}, self.trace_context)
        self._redactor = StreamRedactor() if recording and capture_content else None
        self._output = []
        # Chosen once: with a span that does not record, a chunk costs what the metrics alone cost.
        self.chunk = self._traced_chunk if recording else track.chunk

    def _traced_chunk(self, piece: inference_pb2.GenerateChunk, worker: str) -> None:
        """Count the chunk; the first as an event, the end's usage and finish reason (and output) on the span."""
        self.track.chunk(piece, worker)
        span = self.span
        if piece.seq == 1:
            span.add_event("gen_ai.first_token")
        if self._redactor is not None:
            self._output.append(self._redactor.feed(piece.text))
            if piece.finish_reason:
                span.add_event("gen_ai.choice", {"gen_ai.completion": "".join(self._output) + self._redactor.flush()})
        if piece.finish_reason:
            span.set_attribute(
                "gen_ai.response.finish_reasons", [label(piece.finish_reason, inference_pb2.FinishReason)]
            )
            span.set_attribute("gen_ai.usage.input_tokens", piece.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", piece.usage.completion_tokens)

    def queued(self, seconds: float, priority: int) -> None:
        """The first attempt got its worker slot after waiting seconds."""
        self.track.queued(seconds, priority)

    def attempt(self, worker: str) -> None:
        """An attempt starts on worker (the span names the last one)."""
        self.span.set_attribute("tokenmesh.worker", worker)

    def ended_here(self, final: inference_pb2.GenerateChunk) -> None:
        """The router ended the generation itself with final (no worker sent an end)."""
        self.track.chunk(final, "")

    def worker_failed(self, worker: str, failure: WorkerFailed, after_seq: int, *, migrated: bool) -> None:
        """An attempt on worker failed after after_seq reached the caller."""
        self.span.add_event(
            "tokenmesh.worker_failed",
            {"tokenmesh.worker": worker, "tokenmesh.failure": failure.kind, "tokenmesh.after_seq": after_seq},
        )
        self.track.worker_failed(worker, failure.kind, migrated=migrated)

    def failed(self, error: MeshError, delivered: bool) -> None:
        """The generation ended with error (after output reached the caller, when delivered)."""
        self.track.failed(label(error.grpc_code), delivered)
        self.span.set_attribute("error.type", error.grpc_code.name)
        self.span.set_status(StatusCode.ERROR, error.message)

    def caller_gone(self, delivered: bool) -> None:
        """The caller went away (recorded as what it was, not as OK, unless the generation had ended)."""
        if self.track.finished:
            return
        self.track.failed("caller_gone", delivered)
        self.span.set_attribute("tokenmesh.outcome", "caller_gone")
        self.span.set_status(StatusCode.ERROR, "the caller went away before the end")

    def end(self, queue_ms: float, migrations: int) -> None:
        """The generation is over: the span ends with where its time went and how often it moved."""
        self.span.set_attribute("tokenmesh.queue_ms", queue_ms)
        self.span.set_attribute("tokenmesh.migrations", migrations)
        self.span.end()
