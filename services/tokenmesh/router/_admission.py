"""Priority admission in front of the per-worker concurrency limits.

A generation gets a worker slot at once when one is free and nobody of equal
or higher priority waits; otherwise it waits in the admission queue. When a
slot frees, the waiter with the highest effective priority goes first: its
priority (LOW 1, NORMAL 2, HIGH 3; a stream moving off a failed worker, or one
a worker refused at its limit, 4) plus one level per ``aging_s`` waited, so LOW
cannot starve. Among equals, the tenant (``labels["tenant"]``) with fewer
generations running goes first, then the earliest. The queue is bounded in
length (for arrivals) and in wait; both answer RESOURCE_EXHAUSTED with a retry
hint (``RetryInfo``; reason QUEUE_FULL or QUEUE_TIMEOUT).

Slots are handed out when they can change hands: when one is released, and
when the pool reports a change (health, a weight table, a limit, a
suspension's end). Aging only reorders the queue, so it needs no timer of its
own: a waiter's level is computed when a slot is handed out.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from tokenmesh.errors import Cancelled, ResourceExhausted
from tokenmesh.router._pool import NO_AFFINITY, Affinity, WorkerEntry, WorkerPool
from tokenmesh.v1 import inference_pb2

FAILOVER = 4
"""Priority of a stream moving off a failed worker (it already has a caller waiting mid-stream), or of one a worker
refused at its limit (admitted here already): ahead of every arrival, and never refused for a full queue."""

_PRIORITY: dict[int, int] = {
    inference_pb2.PRIORITY_UNSPECIFIED: 2,
    inference_pb2.PRIORITY_LOW: 1,
    inference_pb2.PRIORITY_NORMAL: 2,
    inference_pb2.PRIORITY_HIGH: 3,
}


def level(priority: int) -> int:
    """Queue level of a Priority enum value."""
    return _PRIORITY[priority]


@dataclass(eq=False)
class Waiter:
    """A generation waiting for a slot."""

    model: str
    affinity: Affinity
    level: int
    tenant: str
    enqueued: float
    order: int
    granted: asyncio.Future[WorkerEntry] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """Grants worker slots to generations, queueing them by priority when none is free.

    Args:
        pool: the workers; the admission subscribes to its changes.
        max_queue: most generations waiting at once.
        queue_timeout_s: longest wait (unless acquire is given its own).
        aging_s: a waiter rises one level per this many seconds waited.

    """

    pool: WorkerPool
    max_queue: int
    queue_timeout_s: float
    aging_s: float
    waiting: list[Waiter]
    running_by_tenant: Counter[str]
    _order: itertools.count[int]

    def __init__(self, pool: WorkerPool, *, max_queue: int, queue_timeout_s: float, aging_s: float) -> None:
        self.pool = pool
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.aging_s = aging_s
        self.waiting = []
        self.running_by_tenant = Counter()
        self._order = itertools.count()
        pool.subscribe(self.dispatch)

    def _effective(self, waiter: Waiter, now: float) -> tuple[float, int, int]:
        aged = waiter.level + int((now - waiter.enqueued) / self.aging_s)
        # Higher is better: level with aging, then the tenant running less, then the earlier.
        return (aged, -self.running_by_tenant[waiter.tenant], -waiter.order)

    def _retry_hint_ms(self) -> int:
        # About how long until the queue ahead has drained at one slot per generation.
        return max(100, min(30_000, 50 * (len(self.waiting) + 1)))

    async def acquire(
        self,
        model: str,
        level: int,
        tenant: str,
        timeout_s: float | None = None,
        affinity: Affinity = NO_AFFINITY,
        abandon: asyncio.Future[None] | None = None,
    ) -> WorkerEntry:
        """A worker slot for model (its in_flight already counted); wait in the queue if none is free.

        Raises Unavailable when no live worker serves the model at all (unless
        level is FAILOVER, which waits for one), ResourceExhausted when the
        queue is full (never at level FAILOVER) or the wait (timeout_s, default queue_timeout_s) runs out,
        Cancelled once ``abandon`` is done (the generation was cancelled). ``affinity``: the worker the
        generation would rather have (its session's or prompt prefix's), for the pool's pick.
        """
        if abandon is not None and abandon.done():
            raise Cancelled("cancelled before it got a worker")
        if level < FAILOVER:
            self.pool.require_live(model)
        now = time.monotonic()
        ahead = any(self._effective(w, now)[0] >= level for w in self.waiting if w.model == model)
        entry = None if ahead else self.pool.pick(model, affinity)
        if entry is not None:
            return self._grant(entry, tenant)
        # The bound is for arrivals: a generation admitted already (moving off a failed worker, or refused by a
        # worker at its limit) waits whatever the queue's length; there are never more of them than run.
        if level < FAILOVER and len(self.waiting) >= self.max_queue:
            hint = self._retry_hint_ms()
            raise ResourceExhausted(
                f"admission queue is full ({len(self.waiting)} waiting); retry in about {hint} ms",
                reason="QUEUE_FULL",
                metadata={"model": model, "waiting": str(len(self.waiting))},
                retry_delay=hint / 1000,
            )
        waiter = Waiter(model, affinity, level, tenant, now, next(self._order))
        self.waiting.append(waiter)
        try:
            return await self._wait(waiter, self.queue_timeout_s if timeout_s is None else timeout_s, abandon)
        finally:
            if waiter in self.waiting:
                self.waiting.remove(waiter)

    async def _wait(self, waiter: Waiter, wait: float, abandon: asyncio.Future[None] | None) -> WorkerEntry:
        """The slot granted to a queued waiter within wait seconds; Cancelled once abandon is done."""
        try:
            await asyncio.wait(
                (waiter.granted,) if abandon is None else (waiter.granted, abandon),
                timeout=wait,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if abandon is not None and abandon.done():
                if waiter.granted.done():  # granted in the same turn: give the slot to the next waiter
                    self.release(waiter.granted.result(), waiter.tenant)
                raise Cancelled("cancelled while waiting for a worker slot")
            if not waiter.granted.done():
                hint = self._retry_hint_ms()
                raise ResourceExhausted(
                    f"no worker slot for {waiter.model!r} within {wait:g} s ({len(self.waiting)} waiting); "
                    f"retry in about {hint} ms",
                    reason="QUEUE_TIMEOUT",
                    metadata={"model": waiter.model, "waited_s": f"{wait:g}"},
                    retry_delay=hint / 1000,
                )
            return waiter.granted.result()
        except (Cancelled, ResourceExhausted):
            raise
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(waiter.granted.result(), waiter.tenant)  # granted, but the caller is gone
            raise

    def _grant(self, entry: WorkerEntry, tenant: str) -> WorkerEntry:
        entry.in_flight += 1
        self.running_by_tenant[tenant] += 1
        return entry

    def release(self, entry: WorkerEntry, tenant: str) -> None:
        """Give the slot back and hand free slots to the best waiters."""
        entry.in_flight -= 1
        self.running_by_tenant[tenant] -= 1
        if self.running_by_tenant[tenant] <= 0:
            del self.running_by_tenant[tenant]
        self.dispatch()

    def dispatch(self) -> None:
        """Grant free slots to waiters, best first (on a release, and on every change the pool reports)."""
        now = time.monotonic()
        for waiter in sorted(self.waiting, key=lambda w: self._effective(w, now), reverse=True):
            if waiter.granted.done():
                continue
            entry = self.pool.pick(waiter.model, waiter.affinity)
            if entry is None:
                continue  # none free for this model; others may serve other models
            self.waiting.remove(waiter)
            waiter.granted.set_result(self._grant(entry, waiter.tenant))
