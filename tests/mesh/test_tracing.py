"""OpenTelemetry traces: one trace per generation from the caller's traceparent through router and worker.

Each hop is an RPC span (opentelemetry-instrumentation-grpc, tokenmesh._rpc_spans), the generation spans their
children: caller -> router RPC server span -> router generation span -> router->worker RPC client span -> worker
RPC server span -> worker generation span. On a worker link (one call for many generations) an attempt's client
span is its stream's on the link, and the worker's generation span is its child.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.support.mesh import in_process_mesh
from tests.support.otlp_receiver import Receiver, attributes
from tokenmesh.errors import ErrorInterceptor
from tokenmesh.router._link import STREAM_SPAN
from tokenmesh.router._spares import SPARE
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

GRPC_OK, GRPC_CANCELLED, GRPC_INVALID_ARGUMENT = 0, 1, 3

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


def generations(spans: list[tuple[str, trace_pb2.Span]], service: str) -> list[trace_pb2.Span]:
    """The service's generation (GenAI) spans: every span that is not an RPC's."""
    return [s for svc, s in spans if svc == service and "rpc.system" not in attributes(s)]


def rpcs(spans: list[tuple[str, trace_pb2.Span]], service: str, method: str) -> list[trace_pb2.Span]:
    """The service's RPC spans of one method (``Service/Method``), server and client."""
    return [s for svc, s in spans if svc == service and s.name == f"/{method}"]


def parent(spans: list[tuple[str, trace_pb2.Span]], span: trace_pb2.Span) -> trace_pb2.Span:
    (found,) = [s for _, s in spans if s.span_id == span.parent_span_id]
    return found


def worker_spans(
    spans: list[tuple[str, trace_pb2.Span]], generation: trace_pb2.Span, linked: bool
) -> list[tuple[trace_pb2.Span, trace_pb2.Span]]:
    """(attempt's client span, worker's generation span) of each attempt of a router generation span.

    Per generation: the Worker/Generate call's RPC span -> the worker's RPC server span -> its generation span. On
    a link: the attempt's stream span -> the worker's generation span (a link carries no per-generation RPC).
    """
    if linked:
        calls = [s for svc, s in spans if svc == "tokenmesh-router" and s.name == STREAM_SPAN]
    else:
        calls = rpcs(spans, "tokenmesh-router", "tokenmesh.v1.Worker/Generate")
    served = {s.parent_span_id: s for s in rpcs(spans, "tokenmesh-worker", "tokenmesh.v1.Worker/Generate")}
    workers = generations(spans, "tokenmesh-worker")
    found = []
    for call in [c for c in calls if c.parent_span_id == generation.span_id]:
        above = call if linked else served[call.span_id]
        (generated,) = [w for w in workers if w.parent_span_id == above.span_id]
        found.append((call, generated))
    return found


