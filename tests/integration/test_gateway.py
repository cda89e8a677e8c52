"""The HTTP gateway against the real mesh: the openai SDK and SmolLM2, resume, disconnects, a router killed.

SmolLM2 (``tokenmesh up``'s mesh with its gateway) for the SDK and for
drops; the synthetic engine, with every service started one by one as
Kubernetes runs them, for the router killed mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from tests.support.gateway_helpers import events, text_after, text_of
from tokenmesh.client import Client
from tokenmesh.mesh import Child, Mesh, MeshConfig
from tokenmesh.process import stop_process
from tokenmesh.v1 import inference_pb2, router_pb2, router_pb2_grpc
from tokenmesh.worker.triton import SHIPPED_REPOSITORIES

from .conftest import MeshHandle, left_behind, mesh_pids, running_mesh, wait_all_serving

pytestmark = pytest.mark.integration

FRANCE = "What is the capital of France?"
# SmolLM2's chat template (ChatML, no default system prompt), rendered by hand for /v1/completions.
FRANCE_PROMPT = f"<|im_start|>user\n{FRANCE}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHandle]:
    with running_mesh(tmp_path_factory.mktemp("gateway-mesh"), gateway_port=0) as handle:
        yield handle


def url_of(mesh: MeshHandle) -> str:
    assert mesh.mesh.gateway is not None
    return str(mesh.mesh.gateway.info["url"])


def in_flight(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        table = router_pb2_grpc.RouterStub(channel).GetRoutingTable(router_pb2.GetRoutingTableRequest(), timeout=5)
    return sum(w.in_flight for w in table.workers)


def test_the_openai_sdk_streams_paris_through_the_gateway(mesh: MeshHandle) -> None:
    client = openai.OpenAI(base_url=url_of(mesh), api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": FRANCE}],
            temperature=0,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0

    parts = list(
        client.completions.create(
            model="smollm2",
            prompt=FRANCE_PROMPT,
            temperature=0,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "Paris" in "".join(p.choices[0].text for p in parts if p.choices)
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens > 0

    whole = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=48
    )
    assert "Paris" in (whole.choices[0].message.content or "") and whole.usage is not None
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"] and models.data[0].model_extra["max_model_len"] > 0
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="smollm2", prompt="hi", max_tokens=10**6)
    assert too_long.value.param == "max_tokens"


def test_the_anthropic_sdk_streams_paris_with_usage_through_the_gateway(mesh: MeshHandle) -> None:
    client = anthropic.Anthropic(base_url=url_of(mesh).removesuffix("/v1"), api_key="x", max_retries=0)
    question = [{"role": "user", "content": FRANCE}]
    with client.messages.stream(
        model="smollm2", max_tokens=48, messages=question, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text
    assert [(block.type, getattr(block, "text", None)) for block in final.content] == [("text", text)]
    assert final.stop_reason == "end_turn" and final.stop_sequence is None
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0

    whole = client.messages.create(model="smollm2", max_tokens=48, messages=question, extra_body={"temperature": 0})
    assert [block.type for block in whole.content] == ["text"] and "Paris" in getattr(whole.content[0], "text", "")
    assert whole.stop_reason == "end_turn" and whole.id.startswith("msg_")

    # The same prompt: the same count, of which llama.cpp now reads more from its cache (Anthropic's input_tokens
    # are the tokens read from no cache).
    def prompt_of(usage: anthropic.types.Usage) -> int:
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert prompt_of(whole.usage) == prompt_of(final.usage) and whole.usage.output_tokens > 0


def long_prompt(tag: str) -> str:
    """About 250 tokens (1,100+ characters) starting with tag: a prompt no earlier request shares a prefix with.

    Long enough for the router's prefix rule to send it to the same worker each time (a raw prompt of 1,024+
    characters; a chat's system prompt of 256+), whose llama.cpp slot still holds it the second time.
    """
    return f"{tag} " + " ".join(["The history of the world is long and full of stories about people and places."] * 14)


def test_a_repeated_long_prompt_reports_its_cached_tokens_the_second_time_through_grpc(mesh: MeshHandle) -> None:
    request = inference_pb2.GenerateRequest(
        model="smollm2", prompt=long_prompt(f"grpc-{uuid.uuid4().hex}"), max_tokens=2, temperature=0
    )
    first, second = (list(mesh.inference.Generate(request, timeout=60))[-1].usage for _ in range(2))
    assert first.prompt_tokens == second.prompt_tokens > 200
    assert first.cached_prompt_tokens == 0
    # All of it but what llama.cpp computes again to start generating (the prompt's last token).
    assert second.prompt_tokens - 2 <= second.cached_prompt_tokens < second.prompt_tokens


def test_the_openai_sdk_reads_cached_tokens_in_prompt_tokens_details(mesh: MeshHandle) -> None:
    client = openai.OpenAI(base_url=url_of(mesh), api_key="x", max_retries=0)
    prompt = long_prompt(f"completion-{uuid.uuid4().hex}")
    first, second = (
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, temperature=0).usage for _ in range(2)
    )
    assert first is not None and first.prompt_tokens_details is not None
    assert second is not None and second.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens - 2 <= (second.prompt_tokens_details.cached_tokens or 0) < second.prompt_tokens

    # Streamed chat: the usage event carries it. A chat's first tokens are the template's own
    # ("<|im_start|>system"...), which an earlier chat may have left in the slot: a few, never the whole prompt.
    messages: list[Any] = [
        {"role": "system", "content": long_prompt(f"chat-{uuid.uuid4().hex}")},
        {"role": "user", "content": "Summarize."},
    ]
    cached = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [c for c in stream][-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append((usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
    (first_chat, prompt_tokens), (second_chat, _) = cached
    assert first_chat is not None and second_chat is not None
    assert first_chat < 10 and prompt_tokens - 2 <= second_chat < prompt_tokens


def test_the_anthropic_sdk_reads_cached_tokens_in_cache_read_input_tokens(mesh: MeshHandle) -> None:
    client = anthropic.Anthropic(base_url=url_of(mesh).removesuffix("/v1"), api_key="x", max_retries=0)
    system = long_prompt(f"messages-{uuid.uuid4().hex}")
    question: list[Any] = [{"role": "user", "content": "Summarize."}]
    usages = []
    for _ in range(2):
        with client.messages.stream(model="smollm2", max_tokens=2, system=system, messages=question) as stream:
            usages.append(stream.get_final_message().usage)
    first, second = usages
    assert first.cache_read_input_tokens is not None and second.cache_read_input_tokens is not None
    # Anthropic's input_tokens are the tokens read from no cache: the two parts add up to the same prompt.
    prompt = first.input_tokens + first.cache_read_input_tokens
    assert second.input_tokens + second.cache_read_input_tokens == prompt > 200
    assert first.cache_read_input_tokens < 10 and 1 <= second.input_tokens <= 2


def test_a_dropped_resumable_stream_continues_with_last_event_id(mesh: MeshHandle) -> None:
    url = url_of(mesh)
    body = {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 120,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/completions", json=body, headers={"X-Request-Id": "drop-1"}) as response:
            raw = b""
            for piece in response.iter_raw():
                raw += piece
                if raw.count(b"\nid: ") >= 8:
                    break
        # The connection is closed here, mid-stream; what the caller holds whole ends at the last blank line.
        held = raw[: raw.rindex(b"\n\n") + 2]
        last_id = [e["id"] for e in events(held) if "id" in e][-1]
        rest = http.get("/completions/drop-1/stream", headers={"Last-Event-ID": last_id})
        assert rest.status_code == 200 and rest.content.endswith(b"data: [DONE]\n\n")
        whole = http.get("/completions/drop-1/stream")  # the whole generation, replayed from the worker
    seq = int(last_id.rpartition(":")[2])
    assert text_of(rest.content) == text_after(whole.content, seq)
    assert text_of(held) + text_of(rest.content) == text_of(whole.content)
    assert [e["id"] for e in events(rest.content) if "id" in e][0] == f"drop-1:{seq + 1}"


def test_a_dropped_stream_without_request_id_frees_the_engine_slot_within_a_second(mesh: MeshHandle) -> None:
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url_of(mesh), timeout=60) as http:
        with http.stream("POST", "/completions", json=body) as response:
            pieces = response.iter_raw()  # one iterator, kept: closing it would close the connection
            raw = b""
            while raw.count(b"\nid: ") < 3:
                raw += next(pieces)
            assert in_flight(mesh.address) == 1
            dropped = time.monotonic()
    while in_flight(mesh.address) and time.monotonic() - dropped < 5:
        time.sleep(0.02)
    assert in_flight(mesh.address) == 0
    assert time.monotonic() - dropped < 1


# -- a router killed under a gateway stream (services one by one, synthetic engine) ----------------------


def spawn_mesh(mesh: Mesh, routers: list[Child], tmp_path: Path) -> None:
    """2 synthetic workers, 3 routers, a prober over all, a gateway over the first two; all SERVING."""
    for i in range(2):
        mesh.workers.append(
            mesh.spawn(
                f"worker-{i}",
                "worker",
                "--port",
                "0",
                "--work-dir",
                str(tmp_path / f"worker-{i}"),
                "--model-repository",
                str(SHIPPED_REPOSITORIES["synthetic"]),
            )
        )
    mesh.wait_ready(mesh.workers)
    workers = ",".join(w.address for w in mesh.workers)
    routers += [mesh.spawn(f"router-{i}", "router", "--port", "0", "--workers", workers) for i in range(3)]
    mesh.wait_ready(routers)
    mesh.prober = mesh.spawn(
        "prober", "prober", "--port", "0", "--workers", workers, "--routers", ",".join(r.address for r in routers)
    )
    mesh.gateway = mesh.spawn(
        "gateway", "gateway", "--port", "0", "--routers", f"{routers[0].address},{routers[1].address}"
    )
    mesh.wait_ready([mesh.prober, mesh.gateway])
    for router in routers:
        with grpc.insecure_channel(router.address) as channel:
            wait_all_serving(channel, 2)


def the_router_streaming(routers: list[Child]) -> Child:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        busy = [r for r in routers if r.proc.poll() is None and in_flight(r.address) > 0]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no single router holds the stream")


def synthetic_text(count: int) -> str:
    return "".join(f" t{i}" for i in range(count))


def test_a_router_killed_mid_stream_is_invisible_to_http_and_grpc_callers(tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(port=0, log_dir=str(tmp_path / "logs")))
    routers: list[Child] = []
    pids: list[int] = []
    try:
        spawn_mesh(mesh, routers, tmp_path)
        pids = mesh_pids(mesh) + [r.proc.pid for r in routers]
        assert mesh.gateway is not None
        tokens = 3000  # 3 s at the synthetic engine's 1,000 tokens/s
        body = {"prompt": "long", "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
        killed: list[Child] = []
        with httpx.Client(base_url=str(mesh.gateway.info["url"]), timeout=60) as http:
            with http.stream("POST", "/completions", json=body) as response:
                assert response.status_code == 200
                raw = b""
                for piece in response.iter_raw():
                    raw += piece
                    if not killed and raw.count(b"\nid: ") >= 20:
                        victim = the_router_streaming(routers[:2])
                        os.kill(victim.proc.pid, signal.SIGKILL)
                        killed.append(victim)
        assert killed, "the stream ended before a router could be killed"
        assert b'"error"' not in raw and raw.endswith(b"data: [DONE]\n\n")
        assert text_of(raw) == synthetic_text(tokens)  # every token exactly once, in order
        seqs = [int(e["id"].rpartition(":")[2]) for e in events(raw) if "id" in e]
        assert seqs == list(range(1, len(seqs) + 1))

        # The same for tokenmesh.client used directly, over the two routers still alive.
        alive = [r.address for r in routers if r is not killed[0]]

        async def direct() -> list[inference_pb2.GenerateChunk]:
            chunks: list[inference_pb2.GenerateChunk] = []
            async with Client(alive) as client:
                request = inference_pb2.GenerateRequest(prompt="long", max_tokens=tokens)
                async for chunk in client.generate(request):
                    chunks.append(chunk)
                    if len(chunks) == 20:
                        victim = the_router_streaming([r for r in routers if r.address in alive])
                        os.kill(victim.proc.pid, signal.SIGKILL)
                        killed.append(victim)
            return chunks

        chunks = asyncio.run(direct())
        assert len(killed) == 2
        assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
        assert "".join(c.text for c in chunks) == synthetic_text(tokens)
        assert chunks[-1].usage.completion_tokens == tokens
    finally:
        pids = pids or [c.proc.pid for c in (*mesh.children(), *routers)]
        for router in routers:
            if router.proc.poll() is None:
                router.proc.terminate()
        mesh.stop()
        for router in routers:
            stop_process(router.proc, 10)
    assert not left_behind(pids)


def test_the_openai_sdk_answers_paris_through_the_responses_api(mesh: MeshHandle) -> None:
    client = openai.OpenAI(base_url=url_of(mesh), api_key="x", max_retries=0)
    events = list(
        client.responses.create(model="smollm2", input=FRANCE, temperature=0, max_output_tokens=48, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in text and events[-1].type == "response.completed"
    final = events[-1].response
    assert final.output_text == text and final.usage is not None
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0

    background = client.responses.create(
        model="smollm2", input=FRANCE, temperature=0, max_output_tokens=48, background=True
    )
    deadline = time.monotonic() + 60
    polled = client.responses.retrieve(background.id)
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        polled = client.responses.retrieve(background.id)
    assert polled.status == "completed" and "Paris" in polled.output_text
    replayed = list(client.responses.retrieve(background.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in replayed] == list(range(4, 4 + len(replayed)))
    assert "".join(e.delta for e in replayed if e.type == "response.output_text.delta") == polled.output_text


def test_a_background_response_resumes_after_its_gateway_and_router_are_sigkilled(tmp_path: Path) -> None:
    mesh = Mesh(MeshConfig(port=0, log_dir=str(tmp_path / "logs")))
    routers: list[Child] = []
    others: list[Child] = []
    pids: list[int] = []
    try:
        spawn_mesh(mesh, routers, tmp_path)  # its gateway goes through routers 0 and 1
        others.append(mesh.spawn("gateway-2", "gateway", "--port", "0", "--routers", routers[2].address))
        mesh.wait_ready(others)
        pids = mesh_pids(mesh) + [c.proc.pid for c in (*routers, *others)]
        assert mesh.gateway is not None
        tokens = 3000  # 3 s at the synthetic engine's 1,000 tokens/s
        first = openai.OpenAI(base_url=str(mesh.gateway.info["url"]), api_key="x", max_retries=0)
        seen = []
        stream = first.responses.create(input="long", max_output_tokens=tokens, stream=True, background=True)
        for event in stream:
            seen.append(event)
            if len(seen) == 24:
                break
        stream.close()
        victim = the_router_streaming(routers[:2])  # the one the first gateway follows the response through
        os.kill(mesh.gateway.proc.pid, signal.SIGKILL)
        os.kill(victim.proc.pid, signal.SIGKILL)
        mesh.gateway.proc.wait(10)
        victim.proc.wait(10)

        second = openai.OpenAI(base_url=str(others[0].info["url"]), api_key="x", max_retries=0)
        after = seen[-1].sequence_number
        rest = list(second.responses.retrieve(seen[0].response.id, stream=True, starting_after=after))
        every = seen + rest
        assert [e.sequence_number for e in every] == list(range(len(every)))  # every event once, the same numbers
        assert "".join(e.delta for e in every if e.type == "response.output_text.delta") == synthetic_text(tokens)
        assert every[-1].type == "response.incomplete" and every[-1].response.usage is not None
        assert every[-1].response.usage.output_tokens == tokens
        polled = second.responses.retrieve(seen[0].response.id)
        assert polled.status == "incomplete" and polled.output_text == synthetic_text(tokens)
    finally:
        pids = pids or [c.proc.pid for c in (*mesh.children(), *routers, *others)]
        for child in (*routers, *others):
            if child.proc.poll() is None:
                child.proc.terminate()
        mesh.stop()
        for child in (*routers, *others):
            stop_process(child.proc, 10)
    assert not left_behind(pids)
