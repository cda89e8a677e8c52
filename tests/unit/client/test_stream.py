"""The client's side of a GenerateStream call over a scripted call: demux, credit, ends, breaks, fallback, renewal."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from tokenmesh.client._sessions import Sessions
from tokenmesh.client._stream import StreamSession
from tokenmesh.errors import NotFound, from_rpc_error
from tokenmesh.v1 import inference_pb2

LENGTH = inference_pb2.FINISH_REASON_LENGTH


class ScriptedCall:
    """A GenerateStream call whose reads the test scripts; what the session writes, and whether it cancelled."""

    def __init__(self, *answers: Any) -> None:
        self.answers: asyncio.Queue[Any] = asyncio.Queue()
        for answer in answers:
            self.answers.put_nowait(answer)
        self.written: list[inference_pb2.StreamCommands] = []
        self.cancelled = False

    async def read(self) -> Any:
        answer = await self.answers.get()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def write(self, message: inference_pb2.StreamCommands) -> None:
        self.written.append(message)

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def commands(self) -> list[tuple[int, str]]:
        """Every command written so far as (stream, kind), in order."""
        return [(c.stream, c.WhichOneof("command") or "") for m in self.written for c in m.commands]


def settings(window: int = 4096, max_batch: int = 256 * 1024, max_streams: int = 0) -> inference_pb2.StreamEvents:
    return inference_pb2.StreamEvents(
        settings=inference_pb2.StreamSettings(
            protocol=1, default_window_bytes=window, max_batch_bytes=max_batch, max_streams=max_streams
        )
    )


def session(**kwargs: Any) -> tuple[StreamSession, ScriptedCall]:
    call = ScriptedCall()
    return StreamSession("router:1", call, settings(**kwargs).settings), call


def start(link: StreamSession, request_id: str = "r", deadline: float | None = None) -> Any:
    command = inference_pb2.StreamCommand(generate=inference_pb2.GenerateRequest(prompt="p", request_id=request_id))
    return link.start(command, deadline)


def events(
    *chunks: tuple[int, int, str], final: tuple[int, int] = (0, 0), ends: list[inference_pb2.StreamEnd] | None = None
) -> Any:
    """chunks (stream, seq, text); the chunk final (stream, seq), if any, is its stream's last."""
    message = inference_pb2.StreamEvents(ends=ends or [])
    for stream, seq, text in chunks:
        message.chunk_stream.append(stream)
        last = (stream, seq) == final
        message.chunks.add(seq=seq, text=text, token_count=1, finish_reason=LENGTH if last else 0)
    return message


async def flushed(link: StreamSession) -> None:
    writer = asyncio.create_task(link.write_loop())
    for _ in range(3):
        await asyncio.sleep(0)
    writer.cancel()


async def read_all(stream: Any) -> list[inference_pb2.GenerateChunk]:
    return [chunk async for chunk in stream]


async def test_one_message_feeds_every_stream_in_seq_order_and_a_final_chunk_ends_one() -> None:
    link, _ = session()
    one, two = start(link, "a"), start(link, "b")
    link.deliver(events((1, 1, "a"), (2, 1, "x"), (1, 2, "b"), (2, 2, "y"), final=(2, 2)))
    assert [(c.seq, c.text) for c in await read_all(two)] == [(1, "x"), (2, "y")]
    assert 2 not in link.streams and two.done()
    assert [(c.seq, c.text) for c in [await one.__anext__(), await one.__anext__()]] == [(1, "a"), (2, "b")]
    reading = asyncio.create_task(one.__anext__())
    await asyncio.sleep(0)
    assert not reading.done()  # nothing yet: it waits, the reader never waits for it
    link.deliver(events((1, 3, "c")))
    assert (await reading).seq == 3


async def test_a_stream_end_raises_the_error_its_own_call_would_with_the_status_details() -> None:
    link, _ = session()
    stream = start(link)
    status = NotFound("no generation 'r'", reason="GENERATION_NOT_FOUND").status()
    link.deliver(events(ends=[inference_pb2.StreamEnd(stream=1, status=status)]))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await read_all(stream)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    error = from_rpc_error(raised.value)
    assert isinstance(error, NotFound) and error.reason == "GENERATION_NOT_FOUND" and error.answered
    assert not link.streams