async def test_one_trace_from_the_callers_traceparent_through_router_and_worker(receiver: Receiver) -> None:
    async with in_process_mesh() as mesh:
        mesh.backends[0].fail_after = 3  # a generation that starts there moves to the other worker
        metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
        finals = []
        for i in range(2):
            request = inference_pb2.GenerateRequest(prompt=f"{SECRET} {i}", max_tokens=6)
            finals.append([c async for c in mesh.inference.Generate(request, metadata=metadata)][-1])
        bad = (("traceparent", "00-not-a-trace-context"),)  # ignored: a new trace, never an error
        [
            c
            async for c in mesh.inference.Generate(
                inference_pb2.GenerateRequest(prompt="x", max_tokens=2), metadata=bad
            )
        ]
        # Traced, each generation opened its own worker calls: none was opened ahead of need.
        assert all(link.held(SPARE) is None for _, link in mesh.router.links.items())
        linked = bool(mesh.router.transports.sessions)  # the attempts ran on the workers' links
    spans = receiver.spans()
    routers = generations(spans, "tokenmesh-router")
    ours = [s for s in routers if s.trace_id.hex() == TRACE_ID]
    assert len(ours) == 2 and len(routers) == 3
    for span in ours:
        server = parent(spans, span)  # the router's RPC server span, child of the caller's span
        assert server.parent_span_id.hex() == PARENT_ID and server.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert server.name == "/tokenmesh.v1.Inference/Generate"
        rpc = attributes(server)
        assert rpc["rpc.system"] == "grpc" and rpc["rpc.service"] == "tokenmesh.v1.Inference"
        assert rpc["rpc.method"] == "Generate" and rpc["rpc.grpc.status_code"] == GRPC_OK
        assert rpc["network.peer.address"] == "127.0.0.1" and rpc["network.peer.port"] > 0
        assert span.kind == trace_pb2.Span.SPAN_KIND_INTERNAL
        a = attributes(span)
        assert span.name == "text_completion fake"
        assert a["gen_ai.request.model"] == "fake" and a["gen_ai.request.max_tokens"] == 6
        assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.response.id"] in {f.request_id for f in finals}
        assert "gen_ai.first_token" in [e.name for e in span.events]
        # Each attempt: a client span under the generation (a Worker/Generate call's RPC span, or on a link the
        # attempt's stream span), the worker's generation span under it, all in the caller's trace.
        attempts = worker_spans(spans, span, linked)
        assert attempts and all(c.kind == trace_pb2.Span.SPAN_KIND_CLIENT for c, _ in attempts)
        worker_ports = {w.host.port for w in mesh.workers}
        for call, generated in attempts:
            c = attributes(call)
            assert c["server.address"] == "127.0.0.1" and c["server.port"] in worker_ports
            assert c["rpc.service"] == "tokenmesh.v1.Worker" and c["rpc.method"] == ("Link" if linked else "Generate")
            if not linked:
                served = parent(spans, generated)  # the worker's RPC server span, between the call and generation
                assert served.kind == trace_pb2.Span.SPAN_KIND_SERVER and served.trace_id.hex() == TRACE_ID
            assert generated.name == "generate fake" and generated.trace_id.hex() == TRACE_ID
    moved = [s for s in ours if any(e.name == "tokenmesh.worker_failed" for e in s.events)]
    assert len(moved) == sum(1 for f in finals if f.migrations)
    for span in moved:  # the failed attempt's worker span says why, the other one ends normally
        event = next(e for e in span.events if e.name == "tokenmesh.worker_failed")
        assert {a.key: a.value.string_value for a in event.attributes}["tokenmesh.failure"] == "backend"
        statuses = sorted(w.status.code for _, w in worker_spans(spans, span, linked))
        assert statuses == [trace_pb2.Status.STATUS_CODE_UNSET, trace_pb2.Status.STATUS_CODE_ERROR]
    other = next(s for s in routers if s.trace_id.hex() != TRACE_ID)
    assert not parent(spans, other).parent_span_id  # the malformed traceparent started a trace of its own
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
        await mesh.router.inference.live.idle.wait()
    spans = receiver.spans()
    routers = generations(spans, "tokenmesh-router")
    assert len(routers) == 1  # the refused one never became a generation: no span, a status to the caller
    span = routers[0]
    assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert attributes(span)["tokenmesh.outcome"] == "caller_gone"
    # Its RPC span says what the caller got: the refused call INVALID_ARGUMENT, the abandoned one CANCELLED (not
    # OK, as the instrumentation alone records it); on a server neither is an error (semantic conventions).
    served = rpcs(spans, "tokenmesh-router", "tokenmesh.v1.Inference/Generate")
    codes = sorted(attributes(s)["rpc.grpc.status_code"] for s in served)
    assert codes == [GRPC_CANCELLED, GRPC_INVALID_ARGUMENT]
    assert parent(spans, span) is next(s for s in served if attributes(s)["rpc.grpc.status_code"] == GRPC_CANCELLED)


