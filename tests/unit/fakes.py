"""An in-memory backend behind the worker's seam, for unit tests of router and worker logic."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tokenmesh.v1 import worker_pb2
from tokenmesh.worker.backend import Backend, BackendError, Delta, Finished, Generation, GenerationParams, ModelSpec


class FakeGeneration(Generation):
    """Streams "tok0 tok1 ..." (max_tokens of them), one every `delay` seconds.

    Prompts starting with "fail-invalid" / "fail-backend" raise the matching
    BackendError before the first token.
    """

    def __init__(self, backend: FakeBackend, params: GenerationParams) -> None:
        self.backend = backend
        self.params = params
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:  # type: ignore[override]
        self.backend.started.append(self)
        prompt = self.params.prompt or self.params.messages[-1][1]
        if prompt.startswith("fail-invalid"):
            raise BackendError(worker_pb2.ERROR_CLASS_INVALID_REQUEST, "request exceeds the available context size")
        if prompt.startswith("fail-backend"):
            raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, "Stub process is not healthy")
        for i in range(self.params.max_tokens):
            if self.cancelled.is_set():
                yield Finished("cancelled", 3, i)
                return
            try:
                await asyncio.wait_for(self.cancelled.wait(), self.backend.delay)
            except TimeoutError:
                pass
            else:
                yield Finished("cancelled", 3, i)
                return
            yield Delta(f"tok{i} ", 1)
        yield Finished("length", 3, self.params.max_tokens)


class FakeBackend(Backend):
    def __init__(self, delay: float = 0.001, name: str = "fake", max_context: int = 512) -> None:
        self.delay = delay
        self.started: list[FakeGeneration] = []
        self._spec = ModelSpec(name=name, max_context=max_context, slots=4)
        self.running = False

    async def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    def models(self) -> list[ModelSpec]:
        return [self._spec]

    def generate(self, params: GenerationParams) -> Generation:
        return FakeGeneration(self, params)

    async def ready(self) -> bool:
        return self.running

    @property
    def endpoint(self) -> str:
        return "memory"
