"""--log-format json: one object per line, with the generation's request_id, trace_id and span_id."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from tests.support.mesh import in_process_mesh
from tokenmesh.logs import CallContext, JsonFormatter
from tokenmesh.v1 import inference_pb2, worker_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


async def test_a_generations_log_lines_carry_its_ids_and_no_prompt() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(CallContext())
    handler.setFormatter(JsonFormatter())
    logging.getLogger("tokenmesh").addHandler(handler)
    try:
        async with in_process_mesh(stall_timeout_s=0.2) as mesh:  # failed workers are avoided 0.2 s, not 5
            provider = TracerProvider()  # spans whose ids the lines carry; nothing exported
            mesh.router.inference.tracer = provider.get_tracer("test")
            for backend in mesh.backends:  # the first attempt fails: a warning about it on both sides
                backend.fault_once = (worker_pb2.ERROR_CLASS_BACKEND, "Stub process is not healthy")
            request = inference_pb2.GenerateRequest(prompt="the secret prompt", max_tokens=6, request_id="rid-1")
            metadata = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
            chunks = [c async for c in mesh.inference.Generate(request, metadata=metadata)]
            assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    finally:
        logging.getLogger("tokenmesh").removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    about = [line for line in lines if line.get("request_id") == "rid-1"]
    assert any(line["logger"] == "tokenmesh.router._inference" for line in about), lines
    assert any(line["logger"].startswith("tokenmesh.worker") for line in about), lines
    router_lines = [line for line in about if line["logger"].startswith("tokenmesh.router")]
    assert router_lines and all(line["trace_id"] == TRACE_ID and len(line["span_id"]) == 16 for line in router_lines)
    assert all(set(line) >= {"time", "level", "logger", "pid", "message"} for line in lines)
    assert "the secret prompt" not in stream.getvalue()
    assert not [line for line in lines if "request_id" in line and line["request_id"] != "rid-1"]
