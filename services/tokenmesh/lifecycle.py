"""One lifecycle for everything tokenmesh runs: start, ready, drain, stop.

:class:`Lifecycle` is the contract without a server: a start guard, supervised
background tasks, an idempotent shutdown, ``async with`` and :meth:`~Lifecycle.run`.
:class:`Service` builds it on a gRPC server (:class:`~tokenmesh.server.ServiceHost`)
for the router, worker and prober; the HTTP gateway builds it on uvicorn.

Tasks are started with :meth:`Lifecycle.spawn` and supervised: one that ends or
raises while the service runs is logged, the service goes NOT_SERVING, drains
and stops, :meth:`Lifecycle.run` returns a non-zero exit code and ``async with``
raises the task's exception (its body is cancelled, as :func:`asyncio.timeout`
does); there is never a half-alive process that still says SERVING. A task that
dies while the service starts fails the start. :meth:`Lifecycle.shutdown` is
idempotent, and a second caller waits for the first to finish; a second start raises.

The shutdown runs the hooks in this order: ``_set_ready(False)``, :meth:`~Lifecycle._drain`
(let in-flight work finish within ``drain_grace_s``), background tasks cancelled,
:meth:`~Lifecycle._stop` (the server stops, giving calls still open ``stop_grace_s``),
:meth:`~Lifecycle._close` (release channels, backends and files): the server
stops before what it serves from (vLLM's order), so no call still open meets a
closed backend or channel.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Self

from tokenmesh.server import ServiceHost

log = logging.getLogger(__name__)

TASK_STOP_S = 5.0
"""How long cancelled background tasks may take to unwind before the shutdown goes on without them."""


class ServiceFailed(RuntimeError):
    """A background task of the service ended on its own; the service stopped because of it."""


class Lifecycle(abc.ABC):
    """Lifecycle of one running thing, whatever it serves with.

    A host kind (gRPC: :class:`Service`; HTTP: the gateway) implements
    :meth:`_set_ready` and, where it has them, :meth:`_open` and :meth:`_stop`;
    each service implements :meth:`_start` and, where it needs them,
    :meth:`_drain` and :meth:`_close`.

    Args:
        drain_grace_s: how long in-flight work may take to finish once draining starts.
        stop_grace_s: after the drain, how long calls still open get before the server ends them.

    """

    drain_grace_s: float
    stop_grace_s: float
    _tasks: set[asyncio.Task[Any]]
    _started: bool
    _serving: bool
    """Started and not failed at it: a task that dies from now on begins the shutdown."""
    _shutdown_task: asyncio.Task[None] | None
    _failure: BaseException | None
    _failed: asyncio.Event
    _body: asyncio.Task[Any] | None
    """The task inside ``async with`` (cancelled when a background task dies)."""
    _body_cancelled: bool

    def __init__(self, *, drain_grace_s: float, stop_grace_s: float) -> None:
        self.drain_grace_s = drain_grace_s
        self.stop_grace_s = stop_grace_s
        self._tasks = set()
        self._started = False
        self._serving = False
        self._shutdown_task = None
        self._failure = None
        self._failed = asyncio.Event()
        self._body = None
        self._body_cancelled = False

    @property
    def name(self) -> str:
        """The service's name in logs."""
        return type(self).__name__.lower()

    @property
    def failure(self) -> BaseException | None:
        """What killed the service (a background task's exception), if anything did."""
        return self._failure

    @property
    def draining(self) -> bool:
        """True from the moment shutdown begins."""
        return self._shutdown_task is not None

    # -- hooks ------------------------------------------------------------

    async def _open(self) -> None:  # noqa: B027 - a host kind may have nothing to open before the service starts
        """The host's part of the start, before :meth:`_start` (a gRPC server binds its ports)."""

    @abc.abstractmethod
    async def _start(self) -> None:
        """Start backends, servers and background tasks; end ready (``_set_ready(True)`` or its equal)."""

    @abc.abstractmethod
    async def _set_ready(self, ready: bool) -> None:
        """Say whether the service takes new work (health checks, /health)."""

    async def _drain(self) -> None:  # noqa: B027 - a service without in-flight work needs no drain
        """Readiness is off: let in-flight work finish within ``drain_grace_s``."""

    async def _stop(self) -> None:  # noqa: B027 - a host kind may have no server of its own
        """Stop the server, giving calls still open ``stop_grace_s`` (background tasks are cancelled already)."""

    async def _close(self) -> None:  # noqa: B027 - a service may own nothing beyond its host
        """Release channels, backends and files (the server is stopped already)."""

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        """Start and become ready; a failed start (a task that died meanwhile too) shuts down, then raises."""
        if self._started:
            raise RuntimeError(f"{self.name} was started already; make a new one")
        self._started = True
        try:
            await self._open()
            await self._start()
            if self._failure is not None:
                raise self._failure
        except BaseException:
            await self.shutdown()
            raise
        self._serving = True

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a supervised background task: if it ends while the service runs, the service stops."""
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.draining or self._failure is not None:
            return
        error = task.exception() or ServiceFailed(f"background task {task.get_name()} ended on its own")
        log.error(
            "%s: background task %s died (%s); NOT_SERVING, draining and exiting",
            self.name,
            task.get_name(),
            error,
            exc_info=error,
        )
        self._failure = error
        self._failed.set()
        if not self._serving:
            return  # start() raises it once what it awaits returns
        if self._body is not None and not self._body.done():
            self._body_cancelled = True
            self._body.cancel()
        self._shutdown_task = asyncio.create_task(self._shutdown())

    async def shutdown(self) -> None:
        """Drain and stop. Idempotent: a second caller waits for the first shutdown to finish."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        began = asyncio.get_running_loop().time()
        log.info("%s draining (grace %g s)", self.name, self.drain_grace_s)
        try:
            await self._set_ready(False)
            if self._started:
                await self._drain()
        finally:
            tasks = [t for t in self._tasks if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=TASK_STOP_S)
            try:
                await self._stop()
            finally:
                await self._close()
                log.info("%s stopped %.1f s after draining began", self.name, asyncio.get_running_loop().time() - began)

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT (or until a background task dies), then shut down.

        Returns the process exit code: 0 after a signal, 1 when the service
        stopped because a background task died (during the start too).
        """
        try:
            await serve_until_signal(self.start, self._failed.wait, self.shutdown)
        except Exception as exc:
            if exc is not self._failure:
                raise
        if self._failure is not None:
            log.error("%s stopped because a background task died: %s", self.name, self._failure)
            return 1
        return 0

    async def __aenter__(self) -> Self:
        await self.start()
        self._body = asyncio.current_task()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Shut down; raise the failure of a background task that died, unless another exception is on its way."""
        body, self._body = self._body, None
        await self.shutdown()
        ours = False
        if self._body_cancelled and body is not None:
            # The CancelledError of our own cancel becomes the failure; another cancel goes on.
            ours = body.uncancel() == 0 and isinstance(exc, asyncio.CancelledError)
        if self._failure is not None and (exc is None or ours):
            raise self._failure


