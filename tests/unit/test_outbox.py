"""The calling side's writer of a multiplexed call: one message per write, commands in order, under max_bytes."""

from __future__ import annotations

import asyncio

from tokenmesh.mux import Outbox
from tokenmesh.v1 import worker_pb2


class Call:
    """Records what was written; each write waits for the test to let it finish."""

    def __init__(self) -> None:
        self.written: list[worker_pb2.LinkCommands] = []
        self.gate = asyncio.Event()

    async def write(self, message: worker_pb2.LinkCommands) -> None:
        self.written.append(message)
        await self.gate.wait()
        self.gate.clear()


def commands(commands: list[worker_pb2.LinkCommand], streams: list[int], credit: list[int]) -> worker_pb2.LinkCommands:
    return worker_pb2.LinkCommands(commands=commands, credit_stream=streams, credit_bytes=credit)


def cancel(stream: int) -> worker_pb2.LinkCommand:
    return worker_pb2.LinkCommand(stream=stream, cancel=worker_pb2.CancelGeneration(reason="x" * 100))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_what_is_queued_during_a_write_leaves_in_one_message_with_the_credit_coalesced() -> None:
    call, outbox = Call(), Outbox(commands, max_bytes=10_000)
    writer = asyncio.create_task(outbox.write_loop(call))
    outbox.send(cancel(1))
    await settle()
    assert [c.stream for c in call.written[0].commands] == [1]
    outbox.send(cancel(2))  # while the first write is in flight
    outbox.grant(5, 10)
    outbox.send(cancel(3))
    outbox.grant(5, 20)
    outbox.grant(6, 1)
    waiting = asyncio.ensure_future(outbox.written())
    call.gate.set()
    await settle()
    second = call.written[1]
    assert [c.stream for c in second.commands] == [2, 3]
    assert dict(zip(second.credit_stream, second.credit_bytes, strict=True)) == {5: 30, 6: 1}
    assert not waiting.done()  # the second message is still being written
    call.gate.set()
    await settle()
    assert waiting.done() and len(call.written) == 2
    writer.cancel()


async def test_a_message_stays_under_max_bytes_and_a_larger_command_goes_alone() -> None:
    call, outbox = Call(), Outbox(commands, max_bytes=300)
    for stream in range(1, 6):
        outbox.send(cancel(stream))  # ~110 bytes each with framing: two per message
    big = worker_pb2.LinkCommand(stream=6, cancel=worker_pb2.CancelGeneration(reason="y" * 1000))
    outbox.send(big)
    writer = asyncio.create_task(outbox.write_loop(call))
    for _ in range(4):
        await settle()
        call.gate.set()
    await settle()
    assert [[c.stream for c in m.commands] for m in call.written] == [[1, 2], [3, 4], [5], [6]]
    writer.cancel()


async def test_a_forgotten_stream_gets_no_credit_and_clear_drops_everything() -> None:
    call, outbox = Call(), Outbox(commands, max_bytes=10_000)
    outbox.grant(1, 10)
    outbox.grant(2, 10)
    outbox.forget(1)
    writer = asyncio.create_task(outbox.write_loop(call))
    await settle()
    assert list(call.written[0].credit_stream) == [2]
    call.gate.set()
    outbox.send(cancel(3))
    outbox.clear()
    await settle()
    assert len(call.written) == 1
    await asyncio.wait_for(outbox.written(), 1)
    writer.cancel()
