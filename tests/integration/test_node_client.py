"""A Node.js caller (@grpc/grpc-js, protos/ loaded by @grpc/proto-loader) against the real mesh (synthetic model).

The contract is for other languages too: tests/support/node/caller.js speaks to a router from protos/ alone, as a
team without our Python client would, and prints what it saw; the assertions are here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google.rpc.status_pb2
import pytest

from tokenmesh.worker.triton import synthetic_repository

from .conftest import MeshHandle, running_mesh

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CALLER = ROOT / "tests" / "support" / "node" / "caller.js"
STREAMS = 24
TOKENS = 40
TOKENS_PER_S = 500
"""The synthetic model's rate: a 400-token generation runs ~0.8 s, long enough to drop or cancel it mid-stream."""
GOOGLEAPIS = Path(google.rpc.status_pb2.__file__).parents[2]
"""googleapis-common-protos' folder, which holds google/rpc/*.proto: inference.proto imports status.proto, and the
caller decodes errors' details with it."""


def node(handle: MeshHandle, scenario: str, **options: Any) -> Any:
    """Run one scenario of the Node.js caller against the mesh's router; what it printed, parsed."""
    executable = shutil.which("node")
    if executable is None or not (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("node or node_modules missing: `make test-deps` installs nodejs and runs npm ci")
    done = subprocess.run(
        [executable, str(CALLER), scenario, handle.address, json.dumps({"googleapis": str(GOOGLEAPIS), **options})],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def expected_text(tokens: int) -> str:
    """What the synthetic model writes for max_tokens=tokens."""
    return "".join(f" t{i}" for i in range(tokens))


def assert_whole(chunks: list[dict[str, Any]], tokens: int, prompt_tokens: int) -> None:
    """One generation exactly: seq 1..n, the model's text, one final chunk with LENGTH and usage."""
    assert [c["seq"] for c in chunks] == list(range(1, len(chunks) + 1))
    assert "".join(c["text"] for c in chunks) == expected_text(tokens)
    assert [c["finish_reason"] for c in chunks[:-1]] == ["FINISH_REASON_UNSPECIFIED"] * (len(chunks) - 1)
    final = chunks[-1]
    assert final["finish_reason"] == "FINISH_REASON_LENGTH"
    # The synthetic model reuses no prompt cache (proto-loader's defaults: the 0 is there).
    assert final["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "cached_prompt_tokens": 0}
    assert sum(c["token_count"] for c in chunks) == tokens


@pytest.fixture(scope="module")
def synthetic_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHandle]:
    tmp = tmp_path_factory.mktemp("node-mesh")
    repository = synthetic_repository(tmp, tokens_per_s=TOKENS_PER_S)
    with running_mesh(tmp, workers=1, model_repository=str(repository)) as handle:
        yield handle


def test_dozens_of_streams_each_contiguous_with_finish_reason_and_usage(synthetic_mesh: MeshHandle) -> None:
    seen = node(synthetic_mesh, "generate", streams=STREAMS, tokens=TOKENS)

    assert len(seen["streams"]) == STREAMS
    for i, stream in enumerate(seen["streams"]):
        assert stream["error"] is None, stream["error"]
        assert_whole(stream["chunks"], TOKENS + i, prompt_tokens=len(f"node caller {i}".split()))
        assert {c["model"] for c in stream["chunks"]} == {"synthetic"}


def test_resume_after_the_dropped_call_continues_at_the_next_seq(synthetic_mesh: MeshHandle) -> None:
    seen = node(synthetic_mesh, "resume", request_id="node-resume", tokens=400, after=5)

    # The caller's own cancel ends its call; the generation runs on and Resume delivers the rest exactly once.
    assert seen["first"]["error"]["code"] == "CANCELLED"
    assert seen["after_seq"] == seen["first"]["chunks"][-1]["seq"] >= 5
    assert seen["rest"]["error"] is None, seen["rest"]["error"]
    assert seen["rest"]["chunks"][0]["seq"] == seen["after_seq"] + 1
    assert_whole(seen["first"]["chunks"] + seen["rest"]["chunks"], 400, prompt_tokens=4)
    # Resume's chunks name no model (the router that resumes never saw the request): only Generate's do.
    assert {c["model"] for c in seen["first"]["chunks"]} == {"synthetic"}


def test_cancel_ends_the_stream_and_frees_the_workers(synthetic_mesh: MeshHandle) -> None:
    # 4,000 tokens (the synthetic model's context allows 4,096): 8 s at its rate, so a stream that ends within 4 s
    # was stopped by its cancel.
    seen = node(synthetic_mesh, "cancel", request_id="node-cancel", tokens=4000, after=3)

    assert seen["cancel"] == {"response": {"cancelled": True}}
    chunks = seen["stream"]["chunks"]
    assert seen["stream"]["error"] is None, seen["stream"]["error"]
    assert [c["seq"] for c in chunks] == list(range(1, len(chunks) + 1))
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_CANCELLED"
    assert [c["finish_reason"] for c in chunks[:-1]] == ["FINISH_REASON_UNSPECIFIED"] * (len(chunks) - 1)
    assert seen["dropped"]["error"]["code"] == "CANCELLED"
    assert seen["elapsed_ms"] < 4000
    assert sum(c["token_count"] for c in chunks) < 2000
    # Both generations stopped in the mesh, not only on the caller's side: no worker holds a slot for them.
    deadline = time.monotonic() + 5
    while (busy := sum(w.in_flight for w in synthetic_mesh.table().workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy == 0


def error_info(seen: dict[str, Any]) -> dict[str, Any]:
    """The google.rpc.ErrorInfo of a refusal as the Node.js caller decoded it, less its type."""
    [info] = [d for d in seen["status_details"] if d["type"] == "google.rpc.ErrorInfo"]
    return {k: v for k, v in info.items() if k != "type"}


def fields_at_fault(seen: dict[str, Any]) -> list[str]:
    """The fields a refusal's google.rpc.BadRequest names."""
    bad = [d for d in seen["status_details"] if d["type"] == "google.rpc.BadRequest"]
    return [v["field"] for d in bad for v in d["field_violations"]]


def test_refusals_are_grpc_statuses_with_their_messages_and_details(synthetic_mesh: MeshHandle) -> None:
    seen = node(synthetic_mesh, "errors")

    both = seen["prompt_and_messages"]
    assert (both["code"], both["details"]) == ("INVALID_ARGUMENT", "set either prompt or messages, not both")
    assert error_info(both) == {"reason": "INVALID_ARGUMENT", "domain": "tokenmesh", "metadata": {}}
    assert fields_at_fault(both) == ["prompt"]
    negative = seen["negative_temperature"]
    assert (negative["code"], negative["details"]) == ("INVALID_ARGUMENT", "temperature must be >= 0, got -1.0")
    assert fields_at_fault(negative) == ["temperature"]
    unknown = seen["unknown_model"]
    assert (unknown["code"], unknown["details"]) == ("NOT_FOUND", "unknown model 'no-such-model'; available: synthetic")
    assert error_info(unknown) == {
        "reason": "UNKNOWN_MODEL",
        "domain": "tokenmesh",
        "metadata": {"model": "no-such-model", "available": "synthetic"},
    }
    assert fields_at_fault(unknown) == ["model"]
    for call in ("resume_unknown", "cancel_unknown"):
        assert seen[call]["code"] == "NOT_FOUND"
        assert "'node-no-such-id'" in seen[call]["details"]
        assert error_info(seen[call])["reason"] == "NOT_FOUND"
