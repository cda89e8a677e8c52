"""A generation's Observation: tracing off, no span recorded and the same metrics; on, the span's record."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmesh import logs
from tokenmesh.errors import ResourceExhausted
from tokenmesh.router._metrics import GenerationMetrics, RouterMetrics
from tokenmesh.router._observe import Observation, generation_span
from tokenmesh.router._outcome import WorkerFailed
from tokenmesh.v1 import inference_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
BASE = inference_pb2.GenerateRequest(prompt="mail alice@example.com", model="m", max_tokens=3, request_id="rid")


def chunks() -> list[inference_pb2.GenerateChunk]:
    return [
        inference_pb2.GenerateChunk(seq=1, text="to bob@", token_count=1),
        inference_pb2.GenerateChunk(seq=2, text="example.com ", token_count=1),
        inference_pb2.GenerateChunk(
            seq=3,
            text="done",
            token_count=1,
            finish_reason=inference_pb2.FINISH_REASON_LENGTH,
            usage=inference_pb2.Usage(prompt_tokens=4, completion_tokens=3),
        ),
    ]


def counts(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter and every histogram's count (sums and buckets depend on the clock)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if not s.name.endswith(("_sum", "_bucket", "_created"))
    }


def play(observe: Observation | GenerationMetrics) -> None:
    """One generation that fails on a worker after its first chunk, then ends on another."""
    pieces = chunks()
    if isinstance(observe, Observation):
        observe.queued(0.01, 0)
        observe.chunk(pieces[0], "w:1")
        observe.worker_failed("w:1", WorkerFailed("it broke", "backend"), 1, migrated=True)
        for piece in pieces[1:]:
            observe.chunk(piece, "w:2")
        observe.caller_gone(True)  # after the end: nothing to record
        return
    observe.queued(0.01, 0)
    observe.chunk(pieces[0], "w:1")
    observe.worker_failed("w:1", "backend", migrated=True)
    for piece in pieces[1:]:
        observe.chunk(piece, "w:2")


def test_with_tracing_off_nothing_is_recorded_the_metrics_are_the_same_and_a_chunk_costs_only_the_metrics() -> None:
    metrics, plain = RouterMetrics(), RouterMetrics()
    span = generation_span(
        trace.NoOpTracer(), BASE, (("traceparent", TRACEPARENT),), policy="p2c", affinity="", capture_content=True
    )
    observe = Observation(metrics.generation("m", "t"), span, capture_content=True)
    assert not span.is_recording()
    assert observe.chunk == observe.track.chunk  # no tracing work per chunk
    assert observe.trace_context == {"traceparent": TRACEPARENT}  # the caller's context goes on to the worker
    play(observe)
    observe.end(10.0, 1)
    play(plain.generation("m", "t"))
    assert counts(metrics.registry) == counts(plain.registry)
    assert (
        counts(metrics.registry)[
            ("tokenmesh_router_requests_total", (("model", "m"), ("outcome", "length"), ("tenant", "other")))
        ]
        == 1
    )


def test_with_tracing_off_and_no_caller_context_the_worker_gets_none() -> None:
    span = generation_span(trace.NoOpTracer(), BASE, (), policy="p2c", affinity="", capture_content=False)
    assert Observation(RouterMetrics().generation("m", ""), span, capture_content=False).trace_context == {}


@pytest.fixture
def recorded() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def only(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = exporter.get_finished_spans()
    return span


@pytest.mark.parametrize("capture", [False, True])
def test_with_tracing_on_the_span_records_the_generation(
    recorded: tuple[trace.Tracer, InMemorySpanExporter], capture: bool
) -> None:
    tracer, exporter = recorded
    span = generation_span(
        tracer, BASE, (("traceparent", TRACEPARENT),), policy="p2c", affinity="prefix", capture_content=capture
    )
    metrics = RouterMetrics()
    observe = Observation(metrics.generation("m", "t"), span, capture_content=capture)
    assert observe.trace_context["traceparent"].startswith(f"00-{TRACE_ID}-")
    assert observe.trace_context["traceparent"] != TRACEPARENT  # the router's span is the worker's parent
    observe.attempt("w:1")
    play(observe)
    observe.attempt("w:2")
    observe.end(10.0, 1)
    done = only(exporter)
    assert done.name == "text_completion m" and done.kind == trace.SpanKind.SERVER
    assert format(done.context.trace_id, "032x") == TRACE_ID
    assert dict(done.attributes or {}) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.system": "tokenmesh",
        "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 3,
        "gen_ai.response.id": "rid",
        "tokenmesh.policy": "p2c",
        "tokenmesh.prefix_affinity": True,
        "tokenmesh.session_affinity": False,
        "tokenmesh.worker": "w:2",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 4,
        "gen_ai.usage.output_tokens": 3,
        "tokenmesh.queue_ms": 10.0,
        "tokenmesh.migrations": 1,
    }
    events = [(e.name, dict(e.attributes or {})) for e in done.events]
    expected = [
        ("gen_ai.first_token", {}),
        (
            "tokenmesh.worker_failed",
            {"tokenmesh.worker": "w:1", "tokenmesh.failure": "backend", "tokenmesh.after_seq": 1},
        ),
    ]
    if capture:  # redacted, the prompt first and the output at the end
        expected = [
            ("gen_ai.user.message", {"gen_ai.prompt": "mail <EMAIL>"}),
            *expected,
            ("gen_ai.choice", {"gen_ai.completion": "to <EMAIL> done"}),
        ]
    assert events == expected
    assert done.status.status_code == StatusCode.UNSET


def test_a_failed_and_an_abandoned_generation_are_recorded_as_what_they_were(
    recorded: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = recorded
    metrics = RouterMetrics()
    failed = Observation(metrics.generation("m", ""), tracer.start_span("f"), capture_content=False)
    failed.failed(ResourceExhausted("queue full"), False)
    failed.end(0.0, 0)
    gone = Observation(metrics.generation("m", ""), tracer.start_span("g"), capture_content=False)
    gone.chunk(chunks()[0], "w:1")
    gone.caller_gone(True)
    gone.end(0.0, 0)
    first, second = exporter.get_finished_spans()
    assert first.status.status_code == StatusCode.ERROR and first.status.description == "queue full"
    assert (first.attributes or {})["error.type"] == "RESOURCE_EXHAUSTED"
    assert second.status.status_code == StatusCode.ERROR
    assert (second.attributes or {})["tokenmesh.outcome"] == "caller_gone"
    samples = counts(metrics.registry)
    assert (
        samples[
            (
                "tokenmesh_router_requests_total",
                (("model", "m"), ("outcome", "resource_exhausted"), ("tenant", "other")),
            )
        ]
        == 1
    )
    assert (
        samples[("tokenmesh_router_requests_total", (("model", "m"), ("outcome", "caller_gone"), ("tenant", "other")))]
        == 1
    )


def test_log_lines_carry_a_recording_spans_ids_and_none_for_a_no_op_span(
    recorded: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, _ = recorded
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "m", None, None)
    parent = generation_span(
        trace.NoOpTracer(), BASE, (("traceparent", TRACEPARENT),), policy="p2c", affinity="", capture_content=False
    )
    logs.about("rid", parent)
    logs.CallContext().filter(record)
    assert (record.request_id, record.trace_id, record.span_id) == ("rid", "", "")
    span = generation_span(
        tracer, BASE, (("traceparent", TRACEPARENT),), policy="p2c", affinity="", capture_content=False
    )
    logs.about("rid", span)
    logs.CallContext().filter(record)
    assert record.trace_id == TRACE_ID and record.span_id == format(span.get_span_context().span_id, "016x")
    span.end()
    logs.about("", trace.INVALID_SPAN)  # this test's context: as it was