async def test_content_goes_into_spans_only_when_captured_and_then_redacted(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    async with in_process_mesh() as mesh:
        request = inference_pb2.GenerateRequest(prompt="mail alice@example.com about 4111 1111 1111 1111", max_tokens=4)
        [c async for c in mesh.inference.Generate(request)]
    (span,) = generations(receiver.spans(), "tokenmesh-router")
    events = {e.name: {a.key: a.value.string_value for a in e.attributes} for e in span.events}
    assert events["gen_ai.user.message"]["gen_ai.prompt"] == "mail <EMAIL> about <CARD>"
    assert events["gen_ai.choice"]["gen_ai.completion"] == "tok0 tok1 tok2 tok3 "
    assert b"alice@example.com" not in receiver.raw() and b"4111 1111" not in receiver.raw()


async def test_one_trace_from_the_http_callers_traceparent_through_gateway_router_and_worker(
    receiver: Receiver,
) -> None:
    import httpx

    from tests.support.dns_server import free_port_on
    from tests.support.gateway_helpers import gateway_over

    metrics_port = free_port_on("127.0.0.1")
    async with in_process_mesh() as mesh, gateway_over(mesh, metrics_port=metrics_port) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            answer = await http.post(
                "/completions",
                json={"prompt": f"{SECRET} x", "max_tokens": 3},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            )
            assert answer.status_code == 200
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    spans = receiver.spans()
    (edge,) = generations(spans, "tokenmesh-gateway")
    (router,) = generations(spans, "tokenmesh-router")
    (worker,) = generations(spans, "tokenmesh-worker")
    assert edge.trace_id.hex() == router.trace_id.hex() == worker.trace_id.hex() == TRACE_ID
    assert edge.parent_span_id.hex() == PARENT_ID  # the HTTP caller's span
    # gateway span -> (its stream's traceparent on the shared GenerateStream call) -> the router's generation span
    # -> ... -> worker's. The call itself is one client span of its own trace: it outlives every generation on it.
    (call,) = rpcs(spans, "tokenmesh-gateway", "tokenmesh.v1.Inference/GenerateStream")
    assert call.kind == trace_pb2.Span.SPAN_KIND_CLIENT and not call.parent_span_id
    assert attributes(call)["server.port"] == mesh.router.host.port
    assert router.parent_span_id == edge.span_id and router.kind == trace_pb2.Span.SPAN_KIND_SERVER
    attempt = parent(spans, worker)  # on a link, the attempt's stream span
    if attempt.name != STREAM_SPAN:  # a Worker/Generate call: the worker's RPC server span, under the call's
        attempt = parent(spans, attempt)
    assert attempt.parent_span_id == router.span_id
    assert edge.name == "text_completion default" and attributes(edge)["url.path"] == "/v1/completions"
    assert SECRET.encode() not in receiver.raw()
    assert 'tokenmesh_gateway_http_requests_total{route="/v1/completions",status="200"} 1.0' in metrics


async def test_a_stream_the_client_cancels_is_recorded_cancelled_on_both_sides(receiver: Receiver) -> None:
    from tokenmesh.tracing import Tracing, client_interceptors

    async with in_process_mesh(backend_settings={"delay": 0.05}) as mesh:
        tracing = Tracing("caller", enabled=True)
        address = mesh.router.host.address
        async with grpc.aio.insecure_channel(address, interceptors=client_interceptors(tracing, address)) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="x", max_tokens=500)
            )
            async for chunk in call:
                if chunk.seq == 2:
                    break
            call.cancel()
            await mesh.router.inference.live.idle.wait()
        await asyncio.to_thread(tracing.shutdown)  # exports over gRPC to the receiver on this loop
    spans = receiver.spans()
    (client,) = rpcs(spans, "tokenmesh-caller", "tokenmesh.v1.Inference/Generate")
    assert client.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    assert attributes(client)["rpc.grpc.status_code"] == GRPC_CANCELLED  # the instrumentation alone: 0, OK
    assert client.status.code == trace_pb2.Status.STATUS_CODE_ERROR and "CANCELLED" in client.status.message
    assert attributes(client)["server.address"] == "127.0.0.1"
    assert attributes(client)["server.port"] == mesh.router.host.port
    (server,) = rpcs(spans, "tokenmesh-router", "tokenmesh.v1.Inference/Generate")
    assert server.parent_span_id == client.span_id and server.trace_id == client.trace_id
    assert attributes(server)["rpc.grpc.status_code"] == GRPC_CANCELLED


