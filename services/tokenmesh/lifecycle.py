"""One lifecycle for every tokenmesh service: start, ready, drain, stop.

A :class:`Service` owns its gRPC server (:class:`~tokenmesh.server.ServiceHost`)
and its background tasks. Tasks are started with :meth:`Service.spawn` and
supervised: one that ends or raises while the service runs is logged, the
service goes NOT_SERVING, drains and stops, and :meth:`Service.run` returns a
non-zero exit code; there is never a half-alive process that still says
SERVING. :meth:`Service.shutdown` is idempotent, and a second caller waits for
the first to finish. ``async with service:`` starts and shuts down.

A service implements three hooks: :meth:`Service._start` (listen, start
backends and tasks, then ``host.set_ready(True)``), :meth:`Service._drain`
(readiness is off already; let in-flight work finish within the service's
``drain_grace_s``) and :meth:`Service._close` (release channels and
backends; background tasks are cancelled and the server stopped before it).
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
    """A background task of the service died; the service stopped because of it."""


class Service(abc.ABC):
    """Lifecycle of one service process.

    Args:
        host: the service's gRPC server (health answers liveness/readiness from it).
        drain_grace_s: how long in-flight work may take to finish once draining starts.
        stop_grace_s: after the drain, how long calls still open (health watches, stats
            streams) get before the server ends them.

    """

    host: ServiceHost
    drain_grace_s: float
    stop_grace_s: float
    _tasks: set[asyncio.Task[Any]]
    _started: bool
    _shutdown_task: asyncio.Task[None] | None
    _failure: BaseException | None
    _failed: asyncio.Event

    def __init__(self, host: ServiceHost, *, drain_grace_s: float, stop_grace_s: float) -> None:
        self.host = host
        self.drain_grace_s = drain_grace_s
        self.stop_grace_s = stop_grace_s
        self._tasks = set()
        self._started = False
        self._shutdown_task = None
        self._failure = None
        self._failed = asyncio.Event()

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

    @abc.abstractmethod
    async def _start(self) -> None:
        """Listen, start backends and background tasks; end with ``await self.host.set_ready(True)``."""

    async def _drain(self) -> None:  # noqa: B027 - a service without in-flight work needs no drain
        """Readiness is off: let in-flight work finish within ``drain_grace_s``."""

    async def _close(self) -> None:  # noqa: B027 - a service may own nothing beyond its host
        """Release channels, backends and files (background tasks are cancelled already)."""

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        """Start and become ready; a failed start shuts down what it started, then raises."""
        if self._started:
            raise RuntimeError(f"{self.name} was started already; make a new one")
        self._started = True
        try:
            await self.host.start()
            await self._start()
        except BaseException:
            await self.shutdown()
            raise

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a supervised background task: if it ends while the service runs, the service stops."""
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.draining:
            return
        error = task.exception() or ServiceFailed(f"background task {task.get_name()} ended on its own")
        log.error("%s: background task %s died (%s); NOT_SERVING, draining and exiting",
                  self.name, task.get_name(), error, exc_info=error)
        self._failure = error
        self._failed.set()
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
            await self.host.set_ready(False)
            if self._started:
                await self._drain()
        finally:
            tasks = [t for t in self._tasks if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=TASK_STOP_S)
            try:
                # The server stops before what it serves from (vLLM's order): no call
                # still open meets a closed backend or channel.
                await self.host.stop(self.stop_grace_s)
            finally:
                await self._close()
                log.info("%s stopped %.1f s after draining began", self.name,
                         asyncio.get_running_loop().time() - began)

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT (or until a background task dies), then shut down.

        Returns the process exit code: 0 after a signal, 1 when the service
        stopped because a background task died.
        """
        await serve_until_signal(self.start, self._failed.wait, self.shutdown)
        if self._failure is not None:
            log.error("%s stopped because a background task died: %s", self.name, self._failure)
            return 1
        return 0

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()


async def serve_until_signal(start: Callable[[], Awaitable[None]], failed: Callable[[], Awaitable[object]],
                             shutdown: Callable[[], Awaitable[None]]) -> bool:
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
