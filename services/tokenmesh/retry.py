"""The mesh's one retry and reconnect policy (on tenacity).

Only transient failures are retried: ``UNAVAILABLE`` (a peer restarting, a
connection refused or cut), ``RESOURCE_EXHAUSTED`` when the server put a
retry hint in its status details (``RetryInfo``; then the wait is at least the hint,
and a hint that ends past the deadline ends the retries at once: the caller gets the
refusal and its hint now rather than at the deadline, e.g. a quota's "retry in 51 s"),
and the errors our own code raises for a peer that did not answer in time or
ended a stream that should stay open (:class:`TimeoutError`,
:class:`ConnectionError`). Anything else (UNIMPLEMENTED: the address is some
other service; PERMISSION_DENIED, UNAUTHENTICATED: credentials;
INVALID_ARGUMENT: our own bug) is raised at once, so a wrong address fails
loudly instead of spinning.

The wait before attempt n is "full jitter": uniform in [0, min(max_s,
initial_s * 2**n)], so peers that lost the same server do not come back in
lockstep, and never past the deadline. Failures are counted per
:class:`Reconnect`; a long-lived stream calls :meth:`Reconnect.connected` once
it works, which starts the count, the backoff and the deadline afresh. After
``warn_after`` consecutive failures a WARNING names what and where, and again
each time the count doubles. A loop that is not one callable (the client's
stream, resumed on another router) takes the same policy step by step with
:meth:`Reconnect.failed`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import tenacity

from tokenmesh.errors import from_rpc_error

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Status codes that say "the same call may succeed later" (RESOURCE_EXHAUSTED only with a hint)."""


class StreamEnded(ConnectionError):
    """A stream that should stay open ended without an error (the peer closed it): reconnect."""


async def write(call: grpc.aio.StreamStreamCall[Any, Any], message: Any) -> None:
    """Write to a stream; if the peer has ended the call already, raise its status as an AioRpcError.

    grpc raises a bare ``asyncio.InvalidStateError`` ("RPC already finished")
    for a write after the peer ended the call (e.g. a worker that was killed):
    raised as the call's status instead, the retry policy can tell a peer that
    went away (UNAVAILABLE: reconnect) from one that refused (permanent).
    """
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        code, details, trailers = await call.code(), await call.details(), await call.trailing_metadata()
        raise grpc.aio.AioRpcError(
            code, grpc.aio.Metadata(), trailers or grpc.aio.Metadata(), details=details
        ) from None


def retry_hint_s(exc: BaseException) -> float | None:
    """The server's retry hint (its status's ``RetryInfo``) in seconds; None: no hint."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() == grpc.StatusCode.OK:
        return None
    return from_rpc_error(exc).retry_delay


def is_transient(exc: BaseException) -> bool:
    """Whether the same call may succeed if tried again later."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        return code in TRANSIENT_CODES or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_hint_s(exc) is not None)
    return isinstance(exc, (TimeoutError, ConnectionError))


def failure_name(exc: BaseException) -> str:
    """The short name of a failure for a state reason: the status code's name, or the exception's class."""
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__


def describe(exc: BaseException) -> str:
    """A one-line account of a failure for logs."""
    if isinstance(exc, grpc.aio.AioRpcError):
        error = from_rpc_error(exc)
        lines = error.message.splitlines()
        return f"{exc.code().name}: {lines[0] if lines else ''}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """How a loop waits between attempts."""

    initial_s: float = 0.1
    """Upper bound of the first wait (it doubles per consecutive failure)."""
    max_s: float = 5.0
    """Longest wait between two attempts."""
    deadline_s: float | None = None
    """Give up (raise the last error) this long after the first attempt; None: never."""
    warn_after: int = 5
    """Consecutive failures before a WARNING (then again each time the count doubles)."""


RECONNECT = Backoff(initial_s=0.05, max_s=0.5)
"""Long-lived streams between services (health watches, stats, weight pushes): reconnect for ever.

