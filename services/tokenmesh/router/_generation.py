"""One generation's state through the router, as one object: what each step of its failover loop reads and updates."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmesh.router._live import Live
from tokenmesh.router._observe import Observation
from tokenmesh.router._pool import Affinity
from tokenmesh.router._quotas import Grant
from tokenmesh.v1 import inference_pb2


class Caller(Protocol):
    """What a generation uses of its caller's call: a gRPC call's context, or one stream of a GenerateStream call."""

    def invocation_metadata(self) -> Any:
        """The caller's metadata (its trace context, its identity)."""

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline (None: no deadline)."""


@dataclass
class Progress:
    """What of a generation has reached the caller (survives failover)."""

    seq: int = 0
    """Last seq sent."""
    text: list[str] = field(default_factory=list)
    """Text pieces sent, in order."""
    tokens: int = 0
    """Tokens sent."""
    migrations: int = 0
    """Times the generation moved to another worker after output began."""
    started: float = field(default_factory=time.monotonic)
    """When the router received the request."""
    timing: inference_pb2.Timing = field(default_factory=inference_pb2.Timing)
    """Where the time to the first token went (sent on the final chunk)."""


@dataclass(eq=False)
class Generation:
    """A generation the router admitted: its request, caller, tenant, placement, observer, quota and progress."""

    base: inference_pb2.GenerateRequest
    """The request as the router runs it (its request_id, model and max_tokens set)."""
    caller: Caller
    tenant: str
    affinity: Affinity
    observe: Observation
    live: Live
    grant: Grant
    """Its reservation in the tenant's quota, settled when it ends."""
    resumable: bool
    """The caller chose its request_id: a worker keeps it for Resume when the caller goes away."""
    progress: Progress = field(default_factory=Progress)
    attempts: int = 0
    """Failed attempts in a row with no chunk delivered between them."""
    requeued: bool = False
    """The last start was refused by a worker at its limit: the next wait is ahead of the queue."""

    @property
    def request_id(self) -> str:
        """The generation's request_id."""
        return self.base.request_id
