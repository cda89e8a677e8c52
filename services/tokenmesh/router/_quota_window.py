"""A tenant's sliding window of reservations: the rules (:func:`judge`) and this router's counts (:class:`LocalStore`).

The window slides: it is ``SLOTS`` slots of ``window_s / SLOTS`` seconds,
and a reservation counts in its slot until the whole window has passed after
it. The last ``SLOTS + 1`` slots are summed, so any stretch of ``window_s``
seconds holds at most the quota (a request waits at most one slot longer
than a strict sliding window would make it). Redis runs the same rules in
Lua (:mod:`tokenmesh.router._quota_redis`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tokenmesh.router._quota_file import Limits

SLOTS = 10
"""Slots per window: a reservation leaves the window within window_s / SLOTS of its full window."""


@dataclass(frozen=True)
class Verdict:
    """What a store answered a reservation: granted or which limit refused it, and the window's figures."""

    refused: str
    """"" when granted; else the limit: concurrent, requests, tokens, too_large (more than the whole quota)."""
    retry_s: float | None
    """When refused: seconds until it would fit (None: not known, or never)."""
    used_tokens: int
    """Tokens reserved in the window (this reservation included when granted)."""
    used_requests: int
    reset_tokens_s: float
    """Seconds until the tokens counted now have left the window."""
    reset_requests_s: float
    slot: int
    """The slot the reservation was counted in (its refund goes there)."""


def _wait_s(by_slot: Mapping[int, int], used: int, need: int, limit: int, slot_s: float, now: float) -> float | None:
    """Seconds until need fits under limit as the oldest slots leave the window; None: never."""
    excess = used + need - limit
    for slot in sorted(by_slot):
        excess -= by_slot[slot]
        if excess <= 0:
            return max(0.0, (slot + SLOTS + 1) * slot_s - now)
    return None


def _reset_s(by_slot: Mapping[int, int], slot_s: float, now: float) -> float:
    """Seconds until everything counted has left the window."""
    newest = max((slot for slot, amount in by_slot.items() if amount > 0), default=None)
    return 0.0 if newest is None else max(0.0, (newest + SLOTS + 1) * slot_s - now)


def judge(  # wide: the Lua script's arguments one for one (pure, so both run the same rule)
    limits: Limits,
    need: int,
    running: int,
    tokens: Mapping[int, int],
    requests: Mapping[int, int],
    slot_s: float,
    now: float,
) -> Verdict:
    """Whether a reservation of need tokens fits (tokens and requests: the window's slots; running: now).

    Pure: the store applies a grant. Redis runs the same rules in Lua (:mod:`tokenmesh.router._quota_redis`).
    """
    current = math.floor(now / slot_s)
    used_t, used_r = sum(tokens.values()), sum(requests.values())
    refused, retry = "", None
    if limits.concurrent is not None and running + 1 > limits.concurrent:
        # Room comes when one ends, which cannot be foreseen: a short hint (none when no generation may run).
        refused, retry = "concurrent", min(1.0, slot_s) if limits.concurrent else None
    elif limits.requests is not None and used_r + 1 > limits.requests:
        refused, retry = "requests", _wait_s(requests, used_r, 1, limits.requests, slot_s, now)
    elif limits.tokens is not None and need > limits.tokens:
        refused = "too_large"
    elif limits.tokens is not None and used_t + need > limits.tokens:
        refused, retry = "tokens", _wait_s(tokens, used_t, need, limits.tokens, slot_s, now)
    if refused:
        return Verdict(
            refused, retry, used_t, used_r, _reset_s(tokens, slot_s, now), _reset_s(requests, slot_s, now), current
        )
    reset = (current + SLOTS + 1) * slot_s - now
    return Verdict("", None, used_t + need, used_r + 1, reset, reset, current)


@dataclass
class _Window:
    """One tenant's counts in this router."""

    tokens: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    running: int = 0

    def prune(self, oldest: int) -> None:
        for slots in (self.tokens, self.requests):
            for slot in [s for s in slots if s < oldest]:
                del slots[slot]

    @property
    def empty(self) -> bool:
        return not (self.tokens or self.requests or self.running)


class LocalStore:
    """The counts of one router (the default; and a router's own budget while Redis is down).

    Args:
        window_s: the quota's window.
        clock: seconds (monotonic); tests pass their own.

    """

    slot_s: float
    window_s: float
    clock: Callable[[], float]
    tenants: dict[str, _Window]
    """Tenants with a reservation in the window or running; the others are dropped."""
    _swept: float

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.slot_s = window_s / SLOTS
        self.clock = clock
        self.tenants = {}
        self._swept = clock()

    def reserve(self, tenant: str, limits: Limits, need: int) -> Verdict:
        """Check and take a reservation in one step (nothing else runs between: no await)."""
        now = self.clock()
        self._sweep(now)
        window = self.tenants.setdefault(tenant, _Window())
        current = math.floor(now / self.slot_s)
        window.prune(current - SLOTS)
        verdict = judge(limits, need, window.running, window.tokens, window.requests, self.slot_s, now)
        if verdict.refused:
            if window.empty:
                del self.tenants[tenant]
            return verdict
        window.tokens[current] = window.tokens.get(current, 0) + need
        window.requests[current] = window.requests.get(current, 0) + 1
        window.running += 1
        return verdict

    def release(self, tenant: str, slot: int, refund: int) -> None:
        """The generation ended: it runs no more, and refund tokens of its reservation go back (less: more used)."""
        window = self.tenants.get(tenant)
        if window is None:
            return
        window.running = max(0, window.running - 1)
        if refund and slot in window.tokens:  # a slot that left the window needs no refund
            window.tokens[slot] = max(0, window.tokens[slot] - refund)
        if window.empty:
            del self.tenants[tenant]

    def _sweep(self, now: float) -> None:
        """Drop tenants whose counts all left the window (once per window)."""
        if now - self._swept < self.window_s:
            return
        self._swept = now
        oldest = math.floor(now / self.slot_s) - SLOTS
        for tenant, window in list(self.tenants.items()):
            window.prune(oldest)
            if window.empty:
                del self.tenants[tenant]
