"""The worker's one backend seam: what the worker needs from an inference engine.

:class:`TritonBackend` (``tokenmesh.worker.triton``) is the implementation every user path
runs. Tests of the worker's own logic may implement :class:`Backend` in memory.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmesh.v1 import inference_pb2, worker_pb2

ADAPTER_SEPARATOR = ":"
"""A request names LoRA adapter ``a`` of model ``m`` as the model ``m:a`` (ListModels lists it so)."""


def parse_adapters(spec: str) -> tuple[str, ...]:
    """The adapter names of a model's ``lora_adapters`` parameter ("name=path,name=path"), in order.

    The model itself checks the paths and loads the files; the worker needs the names only.
    """
    return tuple(item.partition("=")[0].strip() for item in spec.split(",") if item.strip())


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the backend serves."""

    name: str
    """Name callers use."""
    max_context: int
    """Context window per request in tokens (prompt plus output)."""
    slots: int
    """Generations the model runs at once."""
    chat: bool = True
    """It takes a ``messages`` input and applies its chat template (our models do; the stock vLLM backend
    takes a prompt only)."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters the model's repository declares, each served as the model ``<name>:<adapter>`` (the engine
    loads one on demand when it keeps fewer loaded: :class:`AdapterState`)."""
    flags: tuple[str, ...] = ()
    """The vLLM backend's ``return_*`` inputs the model declares: the usage ones (finish reason, token counts) are
    sent true on every request, or that backend reports usage 0 and every end as ``stop``; ``return_logprobs`` only
    with a request that asks for logprobs (``triton._codec.flags``)."""

    def adapter_model(self, adapter: str) -> str:
        """The model name a request uses for one of this model's adapters."""
        return f"{self.name}{ADAPTER_SEPARATOR}{adapter}"


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """One generation, already validated by the router."""

    model: str
    adapter: str = ""
    """The LoRA adapter of the model to apply ('' = the model itself)."""
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    """(role, content) pairs; when set, prompt is ignored."""
    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    """Generate until max_tokens or a stop sequence, past end-of-text."""
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs."""
    logprobs: int | None = None
    """Alternatives per position with each token's log probability (0: the token's alone); None: none."""
    structured: dict[str, Any] | None = None
    """The output's format as vLLM's structured-output parameters (``json``, ``json_object``, ``choice`` or
    ``grammar``); None for free text."""
    flags: tuple[str, ...] = ()
    """Boolean inputs the model declares that are sent true (:attr:`ModelSpec.flags`)."""
    request_id: str = ""
    timeout_s: float | None = None
    """Time left before the caller's deadline."""
    labels: dict[str, str] = field(default_factory=dict)
    trace_context: tuple[tuple[str, str], ...] = ()
    """W3C trace headers (``traceparent``...) for the engine call: Triton, tracing, makes its spans children."""


@dataclass(frozen=True, slots=True)
class Delta:
    """Text generated since the previous event."""

    text: str
    tokens: int
    logprobs: tuple[inference_pb2.TokenLogprob, ...] = ()
    """One per token, when the request asked for logprobs."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The generation ended normally (always the last event)."""

    reason: str
    """"stop", "length" or "cancelled"."""
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    """Of prompt_tokens, those the engine reused from its cache (its own figure; 0 when it gives none)."""


AdapterKey = tuple[str, str]
"""(model, adapter)."""


@dataclass(frozen=True, slots=True)
class AdapterState:
    """The engine's LoRA adapters as it reports them: those loaded now, and its loads and unloads so far."""

    reporting: frozenset[str]
    """The models that report their adapters (another model's adapters all count as loaded)."""
    loaded: frozenset[AdapterKey]
    loads: Mapping[AdapterKey, int]
    """Loads since the engine started, the loads with its models included."""
    unloads: Mapping[AdapterKey, int]
    """Evictions since the engine started (a load at the bound evicts the least recently used)."""

    def has_loaded(self, model: str, adapter: str) -> bool:
        """Whether the engine has model's adapter loaded now (True for a model that does not say)."""
        return model not in self.reporting or (model, adapter) in self.loaded


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's own view of its request queue (Triton: statistics API and metrics)."""

    queued_total: int
    """Requests that have left the engine's queue since it started."""
    queue_ns_total: int
    """Time those requests spent in the queue, in nanoseconds."""
    pending: int | None
    """Requests waiting in its queue now; None when the engine does not say."""
    adapters: AdapterState | None = None
    """Its LoRA adapters; None when it does not say (then every declared adapter counts as loaded)."""


class BackendError(Exception):
    """A generation failed; ``error_class`` is a ``worker_pb2.ErrorClass``."""

    def __init__(self, error_class: worker_pb2.ErrorClass, message: str) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message


class Generation(abc.ABC):
    """A running generation: iterate for events, cancel to stop it.

    Iteration yields :class:`Delta` events and ends with one :class:`Finished`
    (reason "cancelled" after :meth:`cancel`), or raises :class:`BackendError`.
    """

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        """Events in order."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the generation in the engine; safe to call at any time, twice."""


class Backend(abc.ABC):
    """An inference engine the worker forwards generations to."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start or connect; return once every model is ready."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the engine; idempotent."""

    @abc.abstractmethod
    async def restart(self) -> None:
        """Bring a crashed or broken engine back (running generations fail); return once ready."""

    async def failed(self) -> str:
        """Wait until the engine dies by itself; return why. Never returns for engines that cannot tell."""
        await asyncio.Event().wait()
        return ""

    async def engine_stats(self) -> EngineStats | None:
        """The engine's queue figures now; None for engines that keep none."""
        return None

    @abc.abstractmethod
    def models(self) -> list[ModelSpec]:
        """Models served (valid after start)."""

    @abc.abstractmethod
    def generate(self, params: GenerationParams) -> Generation:
        """Begin a generation."""

    @property
    def pid(self) -> int | None:
        """PID of the engine process this backend started; None when it started none."""
        return None

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where the engine listens (host:port), for operators and tools."""