async def test_credit_goes_back_in_quarter_windows_in_one_message_with_the_commands() -> None:
    link, call = session(window=4096)
    stream = start(link)
    await flushed(link)
    assert call.commands() == [(1, "generate")] and not call.written[0].credit_stream
    link.deliver(events(*((1, seq, "t" * 100) for seq in range(1, 11))))
    for _ in range(8):
        await stream.__anext__()  # 8 x 116 = 928 < 1024: nothing owed back yet
    await flushed(link)
    assert len(call.written) == 1
    await stream.__anext__()  # 1044: a quarter of the window owed
    other = start(link, "o")
    await flushed(link)
    (message,) = call.written[1:]
    assert [(c.stream, c.WhichOneof("command")) for c in message.commands] == [(other.stream, "generate")]
    assert (list(message.credit_stream), list(message.credit_bytes)) == ([1], [9 * 116])


async def test_a_final_chunk_returns_no_credit() -> None:
    link, call = session(window=64)  # a quarter is 16: every chunk would be returned
    stream = start(link)
    await flushed(link)
    link.deliver(events((1, 1, "abc")))
    assert (await stream.__anext__()).text == "abc"
    await flushed(link)
    link.deliver(events((1, 2, "de"), final=(1, 2)))
    assert [c.text for c in await read_all(stream)] == ["de"]
    await flushed(link)
    credit = [(s, b) for m in call.written for s, b in zip(m.credit_stream, m.credit_bytes, strict=True)]
    assert credit == [(1, 3 + 16)]


async def test_the_writer_keeps_each_message_under_max_batch_bytes() -> None:
    link, call = session(max_batch=4096)
    for i in range(6):
        command = inference_pb2.StreamCommand(generate=inference_pb2.GenerateRequest(prompt="x" * 1500))
        link.start(command, None)
        assert command.stream == i + 1
    await flushed(link)
    assert [len(m.commands) for m in call.written] == [2, 2, 2]
    assert all(m.ByteSize() <= 4096 for m in call.written)


async def test_a_broken_call_breaks_every_stream_on_it_as_a_broken_generate_would() -> None:
    link, call = session()
    streams = [start(link, f"s{i}") for i in range(30)]
    link.deliver(events(*((s.stream, 1, "x") for s in streams)))
    call.answers.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details="reset"))
    await link.serve_task()
    assert call.cancelled and not link.open and not link.streams
    errors = []
    for stream in streams:
        assert (await stream.__anext__()).text == "x"  # what arrived before the break is read first
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stream.__anext__()
        errors.append(raised.value)
    assert {e.code() for e in errors} == {grpc.StatusCode.UNAVAILABLE}
    assert len({id(e) for e in errors}) == 30  # one each: raised in 30 tasks
    assert not from_rpc_error(errors[0]).answered  # a broken call, not the router's answer: resumed


async def test_a_call_ending_with_a_code_that_is_not_a_break_still_breaks_its_streams_unavailable() -> None:
    link, call = session()
    stream = start(link)
    call.answers.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, None, None, details="big"))
    await link.serve_task()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stream.__anext__()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and "RESOURCE_EXHAUSTED" in raised.value.details()
    ended, ended_call = session()
    waiting = start(ended)
    ended_call.answers.put_nowait(grpc.aio.EOF)  # the router ended the call with a stream on it
    await ended.serve_task()
    with pytest.raises(grpc.aio.AioRpcError, match="ended the GenerateStream call"):
        await waiting.__anext__()


async def test_letting_go_detaches_and_a_made_up_id_is_cancelled_first() -> None:
    link, call = session()
    kept, dropped, over = start(link, "kept"), start(link, "dropped"), start(link, "over")
    link.deliver(events((3, 1, "x"), final=(3, 1)))
    assert kept.cancel() and not kept.cancel()
    assert dropped.let_go(cancel=True)
    assert not over.let_go(cancel=True)  # ended: nothing to send (the caller falls back to Inference/Cancel)
    await flushed(link)
    assert call.commands() == [(1, "generate"), (2, "generate"), (3, "generate"), (1, "detach"), (2, "cancel"),
                               (2, "detach")]  # fmt: skip
    assert not link.streams
    link.deliver(events((1, 2, "late"), (2, 2, "late")))  # sent before the router read the detach: dropped
    assert await read_all(kept) == [] and await read_all(dropped) == []


