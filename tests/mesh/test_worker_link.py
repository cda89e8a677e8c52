"""Worker/Link on a real worker over FakeBackend, called as a router would: one call, many generations."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tests.support.fakes import FakeBackend
from tests.support.mesh import wait_until
from tokenmesh.errors import from_status
from tokenmesh.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tokenmesh.worker import Worker, WorkerConfig


@dataclass
class LinkCall:
    """A Link call and what came back on it, per stream."""

    call: Any
    messages: list[tuple[float, worker_pb2.LinkEvents]] = field(default_factory=list)
    chunks: dict[int, list[tuple[int, str, int]]] = field(default_factory=dict)
    ends: dict[int, worker_pb2.LinkEnd] = field(default_factory=dict)

    async def send(self, *commands: worker_pb2.LinkCommand, credit: dict[int, int] | None = None) -> None:
        grants = credit or {}
        await self.call.write(
            worker_pb2.LinkCommands(commands=commands, credit_stream=list(grants), credit_bytes=list(grants.values()))
        )

    async def read(self) -> worker_pb2.LinkEvents | None:
        message = await self.call.read()
        if message is grpc.aio.EOF:
            return None
        self.messages.append((time.monotonic(), message))
        for i, stream in enumerate(message.chunk_stream):
            got = (message.chunk_seq[i], message.chunk_text[i], message.chunk_tokens[i])
            self.chunks.setdefault(stream, []).append(got)
        for end in message.ends:
            self.ends[end.stream] = end  # a refused start may end an id again (the router ignores it)
        return message

    async def until(self, done: Any, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                assert await self.read() is not None, "the link ended first"


def start(stream: int, request_id: str, *, window: int = 0, resumable: bool = False, **fields: Any) -> Any:
    fields.setdefault("prompt", "p")
    fields.setdefault("max_tokens", 3)
    request = inference_pb2.GenerateRequest(request_id=request_id, **fields)
    command = worker_pb2.WorkerCommand(start=request, resumable=resumable)
    return worker_pb2.LinkCommand(stream=stream, start=command, window_bytes=window)


@contextlib.asynccontextmanager
async def linked_worker(
    backend: FakeBackend, linger_s: float | None = None, **settings: Any
) -> AsyncIterator[tuple[Worker, LinkCall]]:
    """A worker and a Link call to it (linger_s: its links' linger, set past the setting's bound)."""
    worker = Worker(WorkerConfig(port=0, drain_grace_s=1, **settings), backend=backend)
    await worker.start()
    try:
        await wait_until(lambda: worker.servicer.serving)
        if linger_s is not None:
            worker.servicer.link_linger_s = linger_s
        async with grpc.aio.insecure_channel(worker.host.address) as channel:
            link = LinkCall(worker_pb2_grpc.WorkerStub(channel).Link())
            first = await link.call.read()
            assert first.settings.protocol == 1 and first.settings.default_window_bytes == 4096
            yield worker, link
            link.call.cancel()
    finally:
        await worker.shutdown()


def assert_whole(link: LinkCall, stream: int, tokens: int) -> None:
    """seq 1..N contiguous, the end's seq next, token counts adding up to the usage."""
    chunks = link.chunks[stream]
    assert [seq for seq, _, _ in chunks] == list(range(1, len(chunks) + 1))
    assert "".join(text for _, text, _ in chunks) == "".join(f"tok{i} " for i in range(tokens))
    end = link.ends[stream].event
    assert end.seq == len(chunks) + 1
    assert sum(n for _, _, n in chunks) + end.end.token_count == end.end.usage.completion_tokens == tokens


async def test_a_lone_chunk_leaves_at_once_and_a_half_closed_link_ends_after_its_streams() -> None:
    async with linked_worker(FakeBackend(delay=0.2)) as (_, link):
        sent = time.monotonic()
        await link.send(start(1, "alone", max_tokens=3))
        await link.call.done_writing()
        while await link.read() is not None:
            pass
        first_at = link.messages[0][0]
        assert first_at - sent < 0.2 + 0.15  # the engine's first token, not a batch filling up
        assert [len(m.chunk_stream) for _, m in link.messages[:3]] == [1, 1, 1]
        assert link.ends[1].event.end.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert_whole(link, 1, 3)