Capped low on purpose: these peers are the mesh's own, on loopback or in one
cluster, and a worker back from a restart must be seen at once (the hand-written
loops this replaced waited a fixed 0.25-0.5 s). Jitter still spreads the peers'
attempts; only permanent statuses stop them."""


class Reconnect:
    """Retries one thing (a call, or a long-lived stream) against one address under a :class:`Backoff`.

    Args:
        what: what is being tried, for logs ("health watch", "weight push").
        address: the peer's host:port, named in every warning.
        backoff: the waits, the deadline and when to warn.
        logger: where the warnings go (the caller's module logger).
        loud: log a permanent failure at ERROR before raising it (off where the caller expects some,
            e.g. NOT_FOUND from the workers that do not hold a generation).

    """

    what: str
    address: str
    backoff: Backoff
    failures: int
    """Consecutive failures so far (0 after :meth:`connected`)."""
    last_error: str
    _log: logging.Logger
    _loud: bool
    _since: float
    """Where the deadline counts from: the first attempt, or the last :meth:`connected`."""

    def __init__(
        self, what: str, address: str, backoff: Backoff = RECONNECT, logger: logging.Logger = log, *, loud: bool = True
    ) -> None:
        self.what = what
        self.address = address
        self.backoff = backoff
        self.failures = 0
        self.last_error = ""
        self._log = logger
        self._loud = loud
        self._since = time.monotonic()

    def connected(self) -> None:
        """The attempt works (a stream is open and answering): count failures, and the deadline, afresh."""
        if self.failures:
            if self.failures >= self.backoff.warn_after:
                self._log.info("%s to %s works again after %d failures", self.what, self.address, self.failures)
            self.failures = 0
        self._since = time.monotonic()

    def remaining_s(self) -> float | None:
        """Time left before the deadline (None: no deadline)."""
        b = self.backoff
        return None if b.deadline_s is None else self._since + b.deadline_s - time.monotonic()

    def wait_s(self, exc: BaseException | None) -> float:
        """The wait before the next attempt: full jitter, at least the server's hint, never past the deadline."""
        b = self.backoff
        wait = random.uniform(0, min(b.max_s, b.initial_s * 2 ** min(max(self.failures, 1) - 1, 30)))  # noqa: S311
        hint = retry_hint_s(exc) if exc is not None else None
        if hint is not None:
            wait = max(wait, hint)
        remaining = self.remaining_s()
        return wait if remaining is None else max(0.0, min(wait, remaining))

    def _wait(self, state: tenacity.RetryCallState) -> float:
        return self.wait_s(state.outcome.exception() if state.outcome is not None else None)

    def _stop(self, state: tenacity.RetryCallState) -> bool:
        return self._out_of_time(state.outcome.exception() if state.outcome is not None else None)

    def _out_of_time(self, exc: BaseException | None) -> bool:
        """The deadline has passed, or the server's hint (if any) asks for a wait past it."""
        remaining = self.remaining_s()
        if remaining is None:
            return False
        hint = retry_hint_s(exc) if exc is not None else None
        return remaining <= 0 or (hint is not None and hint > remaining)

    def _count(self, exc: BaseException | None) -> None:
        self.failures += 1
        self.last_error = describe(exc) if exc is not None else "?"
        n, warn = self.failures, self.backoff.warn_after
        if n >= warn and (n & (n - 1) == 0 or n == warn):  # at warn_after, then at each power of two
            self._log.warning(
                "%s to %s failed %d times in a row (last: %s); still retrying",
                self.what,
                self.address,
                n,
                self.last_error,
            )
        else:
            self._log.debug("%s to %s failed (%s); retrying", self.what, self.address, self.last_error)

    def _failed(self, state: tenacity.RetryCallState) -> None:
        self._count(state.outcome.exception() if state.outcome is not None else None)

    async def failed(self, exc: BaseException, retry_on: Callable[[BaseException], bool] = is_transient) -> None:
        """One step of the policy for a loop of its own: count exc and wait, or raise it.

        Raises ``exc`` when it is permanent or the deadline has passed (quietly:
        the loop's owner decides what to tell); otherwise waits as
        :meth:`run` would before its next attempt.
        """
        if not retry_on(exc) or self._out_of_time(exc):
            raise exc
        self._count(exc)
        await asyncio.sleep(self.wait_s(exc))

    async def run(
        self, attempt: Callable[[], Awaitable[T]], retry_on: Callable[[BaseException], bool] = is_transient
    ) -> T:
        """Call ``attempt`` until it returns; retry transient failures; raise anything else at once.

        ``retry_on`` widens what counts as transient for attempts whose
        failures are not gRPC statuses (e.g. restarting an engine). A permanent
        failure (and the last transient one once the deadline has passed) is
        logged at ERROR with the address, then raised.
        """
        b = self.backoff
        self._since = time.monotonic()
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retry_on),
            wait=self._wait,
            stop=self._stop,
            after=self._failed,
            reraise=True,
        )
        try:
            return await retrying(attempt)
        except Exception as exc:
            permanent = not retry_on(exc)
            if not self._loud and permanent:
                raise
            kind = "failed permanently" if permanent else f"still failing after {b.deadline_s:g} s"
            self._log.error("%s to %s %s: %s", self.what, self.address, kind, describe(exc))
            raise
