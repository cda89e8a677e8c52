"""Background responses this gateway follows: each one's chunks so far, kept in memory for a bounded retention.

A background response is a generation with a gateway-chosen request id,
``bg-<created>-<32 hex>`` (its Response id is ``resp_bg-...``): the id says
when it was created and that it is a background one, so any gateway can
tell it apart from an id it never saw and from one that has expired. The
gateway that starts it follows it (a task reading its chunks into a
:class:`Kept`); every retrieve, streamed or not, on that gateway reads from
there, so one generation has one reader on the mesh however many callers
watch it (a router refuses a second stream of one id).

When that gateway stops (or dies), its follow stream ends and the worker
keeps the generation running for its resume grace (``--resume-grace-s``, 30 s):
the first retrieve on any gateway within that time adopts it, re-reading it
from the start with ``Resume`` (through any router) and following it from
then on. What the mesh does not keep is the request: an adopted response's
``metadata``, ``instructions`` and sampling fields are null or empty; its
text, status, usage, model and ``created_at`` are exact.

Bounds: a response is kept ``retention_s`` from its creation (a generation
still running then is cancelled), and at most ``max_kept`` at once (the
oldest finished one makes room; with every one still running, a new one is
429). Nothing survives past retention anywhere, so a later retrieve is a
404 that says it expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from tokenmesh.errors import MeshError, Unavailable
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import HttpError, from_mesh
from tokenmesh_gateway._responses_sse import STATUS, Head, Outcome

log = logging.getLogger(__name__)

BACKGROUND_ID = re.compile(r"bg-(\d{1,12})-[0-9a-f]{32}")
"""A background response's request id: its creation (Unix seconds) and a random part."""


def background_id(created_at: int) -> str:
    """A fresh request id for a background response created at created_at."""
    return f"bg-{created_at}-{uuid.uuid4().hex}"


def created_of(request_id: str) -> int | None:
    """When the background response with this request id was created; None for any other id."""
    match = BACKGROUND_ID.fullmatch(request_id)
    return int(match.group(1)) if match else None


