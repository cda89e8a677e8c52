"""The router's side of a Worker/Link session over a scripted call: demux, credit, ends, failure, retirement."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tokenmesh.errors import ResourceExhausted
from tokenmesh.router._link import LinkSession
from tokenmesh.router._outcome import WorkerFailed
from tokenmesh.v1 import inference_pb2, worker_pb2


class ScriptedCall:
    """What the session writes, and whether it cancelled the call."""

    def __init__(self) -> None:
        self.written: list[worker_pb2.LinkCommands] = []
        self.cancelled = False

    async def write(self, message: worker_pb2.LinkCommands) -> None:
        self.written.append(message)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def session(window: int = 4096, max_batch: int = 256 * 1024) -> tuple[LinkSession, ScriptedCall]:
    call = ScriptedCall()
    settings = worker_pb2.LinkSettings(protocol=1, default_window_bytes=window, max_batch_bytes=max_batch)
    return LinkSession(call, settings), call


def events(*chunks: tuple[int, int, str], ends: list[worker_pb2.LinkEnd] | None = None, **ttft: Any) -> Any:
    message = worker_pb2.LinkEvents(ends=ends or [])
    for stream, seq, text in chunks:
        message.chunk_stream.append(stream)
        message.chunk_seq.append(seq)
        message.chunk_text.append(text)
        message.chunk_tokens.append(1)
    for stream, ms in ttft.items():
        message.engine_ttft_ms[int(stream.removeprefix("s"))] = ms
    return message


async def flushed(link: LinkSession) -> None:
    writer = asyncio.create_task(link.write_loop())
    for _ in range(3):
        await asyncio.sleep(0)
    writer.cancel()


async def test_one_message_feeds_every_attempt_on_it_in_seq_order() -> None:
    link, _ = session()
    one, two = link.attempt(), link.attempt()
    end = worker_pb2.WorkerEvent(seq=2, end=worker_pb2.GenerationEnd(finish_reason=inference_pb2.FINISH_REASON_STOP))
    link.deliver(events((1, 1, "a"), (2, 1, "x"), (1, 2, "b"), s2=7.5, ends=[worker_pb2.LinkEnd(stream=2, event=end)]))
    assert [(e.seq, e.chunk.text) for e in [await one.read(), await one.read()]] == [(1, "a"), (2, "b")]
    first = await two.read()
    assert (first.chunk.text, first.chunk.engine_ttft_ms) == ("x", 7.5)
    assert (await two.read()).end.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert 2 not in link.streams and two.done()
    reading = asyncio.create_task(one.read())
    await asyncio.sleep(0)
    assert not reading.done()  # nothing yet: it waits, the reader never waits for it
    link.deliver(events((1, 3, "c")))
    assert (await reading).seq == 3


async def test_credit_goes_back_in_quarter_windows_in_one_message_with_the_commands() -> None:
    link, call = session(window=4096)
    attempt = link.attempt()
    link.deliver(events(*((1, seq, "t" * 100) for seq in range(1, 11))))
    for _ in range(8):
        await attempt.read()  # 8 x 116 = 928 < 1024: nothing owed back yet
    await flushed(link)
    assert call.written == []
    await attempt.read()
    await attempt.write(worker_pb2.WorkerCommand(cancel=worker_pb2.CancelGeneration(reason="Cancel")))
    await flushed(link)
    (message,) = call.written
    assert (list(message.credit_stream), list(message.credit_bytes)) == ([1], [9 * 116])
    assert [c.WhichOneof("command") for c in message.commands] == ["cancel"]


async def test_a_status_end_raises_what_its_own_call_would_and_a_broken_link_fails_every_attempt() -> None:
    link, _ = session()
    refused, running, waiting = link.attempt(), link.attempt(), link.attempt()
    status = ResourceExhausted("worker is at its limit", reason="WORKER_AT_LIMIT").status()
    link.deliver(events((2, 1, "a"), ends=[worker_pb2.LinkEnd(stream=1, status=status)]))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await refused.read()
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    pending = asyncio.create_task(waiting.read())
    await asyncio.sleep(0)
    reset = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "reset")
    link.fail(reset)
    assert (await running.read()).chunk.text == "a"  # what came before the break is delivered first
    with pytest.raises(WorkerFailed) as first:
        await running.read()
    with pytest.raises(WorkerFailed) as second:
        await pending
    assert first.value.kind == second.value.kind == "link_unavailable" and first.value is not second.value
    assert "link broke: UNAVAILABLE: reset" in str(first.value)
    assert not link.streams


async def test_cancel_detaches_a_live_stream_only_and_a_retired_session_closes_after_its_last() -> None:
    link, call = session()
    live, ended = link.attempt(), link.attempt()
    end = worker_pb2.WorkerEvent(seq=1, end=worker_pb2.GenerationEnd())
    link.deliver(events(ends=[worker_pb2.LinkEnd(stream=2, event=end)]))
    link.retire()
    assert not call.cancelled  # one attempt still runs on it
    reading = asyncio.create_task(live.read())
    await asyncio.sleep(0)
    assert live.cancel() and ended.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading  # a stall's cancel: the read gives up
    assert call.cancelled
    await flushed(link)
    (message,) = call.written
    assert [(c.stream, c.WhichOneof("command")) for c in message.commands] == [(1, "detach")]


async def test_starts_queued_during_a_write_are_split_to_stay_under_the_batch_limit() -> None:
    link, call = session(max_batch=3000)
    for _ in range(3):
        start = worker_pb2.WorkerCommand(start=inference_pb2.GenerateRequest(prompt="p" * 1400, request_id="r"))
        await link.attempt().write(start)
    await flushed(link)
    assert [len(m.commands) for m in call.written] == [2, 1]
