"""The router's --stream-interval-ms: at most one chunk per generation per interval, paced on the worker.

Both worker hops (a Worker/Link stream and a Worker/Generate call) and both
caller calls (Inference/Generate and tokenmesh.client's GenerateStream).
Times are measured where the caller reads, so the bounds hold on a busy
machine too: counts are against the measured duration, gaps against a
fraction of the interval.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator

import pytest

from tests.support.mesh import InProcessMesh, assert_exact, in_process_mesh
from tokenmesh.client import Client
from tokenmesh.router import RouterConfig
from tokenmesh.v1 import inference_pb2

LINKS = pytest.mark.parametrize("worker_link", ["auto", "off"])
"""The router's hop to its workers: the batched Worker/Link, or one Worker/Generate call per generation."""

INTERVAL_S = 0.05

Timed = list[tuple[float, inference_pb2.GenerateChunk]]


async def timed(chunks: AsyncIterator[inference_pb2.GenerateChunk]) -> Timed:
    """Each chunk with the time it reached the caller."""
    return [(time.monotonic(), c) async for c in chunks]


def assert_paced(got: Timed, interval_s: float = INTERVAL_S) -> None:
    """One content chunk per interval at most (the first and the last not held), gaps of about the interval."""
    times = [t for t, c in got if not c.finish_reason]
    # A paced gap may land a little short of the interval (the worker's timer fires on its loop's clock, the caller
    # reads on its own): count against 0.9 of it, as the median below.
    assert len(times) <= 2 + (got[-1][0] - got[0][0]) / (interval_s * 0.9), len(times)
    # The last chunk left with the end, as soon as the generation finished: not a paced gap.
    gaps = [b - a for a, b in zip(times, times[1:-1], strict=False)]
    if gaps:  # arrival jitter on a shared machine blurs a gap, never the median
        assert min(gaps) > interval_s / 2 and statistics.median(gaps) > interval_s * 0.9, gaps


def request(n: int, request_id: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt="p", max_tokens=n, request_id=request_id)


@LINKS
async def test_dozens_of_paced_generations_get_one_chunk_per_interval_every_token_exact(worker_link: str) -> None:
    tokens = 150  # 1 ms a token: ~0.15 s alone, longer with two dozen beside it
    async with (
        in_process_mesh(backend_settings={"delay": 0.001}, worker_link=worker_link, stream_interval_ms=50) as mesh,
        Client(mesh.router.host.address) as client,  # GenerateStream, the gateway's call
    ):
        direct = [timed(mesh.inference.Generate(request(tokens))) for _ in range(12)]
        batched = [timed(client.generate(request(tokens))) for _ in range(12)]
        results = await asyncio.gather(*direct, *batched)
    for got in results:
        assert_exact([c for _, c in got], tokens)
        assert_paced(got)
        # Not held: at 1 ms a token, a first chunk held for the interval would carry ~50 tokens.
        assert got[0][1].token_count < 25
    content = sum(1 for got in results for _, c in got if not c.finish_reason)
    assert content < len(results) * tokens / 5  # unpaced, about one chunk per token


@LINKS
async def test_the_first_chunk_and_the_end_are_never_held(worker_link: str) -> None:
    async with in_process_mesh(
        backend_settings={"delay": 0.02}, worker_link=worker_link, stream_interval_ms=400
    ) as mesh:
        started = time.monotonic()
        got = await timed(mesh.inference.Generate(request(4)))
    # tok0 at ~20 ms goes as it lands; tok1..3 (at 40..80 ms) merge while held; the end releases them at ~80 ms,
    # long before the interval (400 ms) would have.
    assert [(c.seq, c.text) for _, c in got] == [(1, "tok0 "), (2, "tok1 tok2 tok3 "), (3, "")]
    assert got[0][0] - started < 0.2
    assert got[-1][0] - started < 0.3
    assert got[-1][1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert got[-1][1].usage.completion_tokens == 4 == sum(c.token_count for _, c in got)


@LINKS
async def test_resume_after_a_dropped_call_continues_exactly_and_paced(worker_link: str) -> None:
    tokens = 300
    async with in_process_mesh(
        backend_settings={"delay": 0.002}, worker_link=worker_link, stream_interval_ms=50
    ) as mesh:
        call = mesh.inference.Generate(request(tokens, request_id="paced-r"))
        first = [await call.read() for _ in range(3)]
        call.cancel()  # the caller's stream drops mid-generation; the worker keeps it for Resume
        resumed = await timed(
            mesh.inference.Resume(inference_pb2.ResumeRequest(request_id="paced-r", after_seq=first[-1].seq))
        )
    chunks = first + [c for _, c in resumed]
    assert_exact(chunks, tokens)  # every seq once, contiguous across the drop: merging only in the worker's record
    assert_paced(resumed)


async def test_interval_0_is_the_default_and_every_chunk_goes_as_it_lands(mesh: InProcessMesh) -> None:
    assert RouterConfig(workers=("127.0.0.1:1",)).stream_interval_ms == 0 == mesh.router.config.stream_interval_ms
    for backend in mesh.backends:
        backend.delay = 0.001
    results = await asyncio.gather(*(timed(mesh.inference.Generate(request(100))) for _ in range(8)))
    for got in results:
        assert_exact([c for _, c in got], 100)
    # Unpaced, a chunk merges only while its reader is behind: far more chunks than one per 50 ms.
    assert sum(len(got) for got in results) > 8 * 100 / 3
