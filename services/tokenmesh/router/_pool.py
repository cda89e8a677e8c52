"""The router's view of its workers and how it picks one.

Each worker has a weight from the prober's latest table (or, before any table,
1.0 for every worker whose health the router sees SERVING) and a concurrency
limit. Only workers with weight > 0 and a free slot are candidates. Among
them the least loaded wins: fewest generations in flight relative to this
router's allowance, as the router itself counts them (the prober's view lags
by a probe interval, and placing by it put 3 + 1 where 2 + 2 fit); ties go to
a worker within half the best weight, then to the one that served fewer.
The default policy, ``prefix``, first tries the worker whose KV cache holds the request's prompt
prefix (rendezvous hashing), and yields to balance when that worker is more
loaded than the least loaded candidate by more than the warm prefix saves
(see :func:`affinity_slack`). A request with a session key (``labels["session"]``)
is placed by the key instead (:func:`affinity_of`): a conversation's opening turn
goes to the first worker in the key's rendezvous order that keeps the load
balanced (nothing of it is cached anywhere yet), and every later turn to the
worker of its previous turn while that worker is under the load bound plus what
the history saves (:meth:`Affinity.fits`); a router that has not placed the
session (another router's, or one restarted) uses the key's rendezvous order,
which every router computes alike without sharing any state.
``least-loaded`` (no affinity) and ``round-robin`` exist to measure the difference.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmesh.errors import NotFound, Unavailable
from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerEntry:
    """One worker as this router knows it."""

    address: str
    found_by: str = "static"
    """How the router found the worker: 'static' (--workers), 'dns <name>', 'prober' (a weight table named it)."""
    healthy: bool = False
    """The router's own health Watch says SERVING."""
    weight: float = 0.0
    """Weight from the prober's table (valid when the pool has a table)."""
    state: router_pb2.WorkerState = router_pb2.WORKER_STATE_UNSPECIFIED
    reason: str = "no health answer yet"
    triton_url: str = ""
    models: dict[str, inference_pb2.ModelInfo] = field(default_factory=dict)
    in_flight: int = 0
    limit: int = 0
    """Most generations this router sends the worker at once (0 = not known yet: one)."""
    served_total: int = 0
    heard_at: float = 0.0
    """When (loop time) an attempt on this worker last read an event: a worker that keeps sending is busy, not
    stalled (:class:`tokenmesh.router._relay.StallWatchdog`)."""
    suspended_until: float = 0.0
    """time.monotonic() until which this router avoids the worker (after it failed a stream)."""
    suspended_reason: str = ""
    suspension_end: asyncio.TimerHandle | None = field(default=None, repr=False)
    """Ends the suspension on time and tells the pool's listeners (a waiter may take the worker then)."""
    ceiling: int | None = None
    """This router's allowance on the worker while lowered after the worker refused a start (at its limit: other
    routers fill it too): what it had running there then, growing a step per CEILING_GROWTH_S; None: not lowered."""
    ceiling_growth: asyncio.TimerHandle | None = field(default=None, repr=False)
    """Raises the ceiling a step on time and tells the pool's listeners (a waiter may take the slot then)."""
    gone: str = ""
    """Why discovery no longer lists the worker ('' while it does): it gets no new work, and is dropped once
    its streams ended."""


POLICIES = ("prefix", "least-loaded", "round-robin")
"""Worker selection policies (see WorkerPool.pick)."""
LOAD_BOUND = 1.25
"""Prefix policy: a worker above this multiple of the average load is skipped for its prefixes."""
SESSIONS_REMEMBERED = 65_536
"""Sessions whose latest worker a router remembers (least recently placed forgotten first; ~100 bytes each)."""
CEILING_GROWTH_S = 1.0
"""After a worker refused a start, this router's allowance there grows back one step per this many seconds
(additive increase: a full worker shared by several routers sees a few refused starts a second, not one per start)."""
CEILING_STEPS = 8
"""Steps from an allowance of 0 back to the whole share: a step is 1/8 of the share (at least 1), so a 64-slot
worker left to this router is used fully again within 8 s, and an 8-slot one grows by one a second."""
PREFIX_CHARS_PER_SLOT = 2048
"""Prefix policy: each this many characters of shared prefix (~512 tokens of prefill) buy one extra generation."""


