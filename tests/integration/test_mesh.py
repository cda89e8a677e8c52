"""The embedded mesh end to end: real Triton, SmolLM2, workers, prober and router."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import jsonschema
import psutil
import pytest

from tests.support.processes import cpu_seconds, descendants
from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from .conftest import MeshHandle, grpcurl, json_stream

pytestmark = pytest.mark.integration

FRANCE = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}


def generate(handle: MeshHandle, timeout: float = 120, **fields) -> list[inference_pb2.GenerateChunk]:
    return list(handle.inference.Generate(inference_pb2.GenerateRequest(**fields), timeout=timeout))


def test_grpcurl_lists_every_service(mesh: MeshHandle) -> None:
    result = grpcurl(mesh.address, "list")
    assert result.returncode == 0, result.stderr
    services = set(result.stdout.split())
    assert {
        "tokenmesh.v1.Inference",
        "tokenmesh.v1.Router",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    described = grpcurl(mesh.address, "describe", "tokenmesh.v1.Inference.Generate")
    assert "returns ( stream .tokenmesh.v1.GenerateChunk )" in described.stdout, described.stderr


def test_grpcurl_generate_streams_paris_with_seq_and_final_chunk(mesh: MeshHandle) -> None:
    result = grpcurl("-d", json.dumps(FRANCE), mesh.address, "tokenmesh.v1.Inference/Generate")
    assert result.returncode == 0, result.stderr
    chunks = json_stream(result.stdout)
    assert [int(c["seq"]) for c in chunks] == list(range(1, len(chunks) + 1))
    assert len(chunks) >= 3
    assert "Paris" in "".join(c.get("text", "") for c in chunks)
    assert all("finish_reason" not in c for c in chunks[:-1])
    final = chunks[-1]
    assert final["finish_reason"] == "FINISH_REASON_STOP"
    assert final["usage"]["prompt_tokens"] > 0
    assert final["usage"]["completion_tokens"] == sum(c.get("token_count", 0) for c in chunks)
    # Where the first token's time went: the engine's part inside the router's, both measured.
    timing = final["timing"]
    assert 0 < timing["engine_ttft_ms"] < timing["router_ttft_ms"] and timing["queue_ms"] >= 0
    assert all("timing" not in c for c in chunks[:-1])


def test_eight_sequential_generations_use_both_workers(mesh: MeshHandle) -> None:
    before = {w.address: w.served_total for w in mesh.table().workers}
    for i in range(8):
        chunks = generate(mesh, prompt=f"Count to {i}:", max_tokens=4, seed=i)
        assert chunks[-1].finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
    after = {w.address: w.served_total for w in mesh.table().workers}
    served = [after[a] - before[a] for a in after]
    assert sum(served) == 8
    assert min(served) >= 2, served


def wait_idle(mesh: MeshHandle, timeout: float = 5) -> None:
    """Until the prober reports every worker SERVING with all slots free (weight 1)."""
    deadline = time.monotonic() + timeout
    while not all(w.weight == 1.0 and w.state == router_pb2.WORKER_STATE_SERVING for w in mesh.table().workers):
        assert time.monotonic() < deadline, mesh.table()
        time.sleep(0.05)


def test_bad_input_is_refused_precisely_while_a_stream_runs(mesh: MeshHandle) -> None:
    wait_idle(mesh)
    long_result: list[inference_pb2.GenerateChunk] = []
    long_call = mesh.inference.Generate(
        inference_pb2.GenerateRequest(
            prompt="Write a long story about a dragon.", max_tokens=300, ignore_eos=True, request_id="live-1"
        ),
        timeout=120,
    )
    long_stream = threading.Thread(target=lambda: long_result.extend(long_call))
    long_stream.start()
    deadline = time.monotonic() + 30
    while "live-1" not in {c.request_id for c in long_result} and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until it streams (and so is live)
    cases = [
        ({"prompt": "x", "request_id": "live-1"}, grpc.StatusCode.ALREADY_EXISTS, "live already"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "set prompt, or messages"),
        ({"prompt": "x", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be 1.."),
        ({"prompt": "x", "max_tokens": 100_000}, grpc.StatusCode.INVALID_ARGUMENT, "context size"),
        ({"prompt": "x", "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0"),
        ({"prompt": "x", "model": "gpt-17"}, grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-17'"),
        ({"prompt": "x" * (1024 * 1024 + 10)}, grpc.StatusCode.INVALID_ARGUMENT, "limit is 1048576 bytes"),
        # Longer than the model's context: refused by llama.cpp, classified as a caller error.
        ({"prompt": "word " * 3000, "max_tokens": 8}, grpc.StatusCode.INVALID_ARGUMENT, "context size"),
    ]
    for fields, code, needle in cases:
        with pytest.raises(grpc.RpcError) as info:
            generate(mesh, **fields)
            pytest.fail(f"no error for {list(fields)}")
        assert info.value.code() == code, (list(fields), info.value.details())
        assert needle in info.value.details()
    long_stream.join(120)
    assert [c.seq for c in long_result] == list(range(1, len(long_result) + 1))
    assert long_result[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert long_result[-1].usage.completion_tokens == 300
    # Caller errors never count against a worker: once the long stream is done
    # every worker is back to full weight (in-flight load moves weights meanwhile).
    wait_idle(mesh, timeout=3)


def test_engines_run_niced_below_the_relays(mesh: MeshHandle) -> None:
    def nice(pid: int) -> int:
        return psutil.Process(pid).nice()

    for worker in mesh.mesh.workers:
        triton_tree = descendants(int(worker.info["triton_pid"]))
        assert len(triton_tree) >= 2  # tritonserver and its model's Python stub (llama.cpp runs there)
        assert [nice(pid) for pid in triton_tree] == [19] * len(triton_tree)
        assert nice(worker.proc.pid) == 0
    assert mesh.mesh.router is not None and nice(mesh.mesh.router.proc.pid) == 0


def test_caller_cancel_stops_the_triton_request(mesh: MeshHandle) -> None:
    call = mesh.inference.Generate(
        inference_pb2.GenerateRequest(prompt="Tell me a very long story.", max_tokens=1500, ignore_eos=True),
        timeout=120,
    )
    first = next(call)
    table = mesh.table()
    busy = [w for w in table.workers if w.in_flight == 1]
    assert len(busy) == 1 and first.seq == 1
    worker = next(w for w in mesh.mesh.workers if w.address == busy[0].address)
    triton_tree = descendants(int(worker.info["triton_pid"]))
    call.cancel()

    def worker_in_flight() -> int:
        with grpc.insecure_channel(worker.address) as channel:
            ping = iter([worker_pb2.StatsPing(ping_id=1)])
            return int(next(worker_pb2_grpc.WorkerStub(channel).Stats(ping, timeout=5)).in_flight)

    # The generation settles on the worker only once Triton ended its stream: the cancel has
    # travelled router -> worker -> Triton -> model. Then the model must be idle.
    deadline = time.monotonic() + 10
    while worker_in_flight() != 0:
        assert time.monotonic() < deadline, "the worker still runs the cancelled generation after 10 s"
        time.sleep(0.05)
    used_before = cpu_seconds(triton_tree)
    time.sleep(2.0)
    idle_share = (cpu_seconds(triton_tree) - used_before) / 2.0
    # A slot still generating would keep about a core busy for ~10 more seconds.
    assert idle_share < 0.25, f"Triton still busy after cancel: {idle_share:.2f} cores"
    assert all(w.in_flight == 0 for w in mesh.table().workers)
    with grpc.insecure_channel(worker.address) as channel:
        stats = next(worker_pb2_grpc.WorkerStub(channel).Stats(iter([worker_pb2.StatsPing(ping_id=1)]), timeout=5))
    assert stats.in_flight == 0
    # Triton's own figures: nothing waits in its scheduler queue (metrics endpoint);
    # the requests that ran spent a measured time in it (statistics API).
    assert stats.HasField("triton_pending") and stats.triton_pending == 0
    assert stats.HasField("triton_queue_ms") and stats.triton_queue_ms >= 0


def test_cli_generate_status_and_models(mesh: MeshHandle) -> None:
    cli = [sys.executable, "-m", "tokenmesh"]
    out = subprocess.run(
        [*cli, "generate", "--chat", "What is the capital of France?", "--temperature", "0", "--addr", mesh.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "FINISH_REASON_STOP" in out.stderr
    status = subprocess.run([*cli, "status", "--addr", mesh.address], capture_output=True, text=True, timeout=30)
    assert status.returncode == 0 and status.stdout.count("SERVING") == 2, status.stdout
    models = subprocess.run([*cli, "models", "--addr", mesh.address], capture_output=True, text=True, timeout=30)
    assert "smollm2 (default)" in models.stdout
    bad = subprocess.run([*cli, "generate", "", "--addr", mesh.address], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "Traceback" not in bad.stderr


def test_worker_over_an_existing_triton(mesh: MeshHandle) -> None:
    """The Kubernetes sidecar case: a worker given --triton-url starts no Triton of its own."""
    triton_url = str(mesh.mesh.workers[0].info["triton_url"])
    child = mesh.mesh.spawn("sidecar-worker", "worker", "--port", "0", "--triton-url", triton_url)
    try:
        mesh.mesh.wait_ready([child])
        assert child.info["triton_pid"] is None and child.info["triton_url"] == triton_url
        with grpc.insecure_channel(child.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            described = stub.Describe(worker_pb2.DescribeRequest(), timeout=5)
            assert [m.name for m in described.models] == ["smollm2"]
            start = worker_pb2.WorkerCommand(
                start=inference_pb2.GenerateRequest(prompt="Hello", max_tokens=3, request_id="sidecar-1")
            )
            events = list(stub.Generate(iter([start]), timeout=60))
        assert events[-1].WhichOneof("event") == "end"
        assert events[-1].end.usage.completion_tokens == 3
        assert all(e.WhichOneof("event") == "chunk" for e in events[:-1])
    finally:
        child.proc.terminate()
        child.proc.wait(30)


FRUIT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "color": {"enum": ["red", "green", "yellow"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "color", "tags"],
    "additionalProperties": False,
}


def test_a_json_schema_output_validates_at_every_seed_streamed(mesh: MeshHandle) -> None:
    schema_format = inference_pb2.StructuredOutput(json_schema=json.dumps(FRUIT))
    for seed in range(6):
        chunks = generate(
            mesh,
            messages=[{"role": "user", "content": "Describe a fruit as JSON."}],
            max_tokens=160,
            seed=seed,
            temperature=1.0,
            structured_output=schema_format,
        )
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_STOP, (seed, chunks[-1])
        jsonschema.validate(json.loads("".join(c.text for c in chunks)), FRUIT)


def test_a_choice_and_a_grammar_hold_and_logit_bias_bans_a_token(mesh: MeshHandle) -> None:
    options = ["Paris", "Lyon", "Marseille"]
    for seed in range(3):
        chunks = generate(
            mesh,
            prompt="The capital of France is",
            max_tokens=16,
            seed=seed,
            structured_output=inference_pb2.StructuredOutput(choice=inference_pb2.Choice(options=options)),
        )
        assert "".join(c.text for c in chunks) in options
    yes_no = inference_pb2.StructuredOutput(grammar='root ::= "yes" | "no"')
    assert "".join(
        c.text for c in generate(mesh, prompt="Is Paris in France?", max_tokens=4, structured_output=yes_no)
    ) in (
        "yes",
        "no",
    )
    plain = "".join(c.text for c in generate(mesh, prompt="The capital of France is", max_tokens=4, temperature=0))
    assert plain.startswith(" Paris"), plain
    paris = 7042  # SmolLM2's token " Paris"
    for seed in range(5):
        text = "".join(
            c.text
            for c in generate(
                mesh,
                prompt="The capital of France is",
                max_tokens=4,
                seed=seed,
                temperature=0,
                logit_bias={paris: -100},
            )
        )
        assert not text.startswith(" Paris"), (seed, text)


def test_a_format_the_engine_cannot_compile_is_the_callers_error_and_blames_no_worker(mesh: MeshHandle) -> None:
    wait_idle(mesh)
    with pytest.raises(grpc.RpcError) as refused:
        generate(mesh, prompt="x", structured_output=inference_pb2.StructuredOutput(json_schema='{"type": "nonsense"}'))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.json_schema is not a valid JSON Schema" in refused.value.details()
    with pytest.raises(grpc.RpcError) as engine:  # passes the router's check; llama.cpp cannot parse it
        generate(mesh, prompt="x", structured_output=inference_pb2.StructuredOutput(grammar='root ::= ( "a" '))
    assert engine.value.code() == grpc.StatusCode.INVALID_ARGUMENT, engine.value.details()
    assert "failed to parse grammar" in engine.value.details()
    wait_idle(mesh, timeout=3)  # a caller's error: no worker lost weight


def test_logprobs_one_per_token_with_sorted_alternatives_across_coalesced_chunks(mesh: MeshHandle) -> None:
    for request in (
        {"prompt": "The capital of France is", "max_tokens": 12, "seed": 1},
        {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12, "seed": 2},
    ):
        chunks = generate(mesh, logprobs=True, top_logprobs=3, ignore_eos=True, **request)
        entries = [entry for c in chunks for entry in c.logprobs]
        assert len(entries) == chunks[-1].usage.completion_tokens == 12, [len(c.logprobs) for c in chunks]
        for c in chunks:
            assert len(c.logprobs) == c.token_count or c.finish_reason  # aligned with each chunk's tokens
        assert "".join(e.token for e in entries) == "".join(c.text for c in chunks)
        for entry in entries:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            alternatives = [a.logprob for a in entry.top_logprobs]
            assert alternatives == sorted(alternatives, reverse=True) and all(v <= 0 for v in alternatives)
            assert entry.logprob <= alternatives[0] + 1e-6  # nothing more likely than the most likely
    plain = generate(mesh, prompt="The capital of France is", max_tokens=4)
    assert not any(c.logprobs for c in plain)
    with pytest.raises(grpc.RpcError) as refused:
        generate(mesh, prompt="x", logprobs=True, top_logprobs=21)
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "top_logprobs must be 0..20" in refused.value.details()
    )