async def test_generations_ready_together_leave_in_one_message_merged_while_they_had_no_credit() -> None:
    async with linked_worker(FakeBackend(delay=0.001)) as (worker, link):
        # 1 byte of credit: the first chunk goes (nothing outstanding), the rest waits and merges in the record.
        await link.send(*(start(s, f"r{s}", window=1, max_tokens=5) for s in (1, 2, 3)))
        await link.until(lambda: len(link.chunks) == 3)
        records = worker.servicer.registry.records
        await wait_until(lambda: all(records[f"r{s}"].done for s in (1, 2, 3)))
        assert not link.ends
        await link.send(credit={1: 1000, 2: 1000, 3: 1000})
        message = await link.read()
        assert message is not None
        assert list(message.chunk_stream) == [1, 2, 3] and [e.stream for e in message.ends] == [1, 2, 3]
        assert set(message.chunk_text) == {"tok1 tok2 tok3 tok4 "} and set(message.chunk_seq) == {2}
        for s in (1, 2, 3):
            assert_whole(link, s, 5)


async def test_a_stream_without_credit_merges_then_ends_alone_with_reader_too_slow() -> None:
    backend = FakeBackend(delay=0, max_context=4096)
    async with linked_worker(backend, replay_buffer_bytes=4096) as (worker, link):
        await link.send(start(1, "slow", window=1, max_tokens=2000), start(2, "fine", max_tokens=20))
        await link.until(lambda: len(link.ends) == 2)
        error = from_status(link.ends[1].status)
        assert error.grpc_code is grpc.StatusCode.RESOURCE_EXHAUSTED and error.reason == "READER_TOO_SLOW"
        assert_whole(link, 2, 20)
        assert "slow" not in worker.servicer.registry.records  # not resumable: cancelled


async def test_a_refused_start_ends_its_stream_with_the_status_and_the_link_goes_on() -> None:
    async with linked_worker(FakeBackend()) as (_, link):
        await link.send(start(1, "a", model="nope"), start(2, ""), start(3, "ok"))
        await link.until(lambda: len(link.ends) == 3)
        missing = from_status(link.ends[1].status)
        assert missing.grpc_code is grpc.StatusCode.NOT_FOUND and missing.reason == "MODEL_NOT_SERVED"
        assert from_status(link.ends[2].status).grpc_code is grpc.StatusCode.INVALID_ARGUMENT
        assert_whole(link, 3, 3)
        await link.send(start(3, "reused"), start(4, "after"))
        await link.until(lambda: 4 in link.ends)
        reused = from_status(link.ends[3].status)
        assert reused.grpc_code is grpc.StatusCode.INVALID_ARGUMENT and "stream ids" in reused.message
        assert_whole(link, 4, 3)


async def test_cancel_ends_a_stream_cancelled_and_leaves_the_others() -> None:
    backend = FakeBackend(delay=0.02)
    async with linked_worker(backend) as (_, link):
        await link.send(start(1, "stop-me", max_tokens=200), start(2, "keep", max_tokens=10))
        await link.until(lambda: 1 in link.chunks)
        await link.send(worker_pb2.LinkCommand(stream=1, cancel=worker_pb2.CancelGeneration(reason="caller")))
        await link.until(lambda: len(link.ends) == 2)
        assert link.ends[1].event.end.finish_reason == inference_pb2.FINISH_REASON_CANCELLED
        assert_whole(link, 2, 10)
        seqs = [seq for seq, _, _ in link.chunks[1]]
        assert seqs == list(range(1, len(seqs) + 1)) and link.ends[1].event.seq == len(seqs) + 1


