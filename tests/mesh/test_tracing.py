"""OpenTelemetry traces: one trace per generation from the caller's traceparent through router and worker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.support.mesh import in_process_mesh
from tests.support.otlp_receiver import Receiver, attributes
from tokenmesh.v1 import inference_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SECRET = "SECRET-PROMPT-7f3a"


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Receiver]:
    got = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", await got.start())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    yield got
    await got.stop()


async def test_one_trace_from_the_callers_traceparent_through_router_and_worker(receiver: Receiver) -> None:
    async with in_process_mesh() as mesh:
        mesh.backends[0].fail_after = 3  # a generation that starts there moves to the other worker
        metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
        finals = []
        for i in range(2):
            request = inference_pb2.GenerateRequest(prompt=f"{SECRET} {i}", max_tokens=6)
            finals.append([c async for c in mesh.inference.Generate(request, metadata=metadata)][-1])
        bad = (("traceparent", "00-not-a-trace-context"),)  # ignored: a new trace, never an error
        [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2),
                                                  metadata=bad)]
    spans = receiver.spans()
    routers = [s for service, s in spans if service == "tokenmesh-router"]
    workers = [s for service, s in spans if service == "tokenmesh-worker"]
    ours = [s for s in routers if s.trace_id.hex() == TRACE_ID]
    assert len(ours) == 2 and len(routers) == 3
    for span in ours:
        assert span.parent_span_id.hex() == PARENT_ID and span.kind == trace_pb2.Span.SPAN_KIND_SERVER
        a = attributes(span)
        assert span.name == "text_completion fake"
        assert a["gen_ai.request.model"] == "fake" and a["gen_ai.request.max_tokens"] == 6
        assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.response.id"] in {f.request_id for f in finals}
        assert "gen_ai.first_token" in [e.name for e in span.events]
        children = [w for w in workers if w.parent_span_id == span.span_id]
        assert children and all(w.trace_id == span.trace_id for w in children)
        assert all(w.name == "generate fake" for w in children)
    moved = [s for s in ours if any(e.name == "tokenmesh.worker_failed" for e in s.events)]
    assert len(moved) == sum(1 for f in finals if f.migrations)
    for span in moved:  # the failed attempt's worker span says why, the other one ends normally
        event = next(e for e in span.events if e.name == "tokenmesh.worker_failed")
        assert {a.key: a.value.string_value for a in event.attributes}["tokenmesh.failure"] == "backend"
        statuses = sorted(w.status.code for w in workers if w.parent_span_id == span.span_id)
        assert statuses == [trace_pb2.Status.STATUS_CODE_UNSET, trace_pb2.Status.STATUS_CODE_ERROR]
    other = next(s for s in routers if s.trace_id.hex() != TRACE_ID)
    assert not other.parent_span_id  # the malformed traceparent started a trace of its own
    assert SECRET.encode() not in receiver.raw()  # no prompt text in any span


async def test_a_refused_and_an_abandoned_generation_are_recorded_as_what_they_were(receiver: Receiver) -> None:
    async with in_process_mesh(backend_settings={"delay": 0.05}) as mesh:
        with pytest.raises(grpc.aio.AioRpcError):
            [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=100_000))]
        call = mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=500))
        async for chunk in call:
            if chunk.seq == 2:
                break
        call.cancel()
        await mesh.router.inference.idle.wait()
    routers = [s for service, s in receiver.spans() if service == "tokenmesh-router"]
    assert len(routers) == 1  # the refused one never became a generation: no span, a status to the caller
    span = routers[0]
    assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert attributes(span)["tokenmesh.outcome"] == "caller_gone"


async def test_content_goes_into_spans_only_when_captured_and_then_redacted(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    async with in_process_mesh() as mesh:
        request = inference_pb2.GenerateRequest(prompt="mail alice@example.com about 4111 1111 1111 1111",
                                                max_tokens=4)
        [c async for c in mesh.inference.Generate(request)]
    span = next(s for service, s in receiver.spans() if service == "tokenmesh-router")
    events = {e.name: {a.key: a.value.string_value for a in e.attributes} for e in span.events}
    assert events["gen_ai.user.message"]["gen_ai.prompt"] == "mail <EMAIL> about <CARD>"
    assert events["gen_ai.choice"]["gen_ai.completion"] == "tok0 tok1 tok2 tok3 "
    assert b"alice@example.com" not in receiver.raw() and b"4111 1111" not in receiver.raw()


async def test_one_trace_from_the_http_callers_traceparent_through_gateway_router_and_worker(
    receiver: Receiver,
) -> None:
    import httpx

    from tests.support.gateway_helpers import gateway_over

    async with in_process_mesh() as mesh, gateway_over(mesh) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            answer = await http.post("/completions", json={"prompt": f"{SECRET} x", "max_tokens": 3},
                                     headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert answer.status_code == 200
            metrics = (await http.get(gateway.url.removesuffix("/v1") + "/metrics")).text
    spans = {service: [s for svc, s in receiver.spans() if svc == service]
             for service in ("tokenmesh-gateway", "tokenmesh-router", "tokenmesh-worker")}
    (edge,) = spans["tokenmesh-gateway"]
    (router,) = spans["tokenmesh-router"]
    (worker,) = spans["tokenmesh-worker"]
    assert edge.trace_id.hex() == router.trace_id.hex() == worker.trace_id.hex() == TRACE_ID
    assert edge.parent_span_id.hex() == PARENT_ID  # the HTTP caller's span
    assert router.parent_span_id == edge.span_id and worker.parent_span_id == router.span_id
    assert edge.name == "text_completion default" and attributes(edge)["url.path"] == "/v1/completions"
    assert SECRET.encode() not in receiver.raw()
    assert 'tokenmesh_gateway_http_requests_total{route="/v1/completions",status="200"} 1.0' in metrics
