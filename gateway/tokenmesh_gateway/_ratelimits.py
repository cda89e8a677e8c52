"""OpenAI's ``x-ratelimit-*`` headers from a tenant's quota figures.

The router hands the figures back on every generation of a tenant with a
quota: on its first chunk (``GenerateChunk.rate_limits``) when it is
admitted, in the refusal's ``ErrorInfo`` metadata when it is not (same
names). Each response then carries, per limit the tenant has,
``x-ratelimit-limit-requests``/``-tokens``, ``x-ratelimit-remaining-*`` and
``x-ratelimit-reset-*`` (how long until what is counted now has left the
window, written as OpenAI does: ``1s``, ``6m0s``, ``120ms``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tokenmesh.v1 import inference_pb2

Headers = list[tuple[bytes, bytes]]


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's form): ``120ms``, ``1.5s``, ``6m0s``, ``1h0m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(round(seconds, 3), 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{round(secs, 3):g}s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


def _headers(figure: Callable[[str], float | None]) -> Headers:
    headers: Headers = []
    for kind in ("requests", "tokens"):
        limit = figure(f"limit_{kind}")
        if limit is None:
            continue
        remaining = figure(f"remaining_{kind}") or 0
        reset = figure(f"reset_{kind}_s") or 0.0
        headers += [
            (f"x-ratelimit-limit-{kind}".encode(), str(int(limit)).encode()),
            (f"x-ratelimit-remaining-{kind}".encode(), str(int(remaining)).encode()),
            (f"x-ratelimit-reset-{kind}".encode(), duration(reset).encode()),
        ]
    return headers


def admitted_headers(chunk: inference_pb2.GenerateChunk) -> Headers:
    """The headers of an admitted generation, from its first chunk (none when its tenant has no quota)."""
    if not chunk.HasField("rate_limits"):
        return []
    figures = chunk.rate_limits
    return _headers(lambda name: getattr(figures, name) if figures.HasField(name) else None)


def refused_headers(metadata: Mapping[str, str]) -> Headers:
    """The headers of a refusal, from its ErrorInfo metadata."""

    def figure(name: str) -> float | None:
        try:
            return float(metadata[name])
        except (KeyError, ValueError):
            return None

    return _headers(figure)