async def test_with_tracing_off_no_server_or_channel_gets_an_interceptor(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpc.aio._interceptor import InterceptedCall

    from tokenmesh._rpc_spans import TracedChannel
    from tokenmesh.tls import open_channel
    from tokenmesh.tracing import Tracing, client_interceptors, server_interceptors

    servers: list[object] = []
    channels: list[object] = []
    real_server, real_channel = grpc.aio.server, grpc.aio.insecure_channel

    def server(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        servers.append(kwargs.get("interceptors"))
        return real_server(*args, **kwargs)

    def channel(*args: Any, **kwargs: Any) -> grpc.aio.Channel:
        channels.append(kwargs.get("interceptors"))
        return real_channel(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", server)
    monkeypatch.setattr(grpc.aio, "insecure_channel", channel)
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    async with in_process_mesh() as mesh:
        [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2))]
    off = Tracing("router", enabled=False)
    assert server_interceptors(off) == [] and client_interceptors(off, "127.0.0.1:1") == []
    # Three servers' main ports (two workers, the router): the error interceptor alone; the router's channels
    # to its workers (and the test's own) without any.
    mains = [s for s in servers if s]
    assert len(mains) == 3 and all(len(s) == 1 and isinstance(s[0], ErrorInterceptor) for s in mains)  # type: ignore
    assert channels and all(c is None for c in channels)
    on = Tracing("router", enabled=True)
    try:
        assert [type(i).__name__ for i in server_interceptors(on)] == ["ServerSpans"]
        assert len(client_interceptors(on, "127.0.0.1:1")) == 4  # one per call shape, for channels opened elsewhere
        # On, the mesh's channels are wrapped, still without a grpc.aio interceptor: their calls are plain calls.
        channel = open_channel("127.0.0.1:1", None, (), on)
        assert isinstance(channel, TracedChannel) and channels[-1] is None
        call = inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.GenerateRequest(prompt="x"))
        assert not isinstance(call, InterceptedCall)
        call.cancel()
        await channel.close()
    finally:
        on.shutdown()


def test_peer_and_server_addresses_are_split_as_the_semantic_conventions_name_them() -> None:
    from tokenmesh._rpc_spans import _peer_attributes, _server_attributes

    assert _peer_attributes("ipv4:127.0.0.1:5071") == {"network.peer.address": "127.0.0.1", "network.peer.port": 5071}
    assert _peer_attributes("ipv6:%5B::1%5D:443") == {"network.peer.address": "::1", "network.peer.port": 443}
    assert _peer_attributes("unix:/run/w.sock") == {"network.peer.address": "/run/w.sock", "network.transport": "unix"}
    assert _server_attributes("worker-0.tokenmesh:50051") == {
        "server.address": "worker-0.tokenmesh",
        "server.port": 50051,
    }
    assert _server_attributes("[::1]:50051") == {"server.address": "::1", "server.port": 50051}
    assert _server_attributes("dns:///router:50050") == {"server.address": "router", "server.port": 50050}


async def test_services_named_in_the_exclusion_variable_get_no_rpc_spans(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "grpc.health.v1.Health, tokenmesh.v1.Worker")
    async with in_process_mesh() as mesh:
        [c async for c in mesh.inference.Generate(inference_pb2.GenerateRequest(prompt="x", max_tokens=2))]
    names = {s.name for _, s in receiver.spans() if "rpc.system" in attributes(s)}
    assert names == {"/tokenmesh.v1.Inference/Generate"}  # the health watches and worker calls are left out
    assert len(generations(receiver.spans(), "tokenmesh-worker")) == 1  # its generation span is there all the same


