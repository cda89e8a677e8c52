"""The wire contract: generated code is fresh, every RPC is implemented, names match ARCHITECTURE.md."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from tokenmesh.router import ControlServicer, InferenceServicer, RouterServicer
from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2
from tokenmesh.worker import WorkerServicer

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_protos() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_every_rpc_has_a_handler() -> None:
    implementations = {
        "Inference": InferenceServicer,
        "Router": RouterServicer,
        "Control": ControlServicer,
        "Worker": WorkerServicer,
    }
    for module in (inference_pb2, router_pb2, worker_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            cls = implementations[service.name]
            for method in service.methods:
                handler = getattr(cls, method.name)
                # The generated base raises UNIMPLEMENTED; ours must override it.
                assert handler.__qualname__.startswith(cls.__name__), f"{service.name}.{method.name}"
                assert inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler)


def test_public_names_from_the_contract() -> None:
    inference = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert {m.name for m in inference.methods} == {"Generate", "Resume", "Cancel", "ListModels", "GenerateStream"}
    assert inference.methods_by_name["Generate"].server_streaming
    assert inference.methods_by_name["Resume"].server_streaming
    batched = inference.methods_by_name["GenerateStream"]  # the batched call beside them (architecture.md)
    assert batched.client_streaming and batched.server_streaming
    request_fields = set(inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "priority",
        "request_id",
        "labels",
    } <= request_fields
    chunk_fields = set(inference_pb2.GenerateChunk.DESCRIPTOR.fields_by_name)
    assert {"request_id", "seq", "text", "token_count", "finish_reason", "usage"} <= chunk_fields
    assert set(inference_pb2.Priority.keys()) == {
        "PRIORITY_UNSPECIFIED",
        "PRIORITY_LOW",
        "PRIORITY_NORMAL",
        "PRIORITY_HIGH",
    }
    assert {"FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_CANCELLED", "FINISH_REASON_ERROR"} <= set(
        inference_pb2.FinishReason.keys()
    )
    entry = set(router_pb2.RoutingEntry.DESCRIPTOR.fields_by_name)
    assert {"address", "weight", "state", "in_flight", "served_total"} <= entry
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name
    assert worker["Generate"].client_streaming and worker["Generate"].server_streaming
    control = router_pb2.DESCRIPTOR.services_by_name["Control"].methods_by_name["PushWeights"]
    assert control.client_streaming and control.server_streaming
