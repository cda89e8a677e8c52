"""What ``tokenmesh bench`` measures, with the field's definitions (vLLM ``bench serve``, GenAI-Perf).

Per request (times on one monotonic clock, from the moment the request is sent):

- **TTFT** (time to first token): until the first chunk that carries text.
- **E2E latency**: until the stream ends (its final chunk).
- **TPOT** (time per output token): ``(E2E - TTFT) / (output tokens - 1)``;
  only for requests with more than one output token.
- **ITL** (inter-token latency): every gap between consecutive text-bearing
  chunks of a request, all requests pooled. A chunk that carries several
  tokens (coalesced) is one gap, as vLLM counts it.
- **Stream tokens/s**: output tokens / E2E latency of that request; the run
  reports the population variance sigma^2 of it over successful requests
  (how evenly the streams are served).
- **TTFT added by the mesh** (mesh target only): TTFT minus the engine's own
  TTFT that the mesh reports on the final chunk (``timing.engine_ttft_ms``:
  from the worker sending the request to Triton to Triton's first text). What
  the network, router and worker added, measured in the same requests, free of
  the engine's run-to-run noise. Of it, **inside the mesh** is the router's
  own ``timing.router_ttft_ms`` minus ``engine_ttft_ms`` (router and worker
  hops; the rest is the network to the router and the client itself).

Per run (over the measured requests, warm-up excluded); *duration* runs from
the first request sent to the last stream ended:

- **Output token throughput**: output tokens of successful requests / duration.
- **Request throughput**: successful requests / duration.
- **Goodput**: successful requests that met every ``--slo`` bound / duration.
- **Interruption rate**: requests that ended in an error or whose ``seq`` skipped
  or repeated a number, over all requests.
- **Errors**: interrupted requests by gRPC status code (``SEQ_GAP`` for a gap).

Distributions are reported as mean, p50, p90, p99 (linear interpolation).
Latency distributions include successful requests only.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass
class RequestResult:
    """One request as the client saw it."""

    target: str
    """Which target served it ("mesh" or "triton")."""
    sent: float
    """When it was sent (time.monotonic())."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of each text-bearing chunk."""
    chunk_tokens: list[int] = field(default_factory=list)
    """Tokens in each of those chunks."""
    ended: float | None = None
    """When the stream ended (final chunk or error)."""
    output_tokens: int = 0
    """Tokens generated (the final usage when the target reports one)."""
    error: str | None = None
    """gRPC status code name of the error it ended in; SEQ_GAP for a seq gap; None when it succeeded."""
    engine_ttft: float | None = None
    """The engine's own TTFT in seconds, when the target reports it (the mesh's final chunk timing)."""
    router_ttft: float | None = None
    """Seconds from the router receiving the request to it sending the first chunk (mesh target only)."""
    queued: float | None = None
    """Seconds the request waited in the router's admission queue for a worker slot (mesh target only)."""

    @property
    def ok(self) -> bool:
        """Ended normally, with every chunk in order."""
        return self.error is None and self.ended is not None

    @property
    def ttft(self) -> float | None:
        """Seconds to the first text-bearing chunk."""
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def ttft_added(self) -> float | None:
        """Seconds the target added to the engine's TTFT (None unless it reports the engine's)."""
        ttft = self.ttft
        return ttft - self.engine_ttft if ttft is not None and self.engine_ttft is not None else None

    @property
    def ttft_inside(self) -> float | None:
        """Seconds the router and worker added to the engine's TTFT, by the router's clock."""
        if self.router_ttft is None or self.engine_ttft is None:
            return None
        return self.router_ttft - self.engine_ttft

    @property
    def e2e(self) -> float | None:
        """Seconds to the end of the stream."""
        return self.ended - self.sent if self.ended is not None else None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive text-bearing chunks."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over E2E latency."""
        e2e = self.e2e
        return self.output_tokens / e2e if e2e else None


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 of values (None when there are none)."""
    if not values:
        return None
    result = {"mean": statistics.fmean(values)}
    for p in PERCENTILES:
        result[f"p{p}"] = percentile(values, p)
    return result


def parse_slo(spec: str) -> dict[str, float]:
    """'ttft=500,tpot=50' (milliseconds) -> {'ttft': 0.5, 'tpot': 0.05} (seconds); ValueError on anything else."""
    bounds: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo: {part!r} is not NAME=MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"--slo: {value!r} in {part!r} is not a number of milliseconds") from None
        if bound <= 0:
            raise ValueError(f"--slo: {part!r} must be > 0 ms")
        bounds[name] = bound / 1000
    return bounds


def meets(result: RequestResult, slo: dict[str, float]) -> bool:
    """True when the request succeeded and each bounded metric is within its bound."""
    if not result.ok:
        return False
    for name, bound in slo.items():
        value = getattr(result, name)
        if value is None or value > bound:
            return False
    return True


def span(results: Sequence[RequestResult]) -> float:
    """From the first request sent to the last stream ended."""
    ends = [r.ended for r in results if r.ended is not None]
    return (max(ends) - min(r.sent for r in results)) if results and ends else 0.0


def summarize(
    results: Sequence[RequestResult], slo: dict[str, float] | None = None, duration_s: float | None = None
) -> dict[str, Any]:
    """The run's figures (see the module docstring for each definition).

    duration_s overrides the span of the results (a target measured in
    several blocks, interleaved with another, is timed over its blocks only).
    """
    slo = slo or {}
    ok = [r for r in results if r.ok]
    duration = span(results) if duration_s is None else duration_s
    tokens = sum(r.output_tokens for r in ok)
    rates = [rate for r in ok if (rate := r.tokens_per_s) is not None]
    errors = collections.Counter(r.error or "NO_END" for r in results if not r.ok)
    return {
        "requests": len(results),
        "successful": len(ok),
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration else 0.0,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "goodput_requests_per_s": (sum(meets(r, slo) for r in results) / duration) if slo and duration else None,
        "slo_ms": {k: v * 1000 for k, v in slo.items()},
        "interruption_rate": (len(results) - len(ok)) / len(results) if results else 0.0,
        "errors": dict(sorted(errors.items())),
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "ttft_added_s": distribution([a for r in ok if (a := r.ttft_added) is not None]),
        "ttft_inside_s": distribution([a for r in ok if (a := r.ttft_inside) is not None]),
        "queued_s": distribution([q for r in ok if (q := r.queued) is not None]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itls]),
        "e2e_s": distribution([e for r in ok if (e := r.e2e) is not None]),
        "stream_tokens_per_s": distribution(rates),
        "tokens_per_chunk": distribution([n for r in ok for n in r.chunk_tokens]),
        "stream_tokens_per_s_variance": statistics.pvariance(rates) if rates else None,
    }