async def test_an_untraced_router_passes_the_callers_context_on_and_keeps_its_spare_calls(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmesh.router import _service
    from tokenmesh.tracing import Tracing

    monkeypatch.setattr(_service, "Tracing", lambda service: Tracing(service, enabled=False))
    async with in_process_mesh() as mesh:
        metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
        for _ in range(2):
            [
                c
                async for c in mesh.inference.Generate(
                    inference_pb2.GenerateRequest(prompt="x", max_tokens=2), metadata=metadata
                )
            ]
        spares = [link.held(SPARE) for _, link in mesh.router.links.items()]
        linked = bool(mesh.router.transports.sessions)
    spans = receiver.spans()
    assert not [s for svc, s in spans if svc == "tokenmesh-router"]
    # The caller's context went in the start command (on a spare call): each worker generation span is its child.
    worker_spans = generations(spans, "tokenmesh-worker")
    assert len(worker_spans) == 2
    assert all(w.trace_id.hex() == TRACE_ID and w.parent_span_id.hex() == PARENT_ID for w in worker_spans)
    if linked:  # on the workers' links: no call per generation, none opened ahead
        assert not any(spares)
    else:
        assert any(spare is not None for spare in spares)  # untraced, the router keeps opening calls ahead of need


async def test_a_server_span_runs_no_code_per_message_and_ends_with_the_calls_outcome() -> None:
    import sys

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tokenmesh._rpc_spans import ServerSpans, _tracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    current: dict[bytes, int] = {}
    callers: set[str] = set()

    async def generate(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
        current[request] = trace.get_current_span().get_span_context().span_id
        for _ in range(2):
            frame = sys._getframe(1)  # who asks this generator for its next message, up to gRPC
            while frame is not None:
                callers.add(frame.f_code.co_filename)
                frame = frame.f_back
            yield b"m"
            if request == b"bug":
                raise RuntimeError("a handler's bug")
            if request == b"slow":
                await asyncio.sleep(5)

    handler = grpc.unary_stream_rpc_method_handler(generate)
    server = grpc.aio.server(interceptors=[ServerSpans(_tracer(provider)), ErrorInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"Generate": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call: Any = channel.unary_stream("/t.S/Generate")
            assert [m async for m in call(b"ok")] == [b"m", b"m"]
            for request, code in ((b"bug", grpc.StatusCode.UNKNOWN), (b"slow", grpc.StatusCode.DEADLINE_EXCEEDED)):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    [m async for m in call(request, timeout=0.5)]
                assert raised.value.code() == code
            for _ in range(50):  # the slow call's span ends once its task is cancelled
                if len(exporter.get_finished_spans()) == 3:
                    break
                await asyncio.sleep(0.1)
    finally:
        await server.stop(None)
    # Between gRPC and the handler: the error interceptor's generator only, no span code on a message's way.
    assert not [f for f in callers if f.endswith("_rpc_spans.py")], callers
    spans = {span.context.span_id: span for span in exporter.get_finished_spans()}
    ok, bug, slow = (spans[current[request]] for request in (b"ok", b"bug", b"slow"))  # each current in its handler
    assert ok.kind == trace.SpanKind.SERVER and ok.name == "/t.S/Generate"
    assert ok.attributes is not None and ok.attributes["rpc.service"] == "t.S"
    assert ok.attributes["rpc.grpc.status_code"] == 0 and ok.attributes["network.peer.address"] == "127.0.0.1"
    assert bug.attributes is not None and bug.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]
    assert bug.status.status_code == trace.StatusCode.ERROR and "RuntimeError" in (bug.status.description or "")
    assert "a handler's bug" not in (bug.status.description or "")  # the type only: a message may quote a request
    assert slow.attributes is not None and slow.attributes["rpc.grpc.status_code"] == 4  # DEADLINE_EXCEEDED
    provider.shutdown()


async def test_each_generate_stream_stream_is_traced_in_its_own_commands_trace(receiver: Receiver) -> None:
    """A stream's generation span takes its command's traceparent (else the call's), never the call's RPC span."""
    own_trace = "0af7651916cd43dd8448eb211c80319c"
    async with in_process_mesh() as mesh:
        call = mesh.inference.GenerateStream(metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),))
        assert (await call.read()).HasField("settings")
        own = inference_pb2.StreamCommand(stream=1, generate=inference_pb2.GenerateRequest(prompt="a", max_tokens=3))
        own.metadata["traceparent"] = f"00-{own_trace}-{PARENT_ID}-01"
        inherited = inference_pb2.StreamCommand(
            stream=2, generate=inference_pb2.GenerateRequest(prompt="b", max_tokens=3)
        )
        await call.write(inference_pb2.StreamCommands(commands=[own, inherited]))
        await call.done_writing()
        request_ids = {}
        while (message := await call.read()) is not grpc.aio.EOF:
            request_ids.update(zip(message.chunk_stream, (c.request_id for c in message.chunks), strict=True))
    spans = receiver.spans()
    routers = {attributes(s)["gen_ai.response.id"]: s for s in generations(spans, "tokenmesh-router")}
    for stream, trace_id in ((1, own_trace), (2, TRACE_ID)):
        span = routers[request_ids[stream]]
        assert span.trace_id.hex() == trace_id
        # The caller's span is its parent: not the GenerateStream call's RPC span, which may live for hours.
        assert span.parent_span_id.hex() == PARENT_ID and span.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert any(w.trace_id.hex() == trace_id for w in generations(spans, "tokenmesh-worker"))
    (server,) = rpcs(spans, "tokenmesh-router", "tokenmesh.v1.Inference/GenerateStream")
    assert server.trace_id.hex() == TRACE_ID and attributes(server)["rpc.grpc.status_code"] == GRPC_OK