class Kept:
    """One background response this gateway follows: its chunks so far, its end, and who waits for more.

    Args:
        mesh_id: the generation's id on the mesh (with its tenant's prefix).
        head: the Response's id, creation, model and echo (an adopted one's echo is empty).

    """

    mesh_id: str
    head: Head
    chunks: list[inference_pb2.GenerateChunk]
    """Every chunk so far, seq 1, 2, 3... (the final one last)."""
    error: MeshError | None
    """Why it failed (after or before its first chunk)."""
    completed_at: int | None
    task: asyncio.Task[None] | None
    """The follow task (reads the mesh's stream into chunks)."""
    on_lost: Callable[[], object] | None
    """Called when the follow stream fails before its first chunk (an adopted response: nothing is known of it,
    so it is forgotten, not recorded as failed; the next retrieve tries again)."""
    _changed: asyncio.Event
    """Set, and replaced, on every new chunk and at the end."""

    def __init__(self, mesh_id: str, head: Head, on_lost: Callable[[], object] | None = None) -> None:
        self.mesh_id = mesh_id
        self.head = head
        self.on_lost = on_lost
        self.chunks = []
        self.error = None
        self.completed_at = None
        self.task = None
        self._changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        """Its final chunk or its error came (or its follow task ended)."""
        return self.error is not None or bool(self.chunks and self.chunks[-1].finish_reason) or self._stopped

    @property
    def _stopped(self) -> bool:
        return self.task is not None and self.task.done()

    def follow(self, chunks: AsyncGenerator[inference_pb2.GenerateChunk, None]) -> None:
        """Start reading the generation's chunks (the follow task)."""
        self.task = asyncio.create_task(self._follow(chunks), name=f"follow {self.mesh_id}")

    async def _follow(self, chunks: AsyncGenerator[inference_pb2.GenerateChunk, None]) -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if not self.chunks and chunk.model and chunk.model != self.head.model:
                        self.head = replace(self.head, model=chunk.model)  # the model the router chose
                    self.chunks.append(chunk)
                    if chunk.finish_reason:
                        self.completed_at = int(time.time())
                    self._wake()
        except MeshError as error:
            self.error = error
            if not self.chunks and self.on_lost is not None:
                self.on_lost()
        except Exception as error:  # a fault of ours: this response fails, every other goes on
            log.exception("gateway: following %s failed", self.mesh_id)
            self.error = MeshError(f"the gateway failed following this response: {error}")
        finally:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def started(self, wait_s: float) -> None:
        """Wait up to wait_s for the first chunk or the end (what a new response's POST answers after)."""
        if not self.chunks and not self.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)

    async def caught_up(self, gap_s: float, wait_s: float) -> None:
        """Wait up to wait_s for the end, or for a gap of gap_s after some chunks.

        An adopted response's replay comes at once: a gap means what follows is live, so the output so far is
        all there is now.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while not self.finished and (left := end - loop.time()) > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), min(gap_s, left))
            except TimeoutError:
                if self.chunks:
                    return

    async def settled(self, wait_s: float) -> None:
        """Wait up to wait_s for the end (a cancel's answer)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while not self.finished and (left := end - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def replay(self) -> AsyncGenerator[inference_pb2.GenerateChunk, None]:
        """Every chunk from seq 1, then each new one as it comes, to the final one; the error if it failed."""
        position = 0
        while True:
            changed = self._changed
            while position < len(self.chunks):
                position += 1
                yield self.chunks[position - 1]
            if self.error is not None:
                raise self.error
            if self.finished:
                if not (self.chunks and self.chunks[-1].finish_reason):
                    raise Unavailable(
                        f"this gateway stopped following response {self.head.request_id}; retrieve it again "
                        "(from another gateway)"
                    )
                return
            await changed.wait()

    def outcome(self) -> Outcome:
        """Its status and text now."""
        text = "".join(chunk.text for chunk in self.chunks)
        final = self.chunks[-1] if self.chunks and self.chunks[-1].finish_reason else None
        if self.error is not None:
            return Outcome("failed", text, final, from_mesh(self.error), self.completed_at)
        if final is not None:
            return Outcome(STATUS.get(final.finish_reason, "failed"), text, final, completed_at=self.completed_at)
        return Outcome("in_progress" if self.chunks else "queued", text)


class ResponseStore:
    """The background responses this gateway follows, by mesh id: bounded in count and in time.

    Args:
        retention_s: how long a response is kept from its creation.
        max_kept: the most kept at once.
        cancel: cancels a generation on the mesh by its mesh id (one still running at the end of its retention).

    """

    retention_s: float
    max_kept: int
    kept: OrderedDict[str, Kept]
    """Oldest first."""
    _cancel: Callable[[str], Awaitable[object]]
    _cancels: set[asyncio.Task[object]]
    """Cancels on their way (each ends within the client's retry deadline)."""

    def __init__(self, retention_s: float, max_kept: int, cancel: Callable[[str], Awaitable[object]]) -> None:
        self.retention_s = retention_s
        self.max_kept = max_kept
        self.kept = OrderedDict()
        self._cancel = cancel
        self._cancels = set()

    def expired(self, created_at: int) -> bool:
        """Whether a response created then is past its retention."""
        return time.time() > created_at + self.retention_s

    def get(self, mesh_id: str) -> Kept | None:
        """The response kept by that id, None when there is none (or no longer)."""
        self._expire()
        return self.kept.get(mesh_id)

    def add(self, kept: Kept) -> None:
        """Keep a response; 429 when max_kept are kept and every one still runs."""
        self._expire()
        if len(self.kept) >= self.max_kept:
            oldest = next((k for k in self.kept.values() if k.finished), None)
            if oldest is None:
                raise HttpError(
                    429,
                    f"this gateway follows {self.max_kept} background responses already, none finished; "
                    "retry later or send the request to another gateway",
                    code="resource_exhausted",
                    retry_after_ms=1000,
                )
            self.remove(oldest.mesh_id)
        self.kept[kept.mesh_id] = kept

    def remove(self, mesh_id: str) -> Kept | None:
        """Stop keeping a response (its follow task is cancelled: a running generation detaches)."""
        kept = self.kept.pop(mesh_id, None)
        if kept is not None and kept.task is not None:
            kept.task.cancel()
        return kept

    def forget(self, kept: Kept) -> None:
        """Stop keeping kept, if it is still the one kept by its id."""
        if self.kept.get(kept.mesh_id) is kept:
            del self.kept[kept.mesh_id]

    def _expire(self) -> None:
        """Drop the responses past their retention (oldest first), cancelling those still running."""
        while self.kept:
            kept = next(iter(self.kept.values()))
            if not self.expired(kept.head.created_at):
                return
            self.remove(kept.mesh_id)
            if not kept.finished:
                log.info("background response %s: its retention ended while it ran; cancelled", kept.mesh_id)
                task: asyncio.Task[object] = asyncio.ensure_future(self._cancel_quietly(kept.mesh_id))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    async def _cancel_quietly(self, mesh_id: str) -> object:
        with contextlib.suppress(MeshError):
            return await self._cancel(mesh_id)
        return None

    async def close(self) -> None:
        """Stop following every response: the running generations detach, resumable elsewhere for the grace."""
        tasks: list[asyncio.Future[Any]] = [k.task for k in self.kept.values() if k.task is not None]
        for task in tasks:
            task.cancel()
        tasks += self._cancels
        if tasks:
            await asyncio.wait(tasks, timeout=2)
        self.kept.clear()
