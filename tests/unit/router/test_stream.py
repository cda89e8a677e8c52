"""The router's side of a GenerateStream call over scripted streams: batching, budget, credit, refusals, ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmesh.errors import InvalidArgument
from tokenmesh.router import _stream
from tokenmesh.router._stream import StreamContext, Streams, StreamSession
from tokenmesh.v1 import inference_pb2


class FakeCall:
    """The GenerateStream call's context: no deadline, one metadata entry."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("traceparent", "call"), ("x-call", "1"))


class Script:
    """Sources fed by the test: each stream's chunks (or the error that ends it) go through a queue."""

    def __init__(self) -> None:
        self.queues: dict[int, asyncio.Queue[Any]] = {}
        self.contexts: dict[int, StreamContext] = {}
        self.pulled: dict[int, int] = {}
        self.opened = 0
        self.commands: asyncio.Queue[inference_pb2.StreamCommands | None] = asyncio.Queue()

    def source(
        self, command: inference_pb2.StreamCommand, context: StreamContext
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        queue = self.queues.setdefault(command.stream, asyncio.Queue())
        self.contexts[command.stream] = context
        self.pulled[command.stream] = 0
        return self._follow(command.stream, queue)

    async def _follow(self, stream: int, queue: asyncio.Queue[Any]) -> AsyncIterator[inference_pb2.GenerateChunk]:
        seq = 0
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            seq += 1
            self.pulled[stream] += 1
            yield inference_pb2.GenerateChunk(request_id=f"r{stream}", seq=seq, text=item[0], finish_reason=item[1])
            if item[1]:
                return

    def put(self, stream: int, text: str = "tok ", *, final: bool = False) -> None:
        reason = inference_pb2.FINISH_REASON_LENGTH if final else inference_pb2.FINISH_REASON_UNSPECIFIED
        self.queues.setdefault(stream, asyncio.Queue()).put_nowait((text, reason))

    async def requests(self) -> AsyncIterator[inference_pb2.StreamCommands]:
        while (message := await self.commands.get()) is not None:
            yield message

    def send(self, *commands: inference_pb2.StreamCommand, credit: dict[int, int] | None = None) -> None:
        message = inference_pb2.StreamCommands(commands=commands)
        for stream, size in (credit or {}).items():
            message.credit_stream.append(stream)
            message.credit_bytes.append(size)
        self.commands.put_nowait(message)

    def count(self, change: int) -> None:
        self.opened += change


def start(stream: int, **options: Any) -> inference_pb2.StreamCommand:
    return inference_pb2.StreamCommand(stream=stream, generate=inference_pb2.GenerateRequest(prompt="p"), **options)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def opened(
    script: Script, announced: inference_pb2.StreamSettings | None = None, linger_s: float = 0.0
) -> tuple[StreamSession, AsyncIterator[inference_pb2.StreamEvents]]:
    async def cancel(context: StreamContext) -> None:
        return None

    session = StreamSession(
        FakeCall(),  # type: ignore[arg-type]
        Streams(script.source, cancel, script.count, lambda: False),
        announced,
        linger_s,
    )
    return session, session.run(script.requests())


def columns(message: inference_pb2.StreamEvents) -> list[tuple[int, int, str]]:
    return [(s, c.seq, c.text) for s, c in zip(message.chunk_stream, message.chunks, strict=True)]


async def test_a_lone_chunk_leaves_at_once_and_what_comes_during_a_write_leaves_in_one_message() -> None:
    script = Script()
    session, events = opened(script)
    settings = (await anext(events)).settings
    assert (settings.protocol, settings.default_window_bytes) == (1, 64 * 1024)
    script.send(start(1), start(2), start(3))
    script.put(1, "a")
    assert columns(await anext(events)) == [(1, 1, "a")]
    # The caller has that message; while it was being written, three streams produced.
    script.put(2, "b")
    script.put(1, "c")
    script.put(3, "d", final=True)
    await settle()
    assert columns(await anext(events)) == [(2, 1, "b"), (1, 2, "c"), (3, 1, "d")]  # in the order they came
    assert sorted(session.streams) == [1, 2] and script.opened == 2  # 3 ended with its final chunk
    script.put(1, "e", final=True)
    script.put(2, "f", final=True)
    script.commands.put_nowait(None)  # half-close: the call ends after the last stream
    rest = [m async for m in events]
    assert sorted(t for m in rest for t in columns(m)) == [(1, 3, "e"), (2, 2, "f")]
    assert script.opened == 0


async def test_a_message_stays_within_max_batch_bytes_and_the_rest_leads_the_next() -> None:
    script = Script()
    _, events = opened(script)
    await anext(events)
    big = "x" * 100_000  # over the default window: goes while the credit is at least 3/4 of it
    script.send(start(1), start(2), start(3))
    for stream in (1, 2, 3):
        script.put(stream, big)
    await settle()
    first, second = await anext(events), await anext(events)
    assert [s for s, _, _ in columns(first)] == [1, 2]  # a third would pass 256 KiB
    assert [s for s, _, _ in columns(second)] == [3]
    assert first.ByteSize() < 256 * 1024


async def test_a_stream_without_credit_pulls_nothing_until_credit_comes_and_holds_no_other_back() -> None:
    script = Script()
    _, events = opened(script)
    await anext(events)
    script.send(start(1, window_bytes=100), start(2))
    for _ in range(10):
        script.put(1, "abcd")  # 20 bytes each with the overhead: 5 fit in 100
    script.put(2, "z", final=True)
    await settle()
    message = await anext(events)
    assert [s for s, _, _ in columns(message)].count(1) == 5 and (2, 1, "z") in columns(message)
    assert script.pulled[1] == 6  # the sixth waits for credit in the generation's hands: nothing more is pulled
    script.send(credit={1: 40})
    await settle()
    assert [seq for _, seq, _ in columns(await anext(events))] == [6, 7]
    assert script.pulled[1] == 8


async def test_refused_starts_end_alone_and_errors_become_the_streams_status() -> None:
    script = Script()
    session, events = opened(script, _stream.settings(max_streams=2))
    await anext(events)
    script.send(start(0), start(1), start(2), start(3), start(1), start(4, timeout_s=float("nan")))
    await settle()
    ends = {e.stream: e.status for e in (await anext(events)).ends}
    assert ends[0].code == ends[1].code == ends[4].code == 3  # INVALID_ARGUMENT
    assert "commands.stream 1 is not above 3" in ends[1].message  # and the live stream 1 was let go of
    assert ends[3].code == 8 and "carries 2 streams already" in ends[3].message  # RESOURCE_EXHAUSTED
    assert "commands.timeout_s must be a number of seconds >= 0" in ends[4].message
    assert sorted(session.streams) == [2]
    script.queues[2].put_nowait(InvalidArgument("bad", field="prompt"))
    await settle()
    (end,) = (await anext(events)).ends
    assert (end.stream, end.status.code, end.status.message) == (2, 3, "bad")
    assert script.opened == 0


async def test_a_streams_context_merges_its_metadata_over_the_calls_and_bounds_its_time() -> None:
    script = Script()
    _, events = opened(script)
    await anext(events)
    script.send(start(1, timeout_s=30, metadata={"traceparent": "own"}), start(2))
    await settle()
    own, inherited = script.contexts[1], script.contexts[2]
    assert dict(own.invocation_metadata()) == {"traceparent": "own", "x-call": "1"}
    assert dict(inherited.invocation_metadata()) == {"traceparent": "call", "x-call": "1"}
    remaining = own.time_remaining()
    assert remaining is not None and 29 < remaining <= 30
    assert inherited.time_remaining() is None


async def test_a_busy_call_lingers_for_its_other_streams_but_never_holds_a_first_chunk_or_a_quiet_call() -> None:
    script = Script()
    _, events = opened(script, linger_s=0.3)  # far above a loop turn, so a busy machine cannot blur it
    await anext(events)
    script.send(start(1), start(2), start(3))
    script.put(1, "a")
    script.put(2, "b")
    assert columns(await anext(events)) == [(1, 1, "a"), (2, 1, "b")]  # first chunks: at once
    script.put(1, "c")  # busy (the last message just left), stream 3 not ready: this send waits for it
    sent = time.monotonic()
    pending = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.1)
    assert not pending.done()
    script.put(2, "d")
    script.put(3, "e")  # every stream ready: the wait ends before its bound
    assert columns(await pending) == [(1, 2, "c"), (2, 2, "d"), (3, 1, "e")]
    assert time.monotonic() - sent < 0.3
    script.put(1, "f")  # busy again, 2 and 3 silent: waits the whole bound, and no longer
    sent = time.monotonic()
    assert columns(await anext(events)) == [(1, 3, "f")]
    assert 0.25 < time.monotonic() - sent < 0.3 + 0.2
    await asyncio.sleep(0.4)  # quiet now: the next send goes at once
    script.put(2, "g")
    sent = time.monotonic()
    assert columns(await anext(events)) == [(2, 3, "g")]
    assert time.monotonic() - sent < 0.15
