"""How ``tokenmesh bench`` shows its figures: a summary table, mesh/direct ratios, JSON and a plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenmesh.bench.metrics import RequestResult, percentile

LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E latency", "e2e_s"))


STATS = ("mean", "p50", "p90", "p99")


def _row(label: str, dist: Mapping[str, float] | None, scale: float = 1.0) -> str:
    return f"{label:24}" + "".join(f"{dist[k] * scale:10.2f}" if dist else f"{'-':>10}" for k in STATS)


def table(name: str, summary: Mapping[str, Any]) -> str:
    """The summary of one target as a text table."""
    lines = [
        f"== {name}: {summary['successful']}/{summary['requests']} requests in {summary['duration_s']:.2f} s ==",
        f"{'':24}" + "".join(f"{k:>10}" for k in STATS),
    ]
    lines += [_row(f"{label} (ms)", summary[key], 1000) for label, key in LATENCIES]
    if summary.get("ttft_added_s"):
        lines.append(_row("TTFT added by mesh (ms)", summary["ttft_added_s"], 1000))
    if summary.get("ttft_inside_s"):
        lines.append(_row("  of it inside (ms)", summary["ttft_inside_s"], 1000))
    if summary.get("queued_s"):
        lines.append(_row("  queued in router (ms)", summary["queued_s"], 1000))
    lines.append(_row("stream tokens/s", summary["stream_tokens_per_s"]))
    lines.append(_row("tokens per chunk", summary["tokens_per_chunk"]))
    variance = summary["stream_tokens_per_s_variance"]
    lines += [
        f"{'output tokens/s':24}{summary['output_tokens_per_s']:10.1f}",
        f"{'requests/s':24}{summary['requests_per_s']:10.3f}",
    ]
    if summary["goodput_requests_per_s"] is not None:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in summary["slo_ms"].items())
        lines.append(f"{'goodput (req/s)':24}{summary['goodput_requests_per_s']:10.3f}   ({slo})")
    lines.append(f"{'interruption rate':24}{summary['interruption_rate']:10.2%}")
    if variance is not None:
        lines.append(f"{'stream tokens/s var':24}{variance:10.2f}   (sigma^2 over streams)")
    if summary["errors"]:
        lines.append(f"{'errors':24}" + ", ".join(f"{code} x{n}" for code, n in summary["errors"].items()))
    return "\n".join(lines)


def block_overheads_ms(
    mesh: Sequence[Sequence[RequestResult]], direct: Sequence[Sequence[RequestResult]]
) -> list[float]:
    """Per --compare block: mesh TTFT p50 minus direct TTFT p50, in ms (blocks where both have one)."""
    out = []
    for m, d in zip(mesh, direct, strict=False):
        m_ttft = [t for r in m if r.ok and (t := r.ttft) is not None]
        d_ttft = [t for r in d if r.ok and (t := r.ttft) is not None]
        if m_ttft and d_ttft:
            out.append((percentile(m_ttft, 50) - percentile(d_ttft, 50)) * 1000)
    return out


def ratios(
    mesh: Mapping[str, Any],
    direct: Mapping[str, Any],
    mesh_blocks: Sequence[Sequence[RequestResult]] = (),
    direct_blocks: Sequence[Sequence[RequestResult]] = (),
) -> dict[str, Any]:
    """mesh/direct ratios and mesh-minus-direct overheads (ms) of the figures the mesh is judged by.

    Besides the overall figures: the TTFT p50 overhead of each block (their
    spread shows how much of the overall difference is the engine's noise)
    and the TTFT the mesh itself reports having added (``ttft_added_s``).
    """

    def pick(summary: Mapping[str, Any], key: str, p: str) -> float | None:
        dist = summary[key]
        return dist[p] if dist else None

    out: dict[str, Any] = {}
    for p in ("p50", "p99"):
        m, d = pick(mesh, "ttft_s", p), pick(direct, "ttft_s", p)
        out[f"ttft_{p}_ratio"] = m / d if m is not None and d else None
        out[f"ttft_{p}_overhead_ms"] = (m - d) * 1000 if m is not None and d is not None else None
    d_tps = direct["output_tokens_per_s"]
    out["output_tokens_per_s_ratio"] = mesh["output_tokens_per_s"] / d_tps if d_tps else None
    added = mesh.get("ttft_added_s")
    out["ttft_added_p50_ms"] = added["p50"] * 1000 if added else None
    out["ttft_added_p99_ms"] = added["p99"] * 1000 if added else None
    inside = mesh.get("ttft_inside_s")
    out["ttft_inside_p50_ms"] = inside["p50"] * 1000 if inside else None
    out["ttft_p50_overhead_by_block_ms"] = block_overheads_ms(mesh_blocks, direct_blocks)
    return out


def ratio_table(values: Mapping[str, Any]) -> str:
    """The comparison as text."""

    def show(key: str, unit: str = "") -> str:
        value = values[key]
        return "-" if value is None else f"{value:.3f}{unit}"

    lines = [
        "== mesh / direct Triton ==",
        f"TTFT p50: {show('ttft_p50_ratio')}x  (overhead {show('ttft_p50_overhead_ms', ' ms')})",
        f"TTFT p99: {show('ttft_p99_ratio')}x  (overhead {show('ttft_p99_overhead_ms', ' ms')})",
        f"output tokens/s: {show('output_tokens_per_s_ratio')}x",
    ]
    by_block = values["ttft_p50_overhead_by_block_ms"]
    if len(by_block) > 1:
        shown = " ".join(f"{v:+.1f}" for v in by_block)
        lines.append(
            f"TTFT p50 overhead per block (ms): {shown}  (spread {max(by_block) - min(by_block):.1f} ms: "
            "the engine's noise between blocks)"
        )
    if values["ttft_added_p50_ms"] is not None:
        lines.append(
            f"TTFT added by the mesh, as it reports (ms): p50 {show('ttft_added_p50_ms')}, "
            f"p99 {show('ttft_added_p99_ms')}; inside router and worker: p50 {show('ttft_inside_p50_ms')}"
        )
    return "\n".join(lines)


def write_json(path: str, report: Mapping[str, Any]) -> None:
    """The whole report as JSON."""
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def plot(path: str, runs: Mapping[str, Sequence[RequestResult]]) -> None:
    """TTFT and ITL distributions and output throughput over time (1 s bins), one series per target."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (ttft_ax, itl_ax, rate_ax) = plt.subplots(1, 3, figsize=(15, 4))
    start = min((r.sent for results in runs.values() for r in results), default=0.0)
    for name, results in runs.items():
        ok = [r for r in results if r.ok]
        ttft_ax.hist([r.ttft * 1000 for r in ok if r.ttft is not None], bins=40, alpha=0.6, label=name)
        itl_ax.hist([gap * 1000 for r in ok for gap in r.itls], bins=60, alpha=0.6, label=name)
        bins: dict[int, int] = {}
        for r in ok:
            for t, tokens in zip(r.chunk_times, r.chunk_tokens, strict=True):
                bins[int(t - start)] = bins.get(int(t - start), 0) + tokens
        seconds = sorted(bins)
        rate_ax.plot(seconds, [bins[s] for s in seconds], label=name)
    ttft_ax.set(title="TTFT", xlabel="ms", ylabel="requests")
    itl_ax.set(title="ITL (inter-chunk gaps)", xlabel="ms", ylabel="gaps")
    rate_ax.set(title="output throughput", xlabel="s since start", ylabel="tokens/s")
    for ax in (ttft_ax, itl_ax, rate_ax):
        ax.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
