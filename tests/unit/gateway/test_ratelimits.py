"""OpenAI's x-ratelimit-* headers from the router's quota figures."""

from __future__ import annotations

import pytest

from tokenmesh.errors import ResourceExhausted
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import from_mesh
from tokenmesh_gateway._ratelimits import admitted_headers, duration, refused_headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.12, "120ms"), (1.0, "1s"), (1.5, "1.5s"), (59.4, "59.4s"), (360.0, "6m0s"), (3723.0, "1h2m3s")],
)
def test_durations_are_written_as_openai_does(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_an_admitted_generation_has_a_header_per_figure_of_the_limits_it_has() -> None:
    chunk = inference_pb2.GenerateChunk(
        seq=1, rate_limits=inference_pb2.RateLimits(limit_tokens=1000, remaining_tokens=900, reset_tokens_s=59.4)
    )
    assert admitted_headers(chunk) == [
        (b"x-ratelimit-limit-tokens", b"1000"),
        (b"x-ratelimit-remaining-tokens", b"900"),
        (b"x-ratelimit-reset-tokens", b"59.4s"),
    ]
    assert admitted_headers(inference_pb2.GenerateChunk(seq=1)) == []  # no quota: no headers


def test_a_quota_refusal_is_429_with_its_figures_and_no_retry_when_it_never_fits() -> None:
    metadata = {"tenant": "t", "limit_requests": "3", "remaining_requests": "0", "reset_requests_s": "42.5"}
    later = from_mesh(ResourceExhausted("no", reason="QUOTA_REQUESTS_PER_MINUTE", metadata=metadata, retry_delay=42.5))
    assert later.status == 429 and later.code == "resource_exhausted"
    assert dict(later.headers()) == {
        b"retry-after": b"43",
        b"retry-after-ms": b"42500",
        b"x-ratelimit-limit-requests": b"3",
        b"x-ratelimit-remaining-requests": b"0",
        b"x-ratelimit-reset-requests": b"42.5s",
    }
    never = from_mesh(ResourceExhausted("too large", reason="QUOTA_TOKENS_PER_MINUTE", metadata={"limit_tokens": "9"}))
    assert b"retry-after" not in dict(never.headers())
    assert dict(never.headers())[b"x-ratelimit-limit-tokens"] == b"9"
    queue = from_mesh(ResourceExhausted("queue full", reason="QUEUE_FULL"))
    assert dict(queue.headers())[b"retry-after-ms"] == b"1000" and len(queue.headers()) == 2
    assert refused_headers({"limit_tokens": "x"}) == []
