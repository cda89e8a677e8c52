"""A worker that refuses a start at its limit: the router lowers its own allowance there and grows it back."""

from __future__ import annotations

import asyncio

import pytest

from tokenmesh.errors import ResourceExhausted
from tokenmesh.router import WorkerPool
from tokenmesh.router._admission import FAILOVER, Admission
from tokenmesh.v1 import inference_pb2


def pool_with(*addresses: str, limit: int = 8, share: tuple[int, int] = (0, 1)) -> WorkerPool:
    pool = WorkerPool(share=share)
    for address in addresses:
        entry = pool.add(address)
        entry.healthy = True
        entry.limit = limit
        entry.models = {"m": inference_pb2.ModelInfo(name="m", max_context=100, is_default=True)}
    return pool


def test_a_refusal_lowers_the_allowance_to_what_runs_there_without_taking_the_worker_out() -> None:
    pool = pool_with("a:1", "b:1")
    a = pool.entries["a:1"]
    a.in_flight = 6  # five running and the refused start, whose slot is released after
    pool.refused(a)
    a.in_flight -= 1
    assert pool.allowance(a) == 5 and a.ceiling == 5
    assert pool.effective_weight(a) == 1.0  # busy, not failed: not suspended
    assert [pool.pick("m").address for _ in range(3)] == ["b:1"] * 3  # no slot left on a
    pool.require_live("m")  # and the model is still served
    assert pool.table().workers[0].concurrency_limit == 5  # what operators see is the lowered allowance


def test_a_refusal_with_nothing_else_running_there_leaves_the_worker_to_the_other_routers() -> None:
    pool = pool_with("a:1")
    a = pool.entries["a:1"]
    a.in_flight = 1
    pool.refused(a)
    a.in_flight = 0
    assert pool.allowance(a) == 0 and pool.pick("m") is None


def test_the_ceiling_grows_by_one_per_step_up_to_the_routers_share_and_tells_the_listeners() -> None:
    pool = pool_with("a:1", limit=8, share=(0, 2))  # two router processes: this one's share is 4
    a = pool.entries["a:1"]
    told: list[int | None] = []
    pool.subscribe(lambda: told.append(a.ceiling))
    a.in_flight = 2
    pool.refused(a)
    for _ in range(3):
        pool._grow(a)  # outside a loop no timer runs: each call is one CEILING_GROWTH_S
    assert told == [2, 3, None]  # lifted once back at the share (4)
    assert pool.allowance(a) == 4


def test_a_large_worker_is_taken_back_in_eighths_of_the_share() -> None:
    pool = pool_with("a:1", limit=64)
    a = pool.entries["a:1"]
    a.in_flight = 1
    pool.refused(a)  # another router filled it: this one runs nothing there now
    steps = []
    while a.ceiling is not None:
        pool._grow(a)
        steps.append(pool.allowance(a))
    assert steps == [8, 16, 24, 32, 40, 48, 56, 64]


async def test_a_waiter_gets_the_worker_when_the_ceiling_grows_without_a_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tokenmesh.router._pool.CEILING_GROWTH_S", 0.05)
    pool = pool_with("a:1", limit=4)
    admission = Admission(pool, max_queue=10, queue_timeout_s=5, aging_s=5)
    a = pool.entries["a:1"]
    for _ in range(3):
        await admission.acquire("m", 2, "t")
    pool.refused(a)  # the third start was refused: 2 fit
    admission.release(a, "t")
    waiting = asyncio.create_task(admission.acquire("m", 2, "t"))
    await asyncio.sleep(0.01)
    assert not waiting.done() and len(admission.waiting) == 1
    assert await asyncio.wait_for(waiting, 1) is a  # granted by the growth's own timer (nothing was released)
    assert a.in_flight == 3 and a.ceiling == 3


async def test_a_second_refusal_lowers_again_and_dropping_the_worker_stops_its_timer() -> None:
    pool = pool_with("a:1")
    a = pool.entries["a:1"]
    a.in_flight = 6
    pool.refused(a)
    timer = a.ceiling_growth
    a.in_flight = 3
    pool.refused(a)
    assert a.ceiling == 2 and a.ceiling_growth is timer  # one timer at a time
    pool.let_go(a, "gone from DNS")
    pool.drop(a)
    assert timer is not None and timer.cancelled()


async def test_a_generation_back_from_a_refusal_waits_ahead_of_a_full_queue_instead_of_being_refused() -> None:
    pool = pool_with("a:1", limit=1)
    admission = Admission(pool, max_queue=1, queue_timeout_s=5, aging_s=5)
    a = await admission.acquire("m", 2, "t")
    arrival = asyncio.create_task(admission.acquire("m", 2, "t"))
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted):  # an arrival finds the queue full
        await admission.acquire("m", 2, "t")
    requeued = asyncio.create_task(admission.acquire("m", FAILOVER, "t"))
    await asyncio.sleep(0)
    assert len(admission.waiting) == 2
    admission.release(a, "t")
    assert await asyncio.wait_for(requeued, 1) is a and not arrival.done()  # and it goes first
    arrival.cancel()