async def test_a_dropped_link_leaves_resumable_generations_for_attach_and_cancels_the_rest() -> None:
    backend = FakeBackend(delay=0.02)
    async with linked_worker(backend) as (worker, link):
        await link.send(
            start(1, "keep", resumable=True, max_tokens=30),
            start(2, "drop", max_tokens=30),
            start(3, "detached", resumable=True, max_tokens=30),
            start(4, "detached-gone", max_tokens=30),
        )
        await link.until(lambda: len(link.chunks) == 4)
        await link.send(
            worker_pb2.LinkCommand(stream=3, detach=worker_pb2.LinkDetach()),
            worker_pb2.LinkCommand(stream=4, detach=worker_pb2.LinkDetach()),
        )
        records = worker.servicer.registry.records
        await wait_until(lambda: "detached-gone" not in records)
        link.call.cancel()
        await wait_until(lambda: "drop" not in records)
        assert not records["keep"].done and not records["detached"].done
        cancelled = {g.params.request_id for g in backend.started if g.cancelled.is_set()}
        assert cancelled == {"drop", "detached-gone"}
        seen = link.chunks[1][-1][0]
        async with grpc.aio.insecure_channel(worker.host.address) as channel:
            attach = worker_pb2.AttachRequest(request_id="keep", after_seq=seen)
            events = [e async for e in worker_pb2_grpc.WorkerStub(channel).Attach(attach, timeout=5)]
        assert [e.seq for e in events] == list(range(seen + 1, seen + 1 + len(events)))
        assert events[-1].end.finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_a_send_lingers_for_the_links_other_streams_within_its_bound_and_never_for_a_lone_one() -> None:
    worker = Worker(WorkerConfig(port=0, link_linger_us=1000), backend=FakeBackend())
    assert worker.servicer.link_linger_s == 0.001  # --link-linger-us
    # Half a second (the setting's bound is 1 ms), so that a busy machine cannot blur what is measured.
    async with linked_worker(FakeBackend(delay=0.1), linger_s=0.5) as (_, link):
        sent = time.monotonic()
        await link.send(start(1, "alone", max_tokens=2))
        await link.until(lambda: 1 in link.chunks)
        assert link.messages[-1][0] - sent < 0.1 + 0.3  # alone on the link: its chunk leaves as it lands
        await link.until(lambda: 1 in link.ends)
        for s in (2, 3, 4):  # chunks due 30 ms apart: without a linger, a message each
            await link.send(start(s, f"p{s}", max_tokens=3))
            await asyncio.sleep(0.03)
        await link.until(lambda: all(len(link.chunks.get(s, ())) >= 2 for s in (2, 3, 4)))
        carrying = [sorted(set(m.chunk_stream)) for _, m in link.messages if set(m.chunk_stream) - {1}]
        assert carrying[:3] == [[2], [3], [4]]  # a first chunk (the TTFT) is never held
        assert carrying[3] == [2, 3, 4]  # the second ones gathered: every stream was ready before the bound
        await link.until(lambda: len(link.ends) == 4)
        # Stream 5 gets its first chunk, then no credit: not ready again before it finishes. Each later send of
        # stream 6 waits the whole linger for it, and no longer, but for its end, which is never held.
        await link.send(start(5, "starved", window=1, max_tokens=20), start(6, "goes", max_tokens=14))
        await link.until(lambda: 6 in link.ends)
        times = [t for t, m in link.messages if 6 in m.chunk_stream or any(e.stream == 6 for e in m.ends)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert len(gaps) >= 3 and all(0.45 < g < 0.5 + 0.1 + 0.3 for g in gaps[1:-1]), gaps
        assert gaps[-1] < 0.45  # the end left as it came
        await link.send(credit={5: 1000})  # alone now: no linger
        await link.until(lambda: 5 in link.ends)
        for s, tokens in ((1, 2), (2, 3), (3, 3), (4, 3), (5, 20), (6, 14)):
            assert_whole(link, s, tokens)


async def test_a_paced_stream_leaves_once_per_interval_and_no_linger_waits_for_it_while_held() -> None:
    # A half-second linger (past the setting's bound, as above): were the held stream waited for, the other
    # stream's sends would wait until its interval is over.
    async with linked_worker(FakeBackend(delay=0.002), linger_s=0.5) as (_, link):
        paced = start(1, "paced", max_tokens=300)
        paced.start.stream_interval_ms = 500
        sent = time.monotonic()
        await link.send(paced, start(2, "free", max_tokens=3))
        await link.until(lambda: 2 in link.ends)
        assert time.monotonic() - sent < 0.25  # 3 tokens at 2 ms, each sent as it landed
        await link.until(lambda: 1 in link.ends)
        assert_whole(link, 1, 300)
        assert_whole(link, 2, 3)
        times = [t for t, m in link.messages if 1 in m.chunk_stream]
        assert link.chunks[1][0][2] < 20  # the first chunk was not held (~250 tokens an interval)
        assert len(times) <= 2 + (times[-1] - times[0]) / 0.5
        # The last chunk left with the end, as soon as the generation finished: not a paced gap.
        gaps = [b - a for a, b in zip(times, times[1:-1], strict=False)]
        assert gaps and min(gaps) > 0.5 * 0.9, gaps
