"""Stopping a generation: ``Inference/Cancel``, and telling workers to stop one (left by a stream, or held anywhere).

Both go through the mesh's retry policy: a transient failure (the worker
restarting, a connection cut) is tried again within one deadline; NOT_FOUND
from a worker that does not hold the generation is expected, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from tokenmesh.errors import NotFound
from tokenmesh.links import Links
from tokenmesh.retry import Backoff, Reconnect, describe
from tokenmesh.router._generation import Caller
from tokenmesh.router._live import LiveTable
from tokenmesh.router._transport import stop
from tokenmesh.v1 import inference_pb2, worker_pb2_grpc
from tokenmesh.validation import require_request_id

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 5.0
"""Longest a Cancel that goes to the workers waits for their answers (less when the caller's deadline is nearer)."""
ABANDON_DEADLINE_S = 60.0
"""How long a worker is asked to stop what a stream left behind. Long on purpose: a stalled (e.g. SIGSTOPped)
worker gets the cancel when it runs again, and does not go on generating a stream that moved elsewhere."""

_ASK_ALL = Backoff(initial_s=0.05, max_s=1.0, warn_after=1000)
"""Cancel asked of every worker: its caller hears which could not be asked, so no warning per Cancel."""
_ABANDON = Backoff(initial_s=0.1, max_s=5.0)
"""Cancel of an abandoned generation: nobody hears of a failure, so a worker that keeps failing is warned of."""


class WorkerCancels:
    """Worker/Cancel calls on behalf of the router.

    Args:
        links: the router's links to its workers.

    """

    _links: Links
    _background: set[asyncio.Task[bool]]
    """Cancels in flight that nobody awaits (held so they are not collected mid-call)."""

    def __init__(self, links: Links) -> None:
        self._links = links
        self._background = set()

    def _keep(self, task: asyncio.Task[bool]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _ask(self, address: str, request_id: str, deadline: float, backoff: Backoff, failures: list[str]) -> bool:
        """Whether the worker held request_id and stops it now; failures gets why it could not be asked."""
        link = self._links.get(address)
        if link is None:  # discovery dropped the worker meanwhile: it holds nothing of ours
            return False
        stub = link.stub(worker_pb2_grpc.WorkerStub)
        loop = asyncio.get_running_loop()
        request = inference_pb2.CancelRequest(request_id=request_id)
        reconnect = Reconnect("cancel", address, backoff, log, loud=False)

        async def attempt() -> None:
            await stub.Cancel(request, timeout=max(0.001, deadline - loop.time()))

        try:
            # The one deadline ends the attempts and the waits between them alike.
            async with asyncio.timeout_at(deadline):
                await reconnect.run(attempt)
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it does not hold it
                failures.append(f"{address} ({describe(exc)})")
            return False
        except TimeoutError:
            failures.append(f"{address} ({reconnect.last_error or 'no answer'} until the deadline)")
            return False
        except grpc.aio.UsageError:  # its channel is closed: the router is stopping
            failures.append(f"{address} (the router is stopping)")
            return False

    def abandon(self, address: str, request_id: str) -> None:
        """Tell a worker, in the background, to stop a generation this router no longer streams."""
        if address not in self._links:
            return
        deadline = asyncio.get_running_loop().time() + ABANDON_DEADLINE_S
        failures: list[str] = []
        self._keep(asyncio.create_task(self._ask(address, request_id, deadline, _ABANDON, failures)))

    def close(self) -> None:
        """Stop the cancels still in flight (the router is stopping; its channels close next)."""
        for task in self._background:
            task.cancel()

    async def everywhere(self, request_id: str, timeout_s: float) -> tuple[bool, list[str]]:
        """Ask every worker at once to stop request_id, within timeout_s.

        Returns (held, not_asked): held as soon as one worker stops it (the
        others' answers come in the background), else False with why each
        worker that could not be asked was not.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        failures: list[str] = []
        asks = [
            asyncio.create_task(self._ask(address, request_id, deadline, _ASK_ALL, failures)) for address in self._links
        ]
        try:
            for answer in asyncio.as_completed(asks):
                if await answer:
                    return True, []
            return False, failures
        finally:
            for ask in asks:
                if not ask.done():
                    self._keep(ask)  # it ends by the deadline


async def cancel(request_id: str, caller: Caller, live: LiveTable, workers: WorkerCancels) -> None:
    """Inference/Cancel: stop the generation on this router's stream, or on whichever worker holds it (NotFound)."""
    require_request_id(request_id)
    held = live.by_id.get(request_id)
    if held is not None and not held.resumed:
        held.cancel()  # one still waiting for a worker slot ends now
        if held.call is not None:
            with contextlib.suppress(grpc.aio.UsageError, grpc.aio.AioRpcError):
                await stop(held.call)
        return
    # No stream of this router runs it (or a Resume follows it): the worker that holds it stops it.
    remaining = caller.time_remaining()
    # Answer before the caller's deadline passes, so it learns NOT_FOUND rather than DEADLINE_EXCEEDED.
    timeout = CANCEL_TIMEOUT_S if remaining is None else min(CANCEL_TIMEOUT_S, 0.9 * remaining)
    stopped, not_asked = await workers.everywhere(request_id, timeout)
    if not stopped:
        unknown = f"no live generation with request_id {request_id!r}"
        if not_asked:
            raise NotFound(f"{unknown} on the workers that answered; could not ask {', '.join(not_asked)}")
        raise NotFound(unknown)
