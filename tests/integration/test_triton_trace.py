"""Triton's own spans join the trace: worker span -> Triton's InferRequest (real Triton, synthetic model)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.otlp_receiver import Receiver
from tokenmesh.router import Router, RouterConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class TritonSpans(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP (JSON, as Triton sends it): (name, trace id, span id, parent span id) of each span."""

    spans: list[tuple[str, str, str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        for resource in json.loads(body).get("resourceSpans", []):
            for scope in resource.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    self.spans.append((span["name"], span["traceId"], span["spanId"], span.get("parentSpanId", "")))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def triton_receiver() -> Iterator[str]:
    TritonSpans.spans = []
    server = http.server.HTTPServer(("127.0.0.1", 0), TritonSpans)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()


async def exported(trace_id: str, within_s: float) -> None:
    """Until Triton exported the request's root span (it exports in batches, that span last), or within_s passed."""
    for _ in range(int(within_s * 10)):
        if any(name == "InferRequest" and trace == trace_id for name, trace, _, _ in TritonSpans.spans):
            return
        await asyncio.sleep(0.1)


async def test_tritons_spans_are_children_of_the_workers(
    tmp_path: Path, triton_receiver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", await receiver.start())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    worker = Worker(
        WorkerConfig(
            port=0,
            work_dir=str(tmp_path / "worker"),
            drain_grace_s=1,
            model_repository=str(SHIPPED_REPOSITORIES["synthetic"]),
            triton_trace_url=triton_receiver,
        )
    )
    router: Router | None = None
    try:
        await worker.start()
        router = Router(RouterConfig(port=0, workers=(worker.host.address,), drain_grace_s=1))
        await router.start()
        async with grpc.aio.insecure_channel(router.host.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(prompt="trace me", max_tokens=5)
            for _ in range(100):  # until the router sees the worker
                try:
                    chunks = [
                        c
                        async for c in stub.Generate(
                            request, metadata=(("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
                        )
                    ]
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        # Triton's batch exporter sends on its own schedule: wait while it still runs, since a Triton that a loaded
        # machine makes slow to stop may be killed before it flushes at exit.
        await exported(TRACE_ID, within_s=20)
    finally:
        if router is not None:
            await router.shutdown()
        await worker.shutdown()  # stops its Triton, which exports what its batches still hold
        await receiver.stop()
    await exported(TRACE_ID, within_s=15)
    ours = [s for service, s in receiver.spans() if service == "tokenmesh-worker"]
    # The worker's generation span (its RPC server span, /tokenmesh.v1.Worker/Generate, is in the trace too).
    worker_span = next(s for s in ours if s.trace_id.hex() == TRACE_ID and s.name.startswith("generate "))
    infer = [s for s in TritonSpans.spans if s[0] == "InferRequest" and s[1] == TRACE_ID]
    assert infer, TritonSpans.spans
    assert infer[0][3] == worker_span.span_id.hex()  # Triton's request span is the worker span's child
    names = {name for name, trace, _, _ in TritonSpans.spans if trace == TRACE_ID}
    assert {"InferRequest", "compute"} <= names
