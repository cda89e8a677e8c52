"""An in-memory backend behind the worker's seam, for unit tests of router and worker logic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker import (
    Backend,
    BackendError,
    Delta,
    EngineStats,
    Finished,
    Generation,
    GenerationParams,
    ModelSpec,
)


class FakeGeneration(Generation):
    """Streams "tokN " tokens, one every `delay` seconds, like a deterministic model.

    N continues from the "tok" tokens already in the prompt (or in a trailing
    assistant message), as a real model continues a prefilled answer, so a
    generation split over workers must still read tok0 tok1 tok2 ...
    Prompts starting with "fail-invalid" / "fail-backend" raise the matching
    BackendError before the first token; the backend's fail_after / stall_after
    break it after that many tokens.
    """

    def __init__(self, backend: FakeBackend, params: GenerationParams) -> None:
        self.backend = backend
        self.params = params
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:  # type: ignore[override]
        self.started_at = time.monotonic()
        self.backend.started.append(self)
        params = self.params
        prompt = params.prompt or params.messages[-1][1]
        if prompt.startswith("fail-invalid"):
            raise BackendError(worker_pb2.ERROR_CLASS_INVALID_REQUEST, "request exceeds the available context size")
        if prompt.startswith("fail-backend"):
            raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, "Stub process is not healthy")
        if self.backend.fault_once is not None:
            error_class, message = self.backend.fault_once
            self.backend.fault_once = None
            raise BackendError(error_class, message)
        if self.backend.engine_slots is not None:
            # Like an engine with that many slots: the rest wait in its queue.
            queued_at = time.monotonic()
            self.backend.waiting += 1
            try:
                await self.backend.engine_slots.acquire()
            finally:
                self.backend.waiting -= 1
            self.backend.queued_total += 1
            self.backend.queue_ns_total += int((time.monotonic() - queued_at) * 1e9)
        try:
            async for event in self._tokens(params, prompt):
                yield event
        finally:
            if self.backend.engine_slots is not None:
                self.backend.engine_slots.release()

    async def _tokens(self, params: GenerationParams, prompt: str) -> AsyncIterator[Delta | Finished]:
        prefilled = params.prompt if params.prompt else (prompt if params.messages[-1][0] == "assistant" else "")
        first = prefilled.count("tok")
        for i in range(params.max_tokens):
            if i == self.backend.fail_after:
                raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, "CUDA error: an illegal memory access")
            if i == self.backend.stall_after:
                await self.cancelled.wait()
            try:
                await asyncio.wait_for(self.cancelled.wait(), self.backend.delay)
            except TimeoutError:
                pass
            if self.cancelled.is_set():
                yield Finished("cancelled", 3, i)
                return
            yield Delta(f"tok{first + i} ", 1, _logprobs(f"tok{first + i} ", params.logprobs))
        yield Finished("length", 3 + first, params.max_tokens, self.backend.cached_prompt_tokens)


def _logprobs(token: str, alternatives: int | None) -> tuple[inference_pb2.TokenLogprob, ...]:
    """What the fake engine says of its token: logprob -0.25, alternatives -0.25, -0.5, ... (None: none asked)."""
    if alternatives is None:
        return ()
    top = [inference_pb2.TopLogprob(token=f"alt{k}", logprob=-0.25 * (k + 1)) for k in range(alternatives)]
    return (inference_pb2.TokenLogprob(token=token, logprob=-0.25, top_logprobs=top, bytes=token.encode()),)


class FakeBackend(Backend):
    def __init__(
        self,
        delay: float = 0.001,
        name: str = "fake",
        max_context: int = 512,
        chat: bool = True,
        adapters: tuple[str, ...] = (),
        slots: int = 4,
    ) -> None:
        self.delay = delay
        self.fail_after: int | None = None
        self.stall_after: int | None = None
        self.started: list[FakeGeneration] = []
        self._spec = ModelSpec(name=name, max_context=max_context, slots=slots, chat=chat, adapters=adapters)
        self.running = False
        self.restarts = 0
        self.fault_once: tuple[int, str] | None = None
        """The next generation on this backend fails with (error_class, message)."""
        self.engine_slots: asyncio.Semaphore | None = None
        """When set, generations wait for one of these before their first token (an engine queue)."""
        self.waiting = 0
        self.queued_total = 0
        self.queue_ns_total = 0
        self.cached_prompt_tokens = 0
        """What a finished generation reports as its prompt tokens reused from the engine's cache."""

    async def engine_stats(self) -> EngineStats | None:
        if self.engine_slots is None:
            return None
        return EngineStats(queued_total=self.queued_total, queue_ns_total=self.queue_ns_total, pending=self.waiting)

    async def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    async def restart(self) -> None:
        self.restarts += 1
        self.running = True

    def models(self) -> list[ModelSpec]:
        return [self._spec]

    def generate(self, params: GenerationParams) -> Generation:
        return FakeGeneration(self, params)

    @property
    def endpoint(self) -> str:
        return "memory"