async def test_a_streams_deadline_ends_it_deadline_exceeded_and_detaches_it() -> None:
    link, call = session()
    stream = start(link, deadline=time.monotonic() + 0.05)
    other = start(link, deadline=time.monotonic() + 60)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await read_all(stream)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await flushed(link)
    assert (1, "detach") in call.commands() and list(link.streams) == [other.stream]
    link.deliver(events((2, 1, "x"), final=(2, 1)))
    assert [c.text for c in await read_all(other)] == ["x"]  # its timer went with its end


async def test_a_router_that_answers_unimplemented_is_remembered_until_renewal() -> None:
    opened: list[str] = []

    def open_call(address: str) -> ScriptedCall:
        opened.append(address)
        if address == "old:1":
            return ScriptedCall(grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, None, None, details="no"))
        return ScriptedCall(settings())

    sessions = Sessions(open_call)
    assert await sessions.get("old:1") is None
    assert await sessions.get("old:1") is None
    new = await sessions.get("new:1")
    assert new is not None and await sessions.get("new:1") is new
    assert opened == ["old:1", "new:1"]  # asked once each
    sessions.renew()
    assert await sessions.get("old:1") is None and opened == ["old:1", "new:1", "old:1"]
    assert new.retired and new.call.cancelled  # nothing on it: closed at once
    await sessions.close()


async def test_generations_starting_together_share_one_opening_and_each_gets_its_own_error() -> None:
    calls: list[ScriptedCall] = []

    def open_call(address: str) -> ScriptedCall:
        calls.append(ScriptedCall())
        return calls[-1]

    sessions = Sessions(open_call)
    waiting = [asyncio.create_task(sessions.get("router:1")) for _ in range(20)]
    await asyncio.sleep(0.01)
    calls[0].answers.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details="refused"))
    errors = await asyncio.gather(*waiting, return_exceptions=True)
    assert len(calls) == 1 and calls[0].cancelled
    assert all(isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE for e in errors)
    assert len({id(e) for e in errors}) == 20
    opening = asyncio.create_task(sessions.get("router:1"))  # the next use opens a new call
    await asyncio.sleep(0.01)
    calls[1].answers.put_nowait(settings(window=1024))
    found = await opening
    assert found is not None and found.grant_at == 256
    await sessions.close()
    assert found.call.cancelled and not found.open


async def test_a_renewed_session_serves_its_streams_and_closes_after_the_last() -> None:
    sessions = Sessions(lambda address: ScriptedCall(settings()))
    old = await sessions.get("router:1")
    assert old is not None
    stream = start(old)
    sessions.renew()
    assert not old.call.cancelled and not old.open
    new = await sessions.get("router:1")
    assert new is not None and new is not old
    old.deliver(events((1, 1, "x"), final=(1, 1)))
    assert [c.text for c in await read_all(stream)] == ["x"] and old.call.cancelled
    await sessions.close()


async def test_a_start_beyond_max_streams_waits_for_a_stream_to_end() -> None:
    link, _ = session(max_streams=2)
    start(link, "a"), start(link, "b")
    assert link.full()
    waiting = [asyncio.create_task(link.slot()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting)
    link.deliver(events((1, 1, "x"), final=(1, 1)))  # one ended: room for one
    await asyncio.sleep(0)
    assert [w.done() for w in waiting] == [True, False, False]
    start(link, "c")
    link.detach(2)  # one let go: room for one more
    await asyncio.sleep(0)
    assert [w.done() for w in waiting] == [True, True, False]
    start(link, "d")
    link.fail(
        grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "reset")
    )  # the call ended: every waiter goes (to a call of its own)
    await asyncio.gather(*waiting)
    assert not link.open


async def test_closing_writes_a_queued_cancel_before_it_ends_the_call() -> None:
    link, call = session()
    stream = start(link, "made-up")
    link.serve_task()
    await asyncio.sleep(0.01)
    assert stream.let_go(cancel=True)
    await link.close()  # at once, as Client.close() right after the caller left
    assert call.commands() == [(1, "generate"), (1, "cancel"), (1, "detach")] and call.cancelled
