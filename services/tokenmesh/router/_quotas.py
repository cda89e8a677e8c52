"""Quotas per tenant at the router's admission: reserve a generation's worst case, settle what it used at its end.

A generation of a tenant with a quota (:mod:`tokenmesh.router._quota_file`)
reserves, before it is admitted, one request, one running generation and its
worst case in tokens: its prompt's tokens plus ``max_tokens``. The router has
no tokenizer, so the prompt counts one token per UTF-8 byte (plus the chat
template's tokens): byte-level BPE tokenizers (SmolLM2's, Llama's, GPT's)
never make more tokens than bytes, so the estimate is an upper bound, capped
at the model's context. At the end the unused part is given back (the final
chunk's usage says what was used). Reservations are checked and taken in one
step, so concurrent requests can never take more than the quota together.

The window slides (:mod:`tokenmesh.router._quota_window`): any stretch of
``window_s`` seconds holds at most the quota.

Where the counts live: in this router (:class:`LocalStore`, one router), or
in Redis for every router of the mesh (:mod:`tokenmesh.router._quota_redis`,
``--quota-redis-url``). While Redis cannot be reached the router fails open:
it grants from a local budget, its share of each quota (the quota divided by
the routers Redis last counted), until Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmesh.config import ConfigError
from tokenmesh.errors import ResourceExhausted
from tokenmesh.router._quota_file import ANY_TENANT, Limits, load_quotas
from tokenmesh.router._quota_window import LocalStore, Verdict
from tokenmesh.v1 import inference_pb2

if TYPE_CHECKING:
    from tokenmesh.router._quota_redis import RedisStore

log = logging.getLogger(__name__)

RAW_PROMPT_OVERHEAD = 4
"""Tokens a raw prompt may gain besides its bytes (beginning/end-of-text tokens)."""
MESSAGE_OVERHEAD = 8
"""Tokens the chat template adds per message (role and its markers)."""
CHAT_OVERHEAD = 48
"""Tokens the chat template adds once (a default system prompt, the assistant's opening)."""
CHECK_S = 1.0
"""How often the quota file is checked for a change, and Redis told this router is alive."""
ROUTERS_SETTLE_S = 10.0
"""How long Redis must count fewer routers before this router's share grows (twice a gone router's expiry)."""

REASONS = {
    "concurrent": "QUOTA_CONCURRENT",
    "requests": "QUOTA_REQUESTS_PER_MINUTE",
    "tokens": "QUOTA_TOKENS_PER_MINUTE",
    "too_large": "QUOTA_TOKENS_PER_MINUTE",
}
"""ErrorInfo reason of a refusal, by the limit that refused it."""
FIGURES = (
    "limit_requests",
    "remaining_requests",
    "reset_requests_s",
    "limit_tokens",
    "remaining_tokens",
    "reset_tokens_s",
)
"""The RateLimits fields, also the names of a refusal's ErrorInfo metadata."""


def estimate_prompt_tokens(request: inference_pb2.GenerateRequest, max_context: int) -> int:
    """An upper bound of the prompt's tokens without a tokenizer: its UTF-8 bytes and the template's tokens."""
    if request.messages:
        size = CHAT_OVERHEAD + sum(MESSAGE_OVERHEAD + len(m.content.encode()) for m in request.messages)
    else:
        size = RAW_PROMPT_OVERHEAD + len(request.prompt.encode())
    return min(size, max_context)


class Grant:
    """A generation's reservation: stamps its first chunk with the figures, settles at the end.

    Args:
        quotas: where it is settled.
        tenant: whose quota.
        reserved: tokens reserved (prompt estimate + max_tokens).
        prompt: the prompt's estimate, counted as used once the generation reached a worker.
        slot: the slot it was counted in.
        shared: taken from Redis (else from this router's counts).
        figures: the quota after the reservation.

    """

    quotas: Quotas | None
    tenant: str
    reserved: int
    prompt: int
    slot: int
    shared: bool
    figures: inference_pb2.RateLimits
    tokens: int
    """Completion tokens relayed so far."""
    used: int | None
    """Prompt + completion tokens of the final chunk's usage, once it passed."""

    def __init__(  # wide: a grant's fields, set once when it is reserved
        self,
        quotas: Quotas | None,
        tenant: str,
        reserved: int,
        prompt: int,
        slot: int,
        shared: bool,
        figures: inference_pb2.RateLimits,
    ) -> None:
        self.quotas = quotas
        self.tenant = tenant
        self.reserved = reserved
        self.prompt = prompt
        self.slot = slot
        self.shared = shared
        self.figures = figures
        self.tokens = 0
        self.used = None

    def saw(self, piece: inference_pb2.GenerateChunk) -> None:
        """A chunk on its way to the caller: the first carries the figures, the last says what was used."""
        if piece.seq == 1:
            piece.rate_limits.CopyFrom(self.figures)
        self.tokens += piece.token_count
        if piece.finish_reason:
            self.used = piece.usage.prompt_tokens + piece.usage.completion_tokens

    def spent(self) -> int:
        """Tokens to count: the final usage; without one, the prompt's estimate and what streamed (0: none)."""
        if self.used is not None:
            return self.used
        return self.prompt + self.tokens if self.tokens else 0

    def settle(self) -> None:
        """Give back what was not used (once)."""
        quotas, self.quotas = self.quotas, None
        if quotas is not None:
            quotas.settle(self)


class _NoGrant(Grant):
    """A generation without a quota: nothing to stamp or settle."""

    def saw(self, piece: inference_pb2.GenerateChunk) -> None:
        pass

    def settle(self) -> None:
        pass


NO_GRANT: Grant = _NoGrant(None, "", 0, 0, 0, False, inference_pb2.RateLimits())
"""The grant of every generation whose tenant has no quota."""


def rate_limits(limits: Limits, verdict: Verdict) -> inference_pb2.RateLimits:
    """The figures a chunk carries (the gateway's x-ratelimit-* headers)."""
    figures = inference_pb2.RateLimits()
    if limits.requests is not None:
        figures.limit_requests = limits.requests
        figures.remaining_requests = max(0, limits.requests - verdict.used_requests)
        figures.reset_requests_s = round(verdict.reset_requests_s, 3)
    if limits.tokens is not None:
        figures.limit_tokens = limits.tokens
        figures.remaining_tokens = max(0, limits.tokens - verdict.used_tokens)
        figures.reset_tokens_s = round(verdict.reset_tokens_s, 3)
    return figures


def refusal(tenant: str, limits: Limits, verdict: Verdict, need: int, prompt: int) -> ResourceExhausted:
    """The RESOURCE_EXHAUSTED of a refused reservation, with its figures in ErrorInfo and RetryInfo when it fits."""
    figures = rate_limits(limits, verdict)
    metadata = {"tenant": tenant, "reserve_tokens": str(need)}
    for name in FIGURES:
        if figures.HasField(name):
            metadata[name] = str(getattr(figures, name))
    hint = "" if verdict.retry_s is None else f"; retry in about {verdict.retry_s:.1f} s"
    quota = f"tenant {tenant!r}"
    messages = {
        "concurrent": f"{quota} has {limits.concurrent} generations running, its quota; retry when one ends",
        "requests": f"{quota} made its {limits.requests} requests of this minute{hint}",
        "tokens": f"{quota} has {verdict.used_tokens} of its {limits.tokens} tokens per minute used or reserved, "
        f"and this request reserves {need} (prompt estimated at {prompt} + max_tokens){hint}",
        "too_large": f"this request reserves {need} tokens (prompt estimated at {prompt} + max_tokens), more than "
        f"{quota}'s whole quota of {limits.tokens} tokens per minute: lower max_tokens or shorten the prompt",
    }
    none = {"concurrent": limits.concurrent, "requests": limits.requests}.get(verdict.refused, limits.tokens) == 0
    if none:
        messages[verdict.refused] = f"{quota} may run no generation: its quota in the quota file allows none"
    return ResourceExhausted(
        messages[verdict.refused],
        reason=REASONS[verdict.refused],
        metadata=metadata,
        field="max_tokens" if verdict.refused == "too_large" else "",
        retry_delay=verdict.retry_s,
    )


class Quotas:
    """The tenants' quotas at admission: the limits in force (reloaded on change) and where the counts live.

    Args:
        path: the quota file; "" for none (no generation is limited).
        window_s: the quota's window.
        redis_url: the Redis every router shares; "" for counts in this router only.
        router: this router's id in Redis (default: host name, pid and a random part).
        processes: processes of this router (--processes), without Redis each counting its share.

    """

    path: str
    limits: dict[str, Limits]
    """Per tenant, from the file (ANY_TENANT: every tenant it does not list)."""
    local: LocalStore
    shared: RedisStore | None
    shared_up: bool
    """Redis answered last time; while not, the router grants from its share of each quota (local)."""
    processes: int
    """Processes of this router (--processes): without Redis each grants 1/processes of each quota."""
    routers: int
    """Routers Redis last counted alive (this one's share of a quota while Redis is down is 1/routers)."""
    held: Counter[str]
    """Generations this router runs on Redis's counts, per tenant."""
    unsynced: set[str]
    """Tenants whose running count in Redis may be wrong (a release that failed): rewritten once it answers."""
    on_refusal: Callable[[str, str], None]
    """Told (tenant, limit) of each refusal (the router's metrics)."""
    store_errors: tuple[type[Exception], ...]
    """What a call to Redis raises when Redis is down or slow (redis-py's errors, OSError)."""
    _stamp: bytes | None
    _fewer_since: float | None
    """Since when Redis counts fewer routers than ``routers`` (monotonic)."""
    releasing: set[asyncio.Task[None]]
    """Releases on their way to Redis."""

    def __init__(self, path: str, window_s: float, redis_url: str = "", router: str = "", processes: int = 1) -> None:
        self.path = path
        self.processes = processes
        self.limits = load_quotas(path) if path else {}
        self._stamp = self._file_stamp()
        self.local = LocalStore(window_s)
        self.shared = None
        self.store_errors = (OSError,)
        if redis_url:
            # Only a router that uses Redis imports redis-py.
            from redis.exceptions import RedisError

            from tokenmesh.router._quota_redis import RedisStore

            router = router or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.shared = RedisStore(redis_url, router, window_s)
            self.store_errors = (RedisError, OSError)
        self.shared_up = True
        self.routers = 1
        self._fewer_since = None
        self.held = Counter()
        self.unsynced = set()
        self.releasing = set()
        self.on_refusal = lambda tenant, limit: None

    def limits_for(self, tenant: str) -> Limits | None:
        """The tenant's quota (its own, else the file's "*"); None: not limited."""
        return self.limits.get(tenant, self.limits.get(ANY_TENANT))

    async def reserve(
        self, request: inference_pb2.GenerateRequest, tenant: str, max_context: Callable[[], int]
    ) -> Grant:
        """Reserve the request's worst case for tenant; ResourceExhausted when its quota has no room.

        max_context gives the model's context (asked only when the tenant has a quota): no prompt is longer.
        """
        limits = self.limits_for(tenant)
        if limits is None:
            return NO_GRANT
        prompt = estimate_prompt_tokens(request, max_context())
        need = prompt + request.max_tokens
        verdict, shared = await self._judge(tenant, limits, need)
        if verdict.refused:
            self.on_refusal(tenant, verdict.refused)
            raise refusal(tenant, limits, verdict, need, prompt)
        return Grant(self, tenant, need, prompt, verdict.slot, shared, rate_limits(limits, verdict))

    async def _judge(self, tenant: str, limits: Limits, need: int) -> tuple[Verdict, bool]:
        """The verdict of Redis while it answers, else of this router's counts (with its share of the quota)."""
        if self.shared is not None and self.shared_up:
            self.held[tenant] += 1  # before the answer: a rewrite of the count meanwhile counts it (never too few)
            try:
                verdict = await self.shared.reserve(tenant, limits, need)
            except self.store_errors as exc:
                self.unsynced.add(tenant)  # it may have been taken before the answer was lost
                self._let_go(tenant)
                self._lost(exc)
            except asyncio.CancelledError:  # the caller went away meanwhile: its running count is rewritten
                self.unsynced.add(tenant)
                self._let_go(tenant)
                raise
            else:
                if verdict.refused:
                    self._let_go(tenant)
                return verdict, True
        # Processes of one router (--processes) count apart: each grants its share, as it does of worker slots.
        share = limits.share(self.routers if self.shared is not None else self.processes)
        return self.local.reserve(tenant, share, need), False

    def settle(self, grant: Grant) -> None:
        """The generation ended: give back what it did not use (or count what it used beyond the reservation)."""
        refund = grant.reserved - grant.spent()
        if not grant.shared:
            self.local.release(grant.tenant, grant.slot, refund)
            return
        self._let_go(grant.tenant)
        task = asyncio.get_running_loop().create_task(self._release_shared(grant.tenant, grant.slot, refund))
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)

    async def _release_shared(self, tenant: str, slot: int, refund: int) -> None:
        assert self.shared is not None
        try:
            await self.shared.release(tenant, slot, refund)
        except self.store_errors as exc:
            self.unsynced.add(tenant)  # the refund is lost (the window keeps it), the running count is rewritten
            self._lost(exc)

    def _let_go(self, tenant: str) -> None:
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]

    def _lost(self, exc: BaseException) -> None:
        if self.shared_up:
            log.warning(
                "quota store unreachable (%s): this router grants 1/%d of each quota on its own until it answers",
                type(exc).__name__,
                self.routers,
            )
        self.shared_up = False

    async def run(self) -> None:
        """Every CHECK_S: reload the quota file when it changed; tell Redis this router is alive."""
        while True:
            self.reload()
            if self.shared is not None:
                await self.check_shared()
            await asyncio.sleep(CHECK_S)

    async def check_shared(self) -> None:
        """Renew this router in Redis and learn how many there are; rewrite the running counts it may have missed."""
        assert self.shared is not None
        try:
            if not self.shared_up:
                await self.shared.reconnect()  # connections from before an outage may be dead: new ones
            self._count_routers(await self.shared.alive())
            if self.unsynced:
                unsynced, self.unsynced = self.unsynced, set()
                await self.shared.set_running({tenant: self.held[tenant] for tenant in unsynced})
        except self.store_errors as exc:
            self._lost(exc)
            return
        if not self.shared_up:
            log.info("quota store answers again: quotas are shared by the %d routers again", self.routers)
        self.shared_up = True

    def _count_routers(self, alive: int) -> None:
        """Take Redis's count of routers; a lower one only once it held ROUTERS_SETTLE_S.

        A Redis that restarted empty counts only the routers that renewed since: taken at once, a share for
        the next outage would be too large.
        """
        now = time.monotonic()
        if alive >= self.routers:
            self.routers, self._fewer_since = alive, None
        elif self._fewer_since is None:
            self._fewer_since = now
        elif now - self._fewer_since >= ROUTERS_SETTLE_S:
            self.routers, self._fewer_since = max(1, alive), None

    def reload(self) -> bool:
        """Read the quota file again if it changed; a file with a mistake is logged and the limits in force stay."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.limits = load_quotas(self.path)
        except ConfigError as exc:
            log.error("%s; the quotas in force stay", exc)  # noqa: TRY400 - one line, the file's mistake
            return False
        log.info("quota file %s reloaded: %d entries", self.path, len(self.limits))
        return True

    def _file_stamp(self) -> bytes | None:
        """The file's bytes (a small file: reading it is cheaper than trusting mtime's coarse ticks)."""
        if not self.path:
            return None
        try:
            return Path(self.path).read_bytes()
        except OSError:
            return None

    async def close(self) -> None:
        """Let the releases in flight finish (briefly), close Redis's connections."""
        if self.releasing:
            await asyncio.wait(self.releasing, timeout=1.0)
        if self.shared is not None:
            with contextlib.suppress(*self.store_errors):
                await self.shared.close()