def affinity_slack(key: str) -> int:
    """How many more generations the prefix's worker may run than the least loaded one and still get it.

    A warm prefix saves its prefill; an extra generation on a batching engine
    slows every stream on it by about one share of the decode step. One extra
    generation is always worth a prefix long enough to be a key (>= 256
    characters), and one more per PREFIX_CHARS_PER_SLOT: a 64-token system
    prompt stays with its worker while it is at most one ahead; a 2,000-token
    document stays with its worker up to four ahead (Dynamo's cost rule in its
    simplest form: prefill to compute against decode load).
    """
    return 1 + len(key) // PREFIX_CHARS_PER_SLOT


@dataclass(frozen=True, slots=True)
class Affinity:
    """Which worker a request would rather run on: the first in its key's rendezvous order that has room."""

    key: str = ""
    """What the worker order hashes ('' = no preference: the least loaded worker)."""
    slack: int = 0
    """Generations the key's worker may run beyond the balance it would otherwise need (what the warm cache saves:
    :func:`affinity_slack`)."""
    source: str = ""
    """What the key is: 'session', 'prefix' or '' (for spans and docs)."""
    opening: bool = False
    """A session's opening turn (a chat with no assistant message yet): nothing of the conversation is cached, so it
    is placed for balance, as a prefix with no slack, and its later turns follow it."""

    @classmethod
    def prefix(cls, key: str) -> Affinity:
        """A shared prompt prefix's (``prefix_key``): its worker unless further ahead than the prefix saves."""
        return cls(key, affinity_slack(key), "prefix") if key else NO_AFFINITY

    @classmethod
    def session(cls, key: str, history_chars: int = 0, opening: bool = False) -> Affinity:
        """A conversation's (``labels["session"]``): its worker while under the load bound plus its slack.

        The slack is what the conversation's history (everything but the last message) saves, as for a prefix;
        an opening turn has none (:attr:`opening`).
        """
        if not key:
            return NO_AFFINITY
        return cls(key, 0 if opening else 1 + history_chars // PREFIX_CHARS_PER_SLOT, "session", opening)

    def fits(self, in_flight: int, bound: int, least: int) -> bool:
        """Whether a worker running in_flight generations takes the request.

        ``bound`` is LOAD_BOUND x the average load, ``least`` the least loaded candidate's count.
        A prefix yields when its worker is over the bound or more than its slack ahead of the least loaded: it
        guards against one hot prefix, shared by many requests, swamping a worker. A session key carries one
        conversation, a turn at a time: many keys spread evenly by the hash alone, and a turn moved to balance a
        momentary difference costs the turn its warm history (and the next turn, back home, the history of this
        one). So a session stays up to the bound plus its slack, and never yields to the least loaded as such:
        an idle mesh does not scatter two conversations that hash to one worker.
        """
        if self.source == "session" and not self.opening:
            return in_flight < bound + self.slack
        return in_flight < bound and in_flight - least <= self.slack


NO_AFFINITY = Affinity()
"""No preference: the least loaded worker."""


def affinity_of(request: inference_pb2.GenerateRequest) -> Affinity:
    """The request's session key (``labels["session"]``) if it has one, else its prompt prefix (if long enough)."""
    session = request.labels.get("session", "")
    if not session:
        return Affinity.prefix(prefix_key(request))
    if request.messages:
        if all(m.role != "assistant" for m in request.messages):
            return Affinity.session(session, opening=True)
        history = sum(len(m.role) + len(m.content) + 2 for m in request.messages[:-1])
    else:
        history = len(request.prompt)  # a completion's prompt carries the conversation so far
    return Affinity.session(session, history)


def _rendezvous(key: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{address}".encode(), digest_size=8).digest(), "big")


def prefix_key(request: inference_pb2.GenerateRequest, min_chars: int = 256, prompt_chars: int = 512) -> str:
    """What a request shares with others that a worker's KV cache can reuse ('' = nothing worth it).

    A chat's everything-but-the-last-message (system prompt and history); a
    raw prompt's first prompt_chars characters. Shorter than min_chars (about
    64 tokens) is not worth pinning to a worker: such requests spread by load.
    """
    if request.messages:
        key = "\x1e".join(f"{m.role}\x1f{m.content}" for m in request.messages[:-1])
    else:
        key = request.prompt[:prompt_chars] if len(request.prompt) >= 2 * prompt_chars else ""
    return key if len(key) >= min_chars else ""


class WorkerPool:
    """Workers by address, the weight table in force, and the pick.

    Every change that can make a worker pickable (health, a table, a limit,
    a suspension's end) is told to the listeners (:meth:`subscribe`): the
    admission queue hands out slots then, so nothing has to look periodically.

    Args:
        policy: one of POLICIES.
        share: (this process, processes): a router run as N processes splits each worker's limit N ways.

    """

    entries: dict[str, WorkerEntry]
    policy: str
    share: tuple[int, int]
    version: int
    """Version of the table in force (0: none yet)."""
    received_at: float
    """time.time() when that table arrived."""
    propagation_ms: float
    """From the prober's decision to this router applying the table in force."""
    prober_blind: bool
    """The table in force says the prober reaches none of its (two or more) workers: this router routes on its own
    health view."""
    placements: Counter[tuple[str, str]]
    """Generations placed, by (affinity: 'session', 'prefix' or 'none'; choice: 'last' (a session's worker of its
    previous turn), 'first' (the key's first live worker), 'next' (a later one: the first was full or over the
    load bound), 'least' (the least loaded), 'turn' (round-robin)). Bounded: 3 x 5 label pairs."""
    sessions: OrderedDict[str, str]
    """Session key -> the worker address this router last placed it on, least recently placed first."""
    _turn: int
    _listeners: list[Callable[[], None]]
    _listed: dict[str, router_pb2.WorkerWeight]
    """The table in force by address, also the workers this router has not found (yet)."""

    def __init__(self, policy: str = "prefix", share: tuple[int, int] = (0, 1)) -> None:
        self.entries = {}
        self.policy = policy
        self.share = share
        self._turn = 0
        self.placements = Counter()
        self.sessions = OrderedDict()
        self.version = 0
        self.received_at = 0.0
        self.propagation_ms = 0.0
        self.prober_blind = False
        self._listeners = []
        self._listed = {}

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call listener after every change that can make a worker pickable."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def add(self, address: str, found_by: str = "static") -> WorkerEntry:
        """The entry for address, created if new (an entry discovery had let go is taken back)."""
        entry = self.entries.get(address)
        if entry is None:
            entry = self.entries[address] = WorkerEntry(address, found_by)
            if self.version:  # the table in force may have weighed it before this router found it
                listed = self._listed.get(address)
                if listed is not None:
                    self._take(entry, listed)
                else:
                    entry.reason = "not in the prober's table"
        elif entry.gone:
            entry.gone = ""
            entry.found_by = found_by
            self._changed()
        return entry

    def let_go(self, entry: WorkerEntry, why: str) -> None:
        """Discovery lost the worker: no new work goes there; its streams run on (:meth:`drop` once they ended)."""
        entry.gone = why
        self._changed()

    def drop(self, entry: WorkerEntry) -> None:
        """Forget a worker that was let go."""
        for timer in (entry.suspension_end, entry.ceiling_growth):
            if timer is not None:
                timer.cancel()
        self.entries.pop(entry.address, None)

    def effective_weight(self, entry: WorkerEntry) -> float:
        """Weight used for picking: the table's, and 0 while our own health check fails or discovery let it go."""
        if not entry.healthy or entry.gone or entry.suspended_until > time.monotonic():
            return 0.0
        return entry.weight if self.version and not self.prober_blind else 1.0

    def set_health(
        self, entry: WorkerEntry, serving: bool, reason: str, described: worker_pb2.DescribeResponse | None = None
    ) -> None:
        """What the router's own health watch sees of a worker: serving or not, why, and its Describe."""
        if described is not None:
            entry.models = {m.name: m for m in described.models}
            entry.triton_url = described.triton_url
            # A table's limit wins once one is in force, except over a worker coming (back) to SERVING: the
            # table's was measured while it had no model loaded (a limit of 1), its Describe's now is its slots.
            if not entry.limit or not self.version or (serving and not entry.healthy):
                entry.limit = described.concurrency_limit
        entry.healthy = serving
        if not self.version:  # and so does a table's reason
            entry.reason = reason
        self._changed()

    def set_models(self, entry: WorkerEntry, described: worker_pb2.DescribeResponse) -> None:
        """A worker's models read again (which LoRA adapters it has loaded changes with loads)."""
        models = {m.name: m for m in described.models}
        if models != entry.models:
            entry.models = models
            self._changed()

    def suspend(self, entry: WorkerEntry, seconds: float, reason: str) -> None:
        """Avoid entry for a while: it just failed a stream (faster than the prober can tell)."""
        entry.suspended_until = time.monotonic() + seconds
        entry.suspended_reason = reason
        if entry.suspension_end is not None:
            entry.suspension_end.cancel()
            entry.suspension_end = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a test of the pick) nothing can be waiting for the worker
            return
        entry.suspension_end = loop.call_later(seconds, self._end_suspension, entry)

    def refused(self, entry: WorkerEntry) -> None:
        """The worker refused a start, at its limit: send it no more than this router runs there now, for a while.

        Called while the refused attempt still holds its slot (so one less than ``in_flight``). Several routers each
        take a worker's whole limit as their allowance (a caller pins to one router, so an equal split would idle
        what a quiet router leaves); the one that finds the worker full lowers its own allowance to what fit, and
        grows it back one step (CEILING_STEPS) per CEILING_GROWTH_S (:meth:`_grow`), up to its share of the limit.
        """
        entry.ceiling = max(0, entry.in_flight - 1)
        if entry.ceiling_growth is None:
            self._schedule_growth(entry)

    def _schedule_growth(self, entry: WorkerEntry) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a test of the pick): grown by calling _grow
            return
        entry.ceiling_growth = loop.call_later(CEILING_GROWTH_S, self._grow, entry)

    def _grow(self, entry: WorkerEntry) -> None:
        """A step more generations may go to the worker (the ceiling is lifted once back at the share of the limit)."""
        entry.ceiling_growth = None
        if entry.ceiling is None:
            return
        share = self.share_of_limit(entry)
        entry.ceiling += max(1, share // CEILING_STEPS)
        if entry.ceiling >= share:
            entry.ceiling = None
        else:
            self._schedule_growth(entry)
        self._changed()

    def _end_suspension(self, entry: WorkerEntry) -> None:
        entry.suspension_end = None
        # The timer decides, not a clock read: time.monotonic() may still be a hair before suspended_until.
        entry.suspended_until = 0.0
        entry.suspended_reason = ""
        self._changed()

    def apply(self, table: router_pb2.WeightTable, adopt: bool = False) -> bool:
        """Use table if it is newer than the one in force; return whether it was applied.

        The table has passed ``check_table`` (router/_tables.py): weights in [0, 1], addresses host:port.
        With adopt (--discovery prober) it adds the workers it names; otherwise a worker the router has not
        found (yet) is passed over: with --discovery dns the router's own lookups decide which workers exist.
        """
        if table.version <= self.version:
            return False
        self._listed = {w.address: w for w in table.workers}
        for w in table.workers:
            if not adopt and w.address not in self.entries:
                continue  # kept in _listed: weighed from it once discovery finds it
            self._take(self.add(w.address, "prober") if adopt else self.entries[w.address], w)
        for address, entry in self.entries.items():
            if address not in self._listed:
                entry.weight = 0.0
                entry.reason = "not in the prober's table"
        # A prober that reaches none of several workers is cut off itself (the chaos row "prober cut from the
        # workers": its table said every worker UNREACHABLE and this router, which reached them all, routed
        # nothing); its verdict is then no news about the workers, and this router's own health watch decides
        # until it reaches one again. Some workers it cannot reach are still believed: that is how a lost node is
        # seen before this router's own connection to it times out; so is a lone worker (frozen, say: SIGSTOP
        # leaves its connections up, and only the prober's unanswered pings tell).
        blind = len(table.workers) >= 2 and all(w.state == router_pb2.WORKER_STATE_UNREACHABLE for w in table.workers)
        if blind != self.prober_blind:
            log.warning(
                "weight table v%d: the prober reaches %s; routing on %s",
                table.version,
                "no worker" if blind else "workers again",
                "this router's own health view" if blind else "its weights",
            )
        self.prober_blind = blind
        self.version = table.version
        self.received_at = time.time()
        if table.HasField("decided_at"):
            self.propagation_ms = max(0.0, (self.received_at - table.decided_at.ToNanoseconds() / 1e9) * 1000)
        self._changed()  # weights and limits changed
        return True

    @staticmethod
    def _take(entry: WorkerEntry, w: router_pb2.WorkerWeight) -> None:
        entry.weight = w.weight
        entry.state = w.state
        entry.reason = w.reason
        if w.triton_url:
            entry.triton_url = w.triton_url
        if w.concurrency_limit:
            entry.limit = w.concurrency_limit

    def models(self) -> dict[str, tuple[inference_pb2.ModelInfo, int]]:
        """Models of workers with weight > 0: name -> (info, number of workers)."""
        found: dict[str, tuple[inference_pb2.ModelInfo, int]] = {}
        for entry in self.entries.values():
            if self.effective_weight(entry) <= 0:
                continue
            for name, info in entry.models.items():
                known = found.get(name)
                # not_loaded is the mesh's only while no live worker has the adapter loaded.
                first = known[0] if known and not (known[0].not_loaded and not info.not_loaded) else info
                found[name] = (first, (known[1] if known else 0) + 1)
        return found

    def resolve_model(self, name: str) -> inference_pb2.ModelInfo:
        """The model a request names ('' = default), or NotFound/Unavailable."""
        models = self.models()
        if not models:
            raise Unavailable(
                "no live worker: every worker is down, starting or draining; retry shortly", reason="NO_LIVE_WORKER"
            )
        if not name:
            defaults = [info for info, _ in models.values() if info.is_default]
            return defaults[0] if defaults else next(iter(models.values()))[0]
        if name not in models:
            base, _, adapter = name.partition(":")
            adapters = sorted(n for n, (info, _) in models.items() if info.base == base)
            if adapter and base in models:
                what = f"unknown adapter {adapter!r} of model {base!r}; its adapters: {', '.join(adapters) or 'none'}"
            else:
                what = f"unknown model {name!r}; available: {', '.join(sorted(models))}"
            raise NotFound(
                what,
                reason="UNKNOWN_MODEL",
                field="model",
                metadata={"model": name, "available": ",".join(sorted(models))},
            )
        return models[name][0]

    def require_live(self, model: str) -> None:
        """Raise Unavailable unless some live worker serves model (busy or not)."""
        if not any(model in e.models and self.effective_weight(e) > 0 for e in self.entries.values()):
            raise Unavailable(
                f"no live worker serves model {model!r} now; retry shortly",
                reason="NO_LIVE_WORKER",
                metadata={"model": model},
            )

    def allowance(self, entry: WorkerEntry) -> int:
        """Generations this router process may have open on the worker: its share of the limit, or its ceiling.

        The ceiling is lower while the worker recently refused a start (:meth:`refused`).
        """
        share = self.share_of_limit(entry)
        return share if entry.ceiling is None else min(share, entry.ceiling)

    def share_of_limit(self, entry: WorkerEntry) -> int:
        """The share of the worker's concurrency limit that falls to this router process.

        The shares of N processes add up to the limit exactly (1 while the
        limit is unknown); a process whose share is 0 leaves the worker to the others.
        """
        if not entry.limit:
            return 1
        index, count = self.share
        return (entry.limit + count - 1 - index) // count

    def pick(self, model: str, affinity: Affinity = NO_AFFINITY) -> WorkerEntry | None:
        """A live worker serving model with a free slot, by the policy; None if none is free.

        ``affinity`` is the request's session or prompt prefix (honoured by the prefix policy).
        """
        live = [e for e in self.entries.values() if model in e.models and self.effective_weight(e) > 0]
        candidates = [e for e in live if e.in_flight < self.allowance(e)]
        if not candidates:
            return None
        loaded = [e for e in candidates if not e.models[model].not_loaded]
        if loaded and len(loaded) < len(candidates):
            # A LoRA adapter goes where it is loaded while there is room there: elsewhere it costs a load (seconds,
            # a new engine server) and evicts another adapter.
            candidates = loaded
            live = [e for e in live if not e.models[model].not_loaded]
        if self.policy == "round-robin":
            ordered = sorted(candidates, key=lambda e: e.address)
            self._turn += 1
            return self._placed(ordered[self._turn % len(ordered)], NO_AFFINITY, "turn")
        best = max(self.effective_weight(e) for e in candidates)
        least = min(candidates, key=lambda e: self._load_order(e, best))
        key = affinity.key
        if self.policy == "prefix" and key:
            # The key's own order of the live workers (rendezvous hashing: a
            # worker that leaves moves only its own keys, to their next choice),
            # skipping any without a free slot, too far over LOAD_BOUND x the
            # average (one hot key cannot swamp one worker) or, for a prefix, more
            # than its slack above the least loaded candidate (balance wins over a
            # short prefix): Affinity.fits.
            # A session's later turn tries first the worker of its previous turn, which holds its history
            # (after a yield, or an opening turn placed for balance, that is not the key's first choice).
            bound = math.ceil(LOAD_BOUND * (sum(e.in_flight for e in live) + 1) / len(live))
            free = set(candidates)
            last = None if affinity.opening else self.entries.get(self.sessions.get(key, ""))
            if last is not None and last in free and affinity.fits(last.in_flight, bound, least.in_flight):
                return self._placed(last, affinity, "last")
            ordered = sorted(live, key=lambda e: _rendezvous(key, e.address), reverse=True)
            for rank, entry in enumerate(ordered):
                if entry in free and affinity.fits(entry.in_flight, bound, least.in_flight):
                    return self._placed(entry, affinity, "next" if rank else "first")
        return self._placed(least, affinity, "least")

    def _placed(self, entry: WorkerEntry, affinity: Affinity, choice: str) -> WorkerEntry:
        self.placements[affinity.source or "none", choice] += 1
        if affinity.source == "session":
            self.sessions[affinity.key] = entry.address
            self.sessions.move_to_end(affinity.key)
            if len(self.sessions) > SESSIONS_REMEMBERED:
                self.sessions.popitem(last=False)
        return entry

    def _load_order(self, entry: WorkerEntry, best: float) -> tuple[float, bool, int, float]:
        """Least loaded first: in flight over allowance; then one within half the best weight, fewer served first.

        Weights only break ties, and coarsely: the prober's weight moves with
        its own lagging view of load and with each worker's TTFT average, and
        ordering equally loaded workers by it exactly sent every request of an
        idle mesh to the same worker.
        """
        weight = self.effective_weight(entry)
        return (entry.in_flight / max(self.allowance(entry), 1), weight < best / 2, entry.served_total, -weight)

    def _reason(self, entry: WorkerEntry) -> str:
        if entry.gone:
            return f"draining: {entry.gone}; dropped once its {entry.in_flight} stream(s) ended"
        reason = entry.reason
        if self.prober_blind:
            own = "SERVING" if entry.healthy else "NOT_SERVING"
            reason = f"the prober reaches no worker ({reason}); this router's own health view: {own}"
        left = entry.suspended_until - time.monotonic()
        if left > 0:
            return f"{reason}; avoided by this router for {left:.1f} s: {entry.suspended_reason}"
        return reason

    def table(self) -> router_pb2.RoutingTable:
        """The routing table for operators."""
        result = router_pb2.RoutingTable(version=self.version, propagation_ms=self.propagation_ms)
        if self.received_at:
            result.received_at.FromNanoseconds(int(self.received_at * 1e9))
        for entry in sorted(self.entries.values(), key=lambda e: e.address):
            state = entry.state
            if not self.version or self.prober_blind:
                state = router_pb2.WORKER_STATE_SERVING if entry.healthy else router_pb2.WORKER_STATE_NOT_SERVING
            result.workers.append(
                router_pb2.RoutingEntry(
                    address=entry.address,
                    # Discovery's verdict is this router's own, and newer than any table's.
                    weight=(
                        entry.weight
                        if self.version and not self.prober_blind and not entry.gone
                        else self.effective_weight(entry)
                    ),
                    state=state,
                    in_flight=entry.in_flight,
                    concurrency_limit=self.allowance(entry),
                    served_total=entry.served_total,
                    reason=self._reason(entry),
                    triton_url=entry.triton_url,
                    found_by=entry.found_by,
                )
            )
        return result
