"""``tokenmesh bench --target openai --api ...`` through the gateway: each route, asked and counted the same way."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.support.bench import run_bench
from tests.support.gateway_helpers import gateway_over
from tests.support.mesh import in_process_mesh

REQUESTS = 12
TOKENS = 7


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
async def test_each_api_streams_every_token_of_every_request_through_its_route(api: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    # 10 ms a token: each token its own event, so that TTFT, ITL and E2E all have something to measure.
    async with in_process_mesh(backend_settings={"delay": 0.01}) as mesh, gateway_over(mesh) as gateway:
        out = await run_bench(
            *("--target", "openai", "--url", gateway.url, "--api", api),
            *("--requests", str(REQUESTS), "--concurrency", "4", "--output-tokens", str(TOKENS)),
            *("--input-tokens", "8", "--json", str(report)),
        )
        started = [g.params for b in mesh.backends for g in b.started]
    assert out.returncode == 0, out.stderr
    summary = orjson.loads(report.read_bytes())["summaries"]["openai"]
    assert (summary["requests"], summary["successful"], summary["output_tokens"]) == (REQUESTS, REQUESTS, 84)
    assert summary["errors"] == {} and summary["interruption_rate"] == 0
    assert 0 < summary["ttft_s"]["p50"] < summary["e2e_s"]["p50"]
    # Gaps between text events: some as far apart as the tokens (some may come together on a busy machine).
    assert 0.005 < summary["itl_s"]["p99"] < 0.5
    # Every route asked the mesh for the same thing: the synthetic prompt, exactly TOKENS tokens (ignore_eos).
    assert len(started) == REQUESTS
    assert all(p.ignore_eos and p.max_tokens == TOKENS for p in started)
    # A raw prompt stays one on completions; the other routes send it as the user's message.
    assert {bool(p.messages) for p in started} == {api != "completions"}
    assert all([m[0] for m in p.messages] == ["user"] for p in started if p.messages)
    assert {p.seed for p in started} == ({0} if api in ("chat", "completions") else {None})  # the APIs with a seed


async def test_a_system_prompt_goes_where_each_api_takes_it(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}\n'
    )
    async with in_process_mesh() as mesh, gateway_over(mesh) as gateway:
        for api in ("chat", "responses", "messages"):
            out = await run_bench(
                *("--target", "openai", "--url", gateway.url, "--api", api, "--prompts", str(prompts)),
                *("--requests", "1", "--output-tokens", "3"),
            )
            assert out.returncode == 0, out.stderr
        refused = await run_bench(
            *("--target", "openai", "--url", gateway.url, "--api", "completions", "--prompts", str(prompts))
        )
        started = [g.params for b in mesh.backends for g in b.started]
    assert [list(p.messages) for p in started] == [[("system", "Be brief."), ("user", "hi")]] * 3
    assert refused.returncode == 2 and "--api completions takes raw prompts" in refused.stderr
    unrouted = await run_bench("--api", "responses")
    assert unrouted.returncode == 2 and "--api picks a route of --target openai" in unrouted.stderr
