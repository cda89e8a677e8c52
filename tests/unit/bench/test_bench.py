"""tokenmesh bench: the metric definitions on synthetic timestamps, prompt sets, bad input, a run on a mesh."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.support.bench import run_bench
from tests.support.mesh import in_process_mesh
from tokenmesh.bench import metrics, prompts
from tokenmesh.bench.metrics import RequestResult


def result(
    sent: float,
    chunks: list[tuple[float, int]],
    ended: float | None,
    tokens: int | None = None,
    error: str | None = None,
) -> RequestResult:
    return RequestResult(
        target="t",
        sent=sent,
        chunk_times=[t for t, _ in chunks],
        chunk_tokens=[n for _, n in chunks],
        ended=ended,
        output_tokens=sum(n for _, n in chunks) if tokens is None else tokens,
        error=error,
    )


def test_per_request_definitions() -> None:
    # Sent at 10.0; chunks of 1, 2 (coalesced) and 1 tokens; ended 0.1 s after the last chunk.
    r = result(10.0, [(10.5, 1), (10.7, 2), (11.0, 1)], ended=11.1)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)  # 4 tokens: 3 after the first
    assert r.itls == pytest.approx([0.2, 0.3])  # one gap per chunk, a coalesced chunk is one gap
    assert r.tokens_per_s == pytest.approx(4 / 1.1)
    single = result(0.0, [(0.2, 1)], ended=0.3)
    assert single.tpot is None and single.itls == []
    assert r.ttft_added is None  # the target did not report the engine's TTFT
    r.engine_ttft = 0.45  # the mesh says the engine took 450 ms of the 500
    assert r.ttft_added == pytest.approx(0.05) and r.ttft_inside is None
    r.router_ttft = 0.48  # ... and the router had its first chunk 480 ms after the request reached it
    assert r.ttft_inside == pytest.approx(0.03)


def test_compare_overheads_per_block_and_as_the_mesh_reports_them() -> None:
    def block(ttfts: list[float], engine: float | None = None) -> list[RequestResult]:
        runs = [result(0.0, [(t, 1)], ended=t + 0.1) for t in ttfts]
        for r in runs:
            r.engine_ttft = engine
        return runs

    mesh = [block([1.0, 1.2, 1.4], engine=0.99), block([2.0, 2.2, 2.4], engine=1.995)]
    direct = [block([1.1, 1.2, 1.3]), block([2.1, 2.15, 2.2])]
    from tokenmesh.bench import report

    values = report.ratios(
        metrics.summarize([r for b in mesh for r in b]), metrics.summarize([r for b in direct for r in b]), mesh, direct
    )
    # Block p50s: mesh 1.2 vs 1.2, then 2.2 vs 2.15.
    assert values["ttft_p50_overhead_by_block_ms"] == pytest.approx([0.0, 50.0])
    # What the mesh added by its own report: 1.0-0.99 ... 2.4-1.995; p50 of the six.
    added = sorted([0.01, 0.21, 0.41, 0.005, 0.205, 0.405])
    assert values["ttft_added_p50_ms"] == pytest.approx(metrics.percentile(added, 50) * 1000)
    text = report.ratio_table(values)
    assert "+0.0 +50.0" in text and "TTFT added by the mesh" in text


def test_run_definitions_throughput_goodput_interruptions_and_variance() -> None:
    runs = [
        result(0.0, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)], ended=0.4),  # 4 tok in 0.4 s: 10 tok/s
        result(0.5, [(1.5, 1), (1.7, 1), (1.9, 1), (2.1, 1)], ended=2.5),  # TTFT 1.0 s; 4 tok in 2 s: 2 tok/s
        result(1.0, [(1.2, 1)], ended=1.3, error="SEQ_GAP"),  # interrupted
        result(2.0, [], ended=2.1, error="UNAVAILABLE"),  # interrupted
    ]
    s = metrics.summarize(runs, metrics.parse_slo("ttft=500"))
    assert s["duration_s"] == pytest.approx(2.5)  # first send 0.0 -> last end 2.5
    assert s["successful"] == 2 and s["output_tokens"] == 8
    assert s["output_tokens_per_s"] == pytest.approx(8 / 2.5)
    assert s["requests_per_s"] == pytest.approx(2 / 2.5)
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 2.5)  # only the first met TTFT <= 500 ms
    assert s["interruption_rate"] == 0.5
    assert s["errors"] == {"SEQ_GAP": 1, "UNAVAILABLE": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.55) and s["ttft_s"]["mean"] == pytest.approx(0.55)
    assert s["ttft_s"]["p99"] == pytest.approx(0.1 + 0.99 * 0.9)
    assert s["itl_s"]["mean"] == pytest.approx((0.1 * 3 + 0.2 * 3) / 6)  # all gaps of successful requests pooled
    assert s["stream_tokens_per_s_variance"] == pytest.approx(16.0)  # rates 10 and 2: mean 6, sigma^2 16
    assert s["tpot_s"]["p50"] == pytest.approx(((0.4 - 0.1) / 3 + (2.0 - 1.0) / 3) / 2)


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert metrics.percentile(values, 50) == 3.0
    assert metrics.percentile(values, 90) == pytest.approx(4 + 0.6 * 6)
    assert metrics.percentile([7.0], 99) == 7.0
    assert math.isnan(metrics.percentile([], 50))  # benchmarks print nan for a run with no samples


def test_slo_parsing() -> None:
    assert metrics.parse_slo("ttft=500, tpot=50") == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttft", "latency=5", "ttft=-1", "ttft=fast"):
        with pytest.raises(ValueError, match="--slo"):
            metrics.parse_slo(bad)


def test_synthetic_prompts_share_prefixes_by_group() -> None:
    made = prompts.synthetic(6, input_tokens=40, output_tokens=7, prefix_groups=2, prefix_tokens=30, seed=1)
    assert len(made) == 6 and all(p.max_tokens == 7 and len(p.text.split()) == 40 for p in made)
    heads = [" ".join(p.text.split()[:30]) for p in made]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert len({p.text for p in made}) == 6
    assert made[0].tagged("mesh").text.startswith("mesh ") and made[0].tagged("triton").text.startswith("triton ")


def test_jsonl_prompts_and_their_errors(tmp_path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hi", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    read = prompts.read_jsonl(str(good), 9)
    assert [(p.text, p.messages, p.max_tokens) for p in read] == [("hi", (), 5), ("", (("user", "yo"),), 9)]
    cases = {
        "{not json}\n": "bad.jsonl:1: not JSON",
        '{"prompt": "a"}\n[1]\n': "bad.jsonl:2: expected an object",
        '{"prompt": "a", "max_tokens": 0}\n': "max_tokens must be a positive integer",
        '{"text": "a"}\n': 'needs a non-empty "prompt"',
        '{"messages": [{"role": "user"}]}\n': "each message needs string",
        "\n": "holds no prompts",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(prompts.PromptError, match=message):
            prompts.read_jsonl(str(bad), 9)
    with pytest.raises(prompts.PromptError, match="cannot read prompt file"):
        prompts.read_jsonl(str(tmp_path / "missing.jsonl"), 9)


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmesh", "bench", "--progress", "off", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--request-rate", "-2"], "--request-rate must be > 0, got -2.0"),
        (["--requests", "0"], "--requests must be >= 1"),
        (["--slo", "ttft=soon"], "--slo"),
        (["--prompts", "/nonexistent.jsonl"], "cannot read prompt file /nonexistent.jsonl"),
        (["--addr", "127.0.0.1:1"], "cannot reach the mesh at 127.0.0.1:1"),
        (["--target", "triton", "--triton-url", "127.0.0.1:1", "--model", "m"], "cannot reach Triton at 127.0.0.1:1"),
        (["--target", "triton"], "--target triton needs --triton-url"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], message: str) -> None:
    out = bench(*args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


async def test_bench_against_a_mesh_counts_every_token_and_writes_json(tmp_path) -> None:
    async with in_process_mesh() as mesh:
        report = tmp_path / "report.json"
        plot = tmp_path / "plot.png"
        out = await run_bench(
            "--addr",
            mesh.router.host.address,
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--output-tokens",
            "9",
            "--input-tokens",
            "16",
            "--slo",
            "ttft=60000",
            "--json",
            str(report),
            "--plot",
            str(plot),
        )
        unknown = await run_bench("--addr", mesh.router.host.address, "--model", "nope")
    assert out.returncode == 0, out.stderr
    summary = json.loads(report.read_text())["summaries"]["mesh"]
    assert (summary["requests"], summary["successful"], summary["output_tokens"]) == (12, 12, 12 * 9)
    assert summary["interruption_rate"] == 0 and summary["errors"] == {}
    assert summary["goodput_requests_per_s"] == pytest.approx(summary["requests_per_s"])
    assert "TTFT (ms)" in out.stdout and "interruption rate" in out.stdout
    # The mesh reports the engine's TTFT on each final chunk: what it added is positive and below the TTFT.
    assert 0 < summary["ttft_added_s"]["p50"] < summary["ttft_s"]["p50"]
    assert 0 < summary["ttft_inside_s"]["p50"] < summary["ttft_added_s"]["p50"]
    assert "TTFT added by mesh (ms)" in out.stdout and "of it inside (ms)" in out.stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes().startswith(b"\x89PNG")
    assert unknown.returncode == 2 and "model 'nope' is not served by the mesh" in unknown.stderr


def test_the_direct_target_sends_each_request_to_the_least_outstanding_triton() -> None:
    from tokenmesh.bench.targets import TritonTarget

    target = TritonTarget(["a:1", "b:1", "c:1"], "m")
    target._clients = [object(), object(), object()]  # type: ignore[list-item]  # only counted here
    target.outstanding = [2, 0, 1]
    assert target._least_outstanding() == 1
    target.outstanding = [1, 1, 1]
    ties = [target._least_outstanding() for _ in range(6)]
    assert sorted(ties) == [0, 0, 1, 1, 2, 2]  # ties go round, none is favoured
