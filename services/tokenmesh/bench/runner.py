"""Load generation for ``tokenmesh bench``: closed loop (fixed concurrency) or open loop (Poisson arrivals)."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenmesh.bench.metrics import RequestResult
from tokenmesh.bench.prompts import Prompt
from tokenmesh.bench.targets import Target


@dataclass(frozen=True, kw_only=True)
class Load:
    """How requests are issued."""

    concurrency: int = 8
    """Closed loop: this many requests in flight, a new one as soon as one ends."""
    request_rate: float | None = None
    """Open loop: Poisson arrivals at this many requests/s (concurrency then only caps what is in flight)."""
    duration_s: float | None = None
    """Stop sending after this long (the prompt set is cycled); None sends each prompt once."""
    seed: int = 0


class Progress:
    """A one-line live progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int | None, enabled: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.errors = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._shown = 0.0

    def update(self, result: RequestResult) -> None:
        """Count a finished request; redraw at most 10 times a second."""
        self.done += 1
        self.errors += not result.ok
        self.tokens += result.output_tokens
        now = time.monotonic()
        if self.enabled and (now - self._shown > 0.1 or self.done == self.total):
            self._shown = now
            elapsed = max(now - self.started, 1e-9)
            if self.total:
                filled = int(30 * self.done / self.total)
                bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
            else:
                bar = f"{self.done} requests"
            sys.stderr.write(
                f"\r{self.label:>8} {bar}  {self.done / elapsed:6.2f} req/s  "
                f"{self.tokens / elapsed:8.1f} tok/s  errors {self.errors}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def _one(target: Target, prompt: Prompt) -> RequestResult:
    result = RequestResult(target=target.name, sent=time.monotonic())
    await target.run(prompt, result)
    return result


async def drive(
    target: Target, prompts: Sequence[Prompt], load: Load, on_done: Callable[[RequestResult], None] = lambda r: None
) -> list[RequestResult]:
    """Run prompts against target under load; results in completion order."""
    results: list[RequestResult] = []
    deadline = time.monotonic() + load.duration_s if load.duration_s else None

    index = 0

    def next_prompt() -> Prompt | None:
        nonlocal index
        if deadline is None and index >= len(prompts):
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
        prompt = prompts[index % len(prompts)]
        index += 1
        return prompt

    def finished(result: RequestResult) -> None:
        results.append(result)
        on_done(result)

    if load.request_rate is None:

        async def loop() -> None:
            while (prompt := next_prompt()) is not None:
                finished(await _one(target, prompt))

        await asyncio.gather(*(loop() for _ in range(load.concurrency)))
        return results

    rng = random.Random(load.seed)
    cap = asyncio.Semaphore(load.concurrency)
    tasks: set[asyncio.Task[None]] = set()

    async def send(prompt: Prompt) -> None:
        async with cap:
            finished(await _one(target, prompt))

    while (prompt := next_prompt()) is not None:
        task = asyncio.create_task(send(prompt))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await asyncio.sleep(rng.expovariate(load.request_rate))
    await asyncio.gather(*tasks)
    return results
