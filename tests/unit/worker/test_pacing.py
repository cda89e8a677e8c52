"""A paced record (the router's --stream-interval-ms): a reader takes at most one chunk per interval.

The record alone, no gRPC: chunks are appended by hand, as the worker's pump
appends the engine's output, and a reader is the record's own stream (what
Worker/Generate and Attach relay).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from tests.support.fakes import FakeBackend
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker import GenerationParams, Record

INTERVAL = 0.2
"""Long against a busy machine's scheduling noise, so that what is measured is the pacing."""


def record(interval_s: float = INTERVAL) -> Record:
    generation = FakeBackend().generate(GenerationParams(model="fake", prompt="p"))
    return Record("paced", 1, 0, generation, max_bytes=64 * 1024, interval_s=interval_s)


def chunk(text: str) -> worker_pb2.WorkerEvent:
    return worker_pb2.WorkerEvent(chunk=worker_pb2.TokenChunk(text=text, token_count=1))


def end(tokens: int) -> worker_pb2.WorkerEvent:
    usage = inference_pb2.Usage(prompt_tokens=1, completion_tokens=tokens)
    return worker_pb2.WorkerEvent(
        end=worker_pb2.GenerationEnd(finish_reason=inference_pb2.FINISH_REASON_LENGTH, usage=usage)
    )


async def timed(reader: AsyncIterator[worker_pb2.WorkerEvent]) -> tuple[float, worker_pb2.WorkerEvent]:
    event = await anext(reader)
    return time.monotonic(), event


async def produce(target: Record, texts: list[str], every_s: float) -> None:
    """Append one chunk per every_s, as an engine streams tokens."""
    for text in texts:
        target.append(chunk(text))
        await asyncio.sleep(every_s)


async def test_a_paced_reader_takes_one_chunk_per_interval_and_the_rest_merges_into_it() -> None:
    paced = record()
    reader = paced.stream(0)
    started = time.monotonic()
    paced.append(chunk("t0 "))
    first_at, first = await timed(reader)
    assert first_at - started < INTERVAL / 2 and (first.seq, first.chunk.text) == (1, "t0 ")  # never held
    tokens = [f"t{i} " for i in range(1, 40)]
    engine = asyncio.create_task(produce(paced, tokens, 0.01))  # 10 ms a token: ~20 tokens per interval
    got = [(first_at, first)]
    while sum(e.chunk.token_count for _, e in got) < 40:
        got.append(await timed(reader))
    await engine
    produced = time.monotonic() - first_at  # ~0.4 s, more on a busy machine
    gaps = [b - a for (a, _), (b, _) in zip(got, got[1:], strict=False)]
    assert all(gap >= INTERVAL * 0.95 for gap in gaps), gaps  # the loop's timer may fire a hair early
    assert len(got) <= 2 + produced / INTERVAL  # the first, then one chunk per interval: not 40
    assert [e.seq for _, e in got] == list(range(1, len(got) + 1))
    assert "".join(e.chunk.text for _, e in got) == "".join(["t0 ", *tokens])
    # A resume sees exactly the chunks the live reader saw: merging happened in the record only.
    replay = [e async for e in _until_done(paced, 0)]
    assert [(e.seq, e.chunk.text) for e in replay[: len(got)]] == [(e.seq, e.chunk.text) for _, e in got]
    await reader.aclose()


async def _until_done(target: Record, after_seq: int) -> AsyncIterator[worker_pb2.WorkerEvent]:
    target.append(end(40))
    target.finish()
    async for event in target.stream(after_seq):
        yield event


async def test_the_end_releases_a_held_chunk_at_once_with_itself() -> None:
    paced = record(interval_s=10.0)  # nothing here may wait for it
    reader = paced.stream(0)
    paced.append(chunk("a "))
    assert (await anext(reader)).chunk.text == "a "
    paced.append(chunk("b "))
    paced.append(chunk("c "))
    held = asyncio.create_task(timed(reader))
    await asyncio.sleep(0.1)
    assert not held.done()  # the tail waits for its interval, merging
    ended = time.monotonic()
    paced.append(end(3))
    paced.finish()
    at, tail = await asyncio.wait_for(held, 1)
    assert at - ended < 0.5 and (tail.seq, tail.chunk.text, tail.chunk.token_count) == (2, "b c ", 2)
    last = await asyncio.wait_for(anext(reader), 1)
    assert last.seq == 3 and last.end.usage.completion_tokens == 3


async def test_a_generation_stopped_while_a_chunk_is_held_releases_it() -> None:
    paced = record(interval_s=10.0)
    reader = paced.stream(0)
    paced.append(chunk("a "))
    await anext(reader)
    paced.append(chunk("b "))
    held = asyncio.create_task(anext(reader))
    await asyncio.sleep(0.05)
    paced.finish()  # the pump was cancelled: no end event, only done
    assert (await asyncio.wait_for(held, 1)).chunk.text == "b "
    assert [e async for e in reader] == []


async def test_a_replay_goes_at_once_and_only_the_live_tail_is_held() -> None:
    paced = record(interval_s=0.0)
    live = paced.stream(0)
    for i in range(5):  # read one by one: five fixed chunks, no merging
        paced.append(chunk(f"t{i} "))
        await anext(live)
    paced.interval_s = 10.0  # as if the generation had been paced from the start: only new readers see it now
    paced.append(chunk("t5 "))  # the live tail: still growing
    started = time.monotonic()
    attach = paced.stream(2)
    replayed = [await asyncio.wait_for(anext(attach), 1) for _ in range(3)]
    assert time.monotonic() - started < 0.5
    assert [e.seq for e in replayed] == [3, 4, 5]  # seq 3 (the first taken), 4 and 5 are behind the tail
    tail = asyncio.create_task(anext(attach))
    await asyncio.sleep(0.1)
    assert not tail.done()
    paced.append(chunk("t6 "))  # merges into the held tail
    paced.append(end(7))
    paced.finish()
    assert (await asyncio.wait_for(tail, 1)).chunk.text == "t5 t6 "
    await live.aclose()
    await attach.aclose()


async def test_without_an_interval_every_chunk_is_taken_as_it_lands() -> None:
    unpaced = record(interval_s=0.0)
    reader = unpaced.stream(0)
    texts = []
    for i in range(20):
        unpaced.append(chunk(f"t{i} "))
        texts.append((await asyncio.wait_for(anext(reader), 1)).chunk.text)
    assert texts == [f"t{i} " for i in range(20)] and unpaced.total == 20
    await reader.aclose()