class Service(Lifecycle):
    """Lifecycle of one gRPC service process (router, worker, prober).

    Args:
        host: the service's gRPC server (health answers liveness/readiness from it).
        drain_grace_s: how long in-flight work may take to finish once draining starts.
        stop_grace_s: after the drain, how long calls still open (health watches, stats
            streams) get before the server ends them.

    """

    host: ServiceHost

    def __init__(self, host: ServiceHost, *, drain_grace_s: float, stop_grace_s: float) -> None:
        super().__init__(drain_grace_s=drain_grace_s, stop_grace_s=stop_grace_s)
        self.host = host

    async def _open(self) -> None:
        await self.host.start()

    @abc.abstractmethod
    async def _start(self) -> None:
        """Listen, start backends and background tasks; end with ``await self.host.set_ready(True)``."""

    async def _set_ready(self, ready: bool) -> None:
        await self.host.set_ready(ready)

    async def _stop(self) -> None:
        await self.host.stop(self.stop_grace_s)


async def serve_until_signal(
    start: Callable[[], Awaitable[None]],
    failed: Callable[[], Awaitable[object]],
    shutdown: Callable[[], Awaitable[None]],
) -> bool:
    """Start, serve until SIGTERM or SIGINT or until failed() returns, then shut down (on an error too).

    Returns whether failed() returned before a signal came. Every service's
    :meth:`Service.run` and the HTTP gateway's run this way.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await start()
        stopped, failure = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(failed())
        await asyncio.wait({stopped, failure}, return_when=asyncio.FIRST_COMPLETED)
        failed_first = failure.done()
        for waiter in (stopped, failure):
            waiter.cancel()
        return failed_first
    finally:
        await shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
