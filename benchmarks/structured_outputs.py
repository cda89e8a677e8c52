"""Structured outputs on SmolLM2: how many generations at different seeds validate against their JSON Schema.

Starts the embedded mesh (SmolLM2 on llama.cpp, --workers workers) with its
gateway and asks for a JSON object with required fields, an enum and an
array, --runs times per path at seeds 0..runs-1 (temperature 1, so each seed
samples its own answer): with a gRPC stub (``Inference/Generate``, the
request's ``structured_output.json_schema``), with the ``openai`` SDK
through the gateway (``response_format`` json_schema, streamed and not; the
Responses API's ``text.format``) and with the ``anthropic`` SDK's
``messages.stream()`` (``output_format``). Responses and Messages take no
seed: each of their runs samples with the engine's own random seed.
Each answer is parsed and validated with ``jsonschema``; prints per path the
valid count, the finish reasons and the wall time. --concurrency requests run
at once per path.

--kills N runs N times on a fresh mesh of two workers: one such generation
over gRPC, its worker SIGKILLed once the first chunk arrived. Each run ends
valid and complete (it finished before the kill landed), or ABORTED with
reason STRUCTURED_NOT_CONTINUED (the documented end); anything else (text
that does not validate delivered as a success, another error) is counted bad.

    .venv/bin/python benchmarks/structured_outputs.py --runs 50
    .venv/bin/python benchmarks/structured_outputs.py --runs 0 --kills 20
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import grpc
import jsonschema
import openai
from common import running_mesh

from tokenmesh.mesh import MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "color": {"enum": ["red", "green", "yellow"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "color", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe a fruit as JSON."
MAX_TOKENS = 200


def valid(text: str) -> bool:
    """Whether text is JSON that validates against SCHEMA."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def grpc_request(seed: int | None = None) -> inference_pb2.GenerateRequest:
    """The question over gRPC, its answer constrained by SCHEMA (seed None: the engine's own random one)."""
    return inference_pb2.GenerateRequest(
        messages=[inference_pb2.ChatMessage(role="user", content=PROMPT)],
        max_tokens=MAX_TOKENS,
        seed=seed,
        temperature=1.0,
        structured_output=inference_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    )


def grpc_run(router: str) -> Callable[[int], tuple[str, str]]:
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router))

    def run(seed: int) -> tuple[str, str]:
        chunks = list(stub.Generate(grpc_request(seed), timeout=300))
        return "".join(c.text for c in chunks), inference_pb2.FinishReason.Name(chunks[-1].finish_reason)

    return run


def openai_run(url: str, stream: bool) -> Callable[[int], tuple[str, str]]:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    response_format = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA, "strict": True}}

    def run(seed: int) -> tuple[str, str]:
        asked: dict[str, Any] = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "seed": seed,
            "temperature": 1.0,
            "response_format": response_format,
        }
        if not stream:
            answer = client.chat.completions.create(**asked)
            return answer.choices[0].message.content or "", str(answer.choices[0].finish_reason)
        text, reason = "", ""
        for chunk in client.chat.completions.create(**asked, stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
        return text, reason

    return run


def kill_run() -> str:
    """One generation whose worker is SIGKILLed after its first chunk: ``complete``, ``aborted`` or what was bad."""
    with running_mesh(MeshConfig(workers=2, port=0, threads=1)) as mesh:
        assert mesh.router is not None
        with grpc.insecure_channel(mesh.router.address) as channel:
            table = router_pb2_grpc.RouterStub(channel).GetRoutingTable
            chunks: list[inference_pb2.GenerateChunk] = []
            call = inference_pb2_grpc.InferenceStub(channel).Generate(grpc_request(), timeout=300)
            try:
                for chunk in call:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        rows = table(router_pb2.GetRoutingTableRequest()).workers
                        busy = {w.address for w in rows if w.in_flight}
                        for victim in mesh.workers:
                            if victim.address in busy:
                                os.kill(victim.proc.pid, signal.SIGKILL)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.ABORTED and "not continued" in (error.details() or ""):  # type: ignore[attr-defined]
                    return "aborted"
                return f"error {error.code()}: {error.details()}"  # type: ignore[attr-defined]
    text = "".join(c.text for c in chunks)
    if chunks[-1].finish_reason == inference_pb2.FINISH_REASON_STOP and valid(text):
        return "complete"
    return f"bad: {inference_pb2.FinishReason.Name(chunks[-1].finish_reason)} {text[:80]!r}"


def responses_run(url: str) -> Callable[[int], tuple[str, str]]:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    text_format = {"format": {"type": "json_schema", "name": "fruit", "schema": SCHEMA, "strict": True}}

    def run(seed: int) -> tuple[str, str]:
        answer = client.responses.create(
            model="smollm2",
            input=PROMPT,
            max_output_tokens=MAX_TOKENS,
            temperature=1.0,
            text=text_format,  # type: ignore[arg-type]
        )
        return answer.output_text, str(answer.status)

    return run


def messages_run(url: str) -> Callable[[int], tuple[str, str]]:
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="none", max_retries=0, timeout=300)

    def run(seed: int) -> tuple[str, str]:
        with client.messages.stream(
            model="smollm2",
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}, "temperature": 1.0},
        ) as stream:
            message = stream.get_final_message()
        text = "".join(block.text for block in message.content if block.type == "text")
        return text, str(message.stop_reason)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="seeds per path (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the mesh (default 2)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at once per path (default 4)")
    parser.add_argument(
        "--paths",
        default="grpc,whole,streamed,responses,messages",
        help="of grpc, whole, streamed, responses, messages (default all)",
    )
    parser.add_argument("--kills", type=int, default=0, help="runs with the worker SIGKILLed mid-output (default 0)")
    args = parser.parse_args()
    if args.kills:
        outcomes = collections.Counter(kill_run() for _ in range(args.kills))
        print(f"worker SIGKILLed after the first chunk, {args.kills} runs: {dict(outcomes)}")
    if not args.runs:
        return
    config = MeshConfig(workers=args.workers, port=0, threads=1, gateway_port=0)
    with running_mesh(config) as mesh:
        assert mesh.router is not None and mesh.gateway is not None
        url = str(mesh.gateway.info["url"])
        paths = {
            name: run
            for key, name, run in (
                ("grpc", "gRPC stub (streamed)", grpc_run(mesh.router.address)),
                ("whole", "openai SDK via gateway, whole", openai_run(url, stream=False)),
                ("streamed", "openai SDK via gateway, streamed", openai_run(url, stream=True)),
                ("responses", "openai SDK Responses via gateway", responses_run(url)),
                ("messages", "anthropic SDK Messages (stream)", messages_run(url)),
            )
            if key in args.paths.split(",")
        }
        print(f"{args.runs} seeds per path, schema: required name/color/tags, an enum, an array (max 3)")
        for name, run in paths.items():
            started = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(run, range(args.runs)))
            good = sum(valid(text) for text, _ in results)
            reasons = collections.Counter(reason for _, reason in results)
            bad = [text[:80] for text, _ in results if not valid(text)][:3]
            print(
                f"{name:34} valid {good}/{args.runs}  finish {dict(reasons)}  {time.monotonic() - started:.0f} s"
                + (f"  invalid e.g. {bad}" if bad else "")
            )


if __name__ == "__main__":
    main()
