"""The router's Prometheus metrics: what callers feel, per model and worker, and the pool's state at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmesh.errors import label
from tokenmesh.metrics import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS, TenantLabel
from tokenmesh.router._admission import Admission
from tokenmesh.router._pool import WorkerPool
from tokenmesh.v1 import inference_pb2, router_pb2

LINK_MODES = ("batched", "per-generation", "unknown")
"""The values of tokenmesh_router_worker_link's ``link`` label (RoutingEntry.link; ``unknown`` for its "")."""


class RouterMetrics:
    """Every metric of one router process, in its own registry.

    Args:
        tenants: the tenants that get their own ``tenant`` label value (the rest: ``other``).
        enabled: record generations (off: nobody scrapes, so the relay does no work for them).

    """

    registry: CollectorRegistry
    tenant: TenantLabel
    enabled: bool
    """False: generations record nothing (--metrics-port 0); the counters stay at 0."""

    def __init__(
        self, tenants: tuple[str, ...] = (), *, enabled: bool = True
    ) -> None:  # long: the metric table, one metric a call
        self.enabled = enabled
        r = self.registry = CollectorRegistry()
        self.tenant = TenantLabel(tenants)
        self.ttft = Histogram(
            "tokenmesh_router_time_to_first_token_seconds",
            "From the request's arrival to its first text chunk leaving the router",
            ["model", "worker"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tokenmesh_router_time_per_output_token_seconds",
            "(end - first token) / (output tokens - 1), per generation",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenmesh_router_inter_token_latency_seconds",
            "Gap between two text chunks of a stream, as relayed",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenmesh_router_request_duration_seconds",
            "From the request's arrival to its end, by outcome",
            ["model", "outcome"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "tokenmesh_router_queue_wait_seconds",
            "Time a generation waited in the admission queue for a worker slot",
            ["model", "priority"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenmesh_router_prompt_tokens_total", "Prompt tokens of finished generations", ["model"], registry=r
        )
        self.output_tokens = Counter(
            "tokenmesh_router_generation_tokens_total", "Output tokens relayed to callers", ["model"], registry=r
        )
        self.requests = Counter(
            "tokenmesh_router_requests_total",
            "Generations by outcome: a finish reason (stop, length, cancelled, error) or "
            "the status code they ended with",
            ["model", "outcome", "tenant"],
            registry=r,
        )
        self.migrations = Counter(
            "tokenmesh_router_migrations_total",
            "Generations moved to another worker after output began, by failure",
            ["model", "reason"],
            registry=r,
        )
        self.interruptions = Counter(
            "tokenmesh_router_interruptions_total",
            "Streams that ended in an error after their first chunk",
            ["model", "outcome"],
            registry=r,
        )
        self.worker_failures = Counter(
            "tokenmesh_router_worker_failures_total",
            "Attempts a worker failed (the stream went on elsewhere or ended), by failure",
            ["worker", "reason"],
            registry=r,
        )
        self.worker_refusals = Counter(
            "tokenmesh_router_worker_refusals_total",
            "Starts a worker refused at its limit (other routers fill it too): each waited again for a slot here",
            ["worker"],
            registry=r,
        )
        self.stream_messages = Counter(
            "tokenmesh_router_stream_messages_total",
            "StreamEvents messages sent on GenerateStream calls (chunks per message: stream_chunks_total over this)",
            registry=r,
        )
        self.stream_chunks = Counter(
            "tokenmesh_router_stream_chunks_total", "Chunks sent on GenerateStream calls", registry=r
        )
        self.resumes = Counter("tokenmesh_router_resumes_total", "Resume calls by outcome", ["outcome"], registry=r)
        self.cancels = Counter("tokenmesh_router_cancels_total", "Cancel calls by outcome", ["outcome"], registry=r)
        self.denied = Counter(
            "tokenmesh_router_permission_denied_total",
            "Calls refused because the peer's mTLS identity may not make them, by RPC group",
            ["group"],
            registry=r,
        )
        self.tables = Counter(
            "tokenmesh_router_weight_tables_total",
            "Weight tables received, by whether applied",
            ["applied"],
            registry=r,
        )
        self.link_messages = Counter(
            "tokenmesh_router_link_messages_total",
            "LinkEvents messages read from the worker's Worker/Link (chunks per message: link_chunks / this)",
            ["worker"],
            registry=r,
        )
        self.link_chunks = Counter(
            "tokenmesh_router_link_chunks_total",
            "Chunks those messages carried, of every generation on the link",
            ["worker"],
            registry=r,
        )
        self.quota_refusals = Counter(
            "tokenmesh_router_quota_refusals_total",
            "Generations a tenant's quota refused, by the limit: tokens, requests, concurrent, too_large "
            "(a reservation larger than the whole quota)",
            ["tenant", "limit"],
            registry=r,
        )
        self.propagation = Histogram(
            "tokenmesh_router_weight_table_propagation_seconds",
            "From the prober's decision to this router applying the table",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )

    def watch(self, pool: WorkerPool, admission: Admission, link_mode: Callable[[str], str] = lambda _: "") -> None:
        """Report the pool's and the queue's state at every scrape (link_mode: RoutingEntry.link of a worker)."""
        self.registry.register(_PoolCollector(pool, admission, link_mode))

    def link_counters(self, worker: str) -> tuple[Counter, Counter] | None:
        """The (messages, chunks) counters of a worker's link (None while metrics are off: nothing to count)."""
        if not self.enabled:
            return None
        return self.link_messages.labels(worker), self.link_chunks.labels(worker)

    def watch_shared_quotas(self, up: Callable[[], bool]) -> None:
        """With --quota-redis-url: whether Redis answers, read at every scrape."""
        store = Gauge(
            "tokenmesh_router_quota_store_up",
            "1 while the quotas' Redis answers; 0 while this router grants from its own share of each quota",
            registry=self.registry,
        )
        store.set_function(lambda: float(up()))

    def quota_refused(self, tenant: str, limit: str) -> None:
        """A generation refused by its tenant's quota."""
        if self.enabled:
            self.quota_refusals.labels(self.tenant(tenant), limit).inc()

    def refused(self, outcome: str, tenant: str) -> None:
        """A generation refused before it had a model (bad input, unknown model, draining): model label ''."""
        if self.enabled:
            self.requests.labels("", outcome, self.tenant(tenant)).inc()

    def stream_message(self, chunks: int) -> None:
        """A GenerateStream message with chunks chunks went out."""
        if self.enabled:
            self.stream_messages.inc()
            self.stream_chunks.inc(chunks)

    def generation(self, model: str, tenant: str) -> GenerationMetrics:
        """The recorder of one generation (one that records nothing while metrics are off)."""
        if not self.enabled:
            return _OFF
        return GenerationMetrics(self, model, self.tenant(tenant))


class GenerationMetrics:
    """Records one generation as it goes: one call per relayed chunk, the label lookups done once."""

    __slots__ = ("_itl", "_last", "_metrics", "_model", "_tenant", "finished", "first_at", "started", "tokens")

    def __init__(self, metrics: RouterMetrics, model: str, tenant: str) -> None:
        self._metrics = metrics
        self._model = model
        self._tenant = tenant
        self._itl = metrics.itl.labels(model)
        self.started = time.monotonic()
        self.first_at = 0.0
        self._last = 0.0
        self.tokens = 0
        self.finished = False

    def queued(self, seconds: float, priority: int) -> None:
        """The first admission's wait."""
        name = label(priority, inference_pb2.Priority) if priority else "normal"
        self._metrics.queue.labels(self._model, name).observe(seconds)

    def chunk(self, piece: inference_pb2.GenerateChunk, worker: str) -> None:
        """A chunk went to the caller."""
        now = time.monotonic()
        if piece.text:
            if self._last:
                self._itl.observe(now - self._last)
            else:
                self.first_at = now
                self._metrics.ttft.labels(self._model, worker).observe(now - self.started)
            self._last = now
        self.tokens += piece.token_count
        if piece.finish_reason:
            self._finished(piece, now)

    def _finished(self, final: inference_pb2.GenerateChunk, now: float) -> None:
        self.finished = True
        m, model = self._metrics, self._model
        outcome = label(final.finish_reason, inference_pb2.FinishReason)
        m.requests.labels(model, outcome, self._tenant).inc()
        m.e2e.labels(model, outcome).observe(now - self.started)
        m.prompt_tokens.labels(model).inc(final.usage.prompt_tokens)
        m.output_tokens.labels(model).inc(final.usage.completion_tokens)
        if self.first_at and final.usage.completion_tokens > 1:
            m.tpot.labels(model).observe((now - self.first_at) / (final.usage.completion_tokens - 1))

    def failed(self, outcome: str, delivered: bool) -> None:
        """The generation ended with a status (outcome: its code's name), after output began or not."""
        self.finished = True
        m = self._metrics
        m.requests.labels(self._model, outcome, self._tenant).inc()
        m.e2e.labels(self._model, outcome).observe(time.monotonic() - self.started)
        if delivered:
            m.interruptions.labels(self._model, outcome).inc()

    def worker_failed(self, worker: str, reason: str, *, migrated: bool) -> None:
        """An attempt failed on worker; migrated: after output began (the stream moves)."""
        self._metrics.worker_failures.labels(worker, reason).inc()
        if migrated:
            self._metrics.migrations.labels(self._model, reason).inc()


class _Off(GenerationMetrics):
    """Records nothing: what every generation gets while metrics are off."""

    def __init__(self) -> None:
        self.started = self.first_at = 0.0
        self.tokens = 0
        self.finished = False

    def queued(self, seconds: float, priority: int) -> None:
        """Nothing."""

    def chunk(self, piece: inference_pb2.GenerateChunk, worker: str) -> None:
        """Nothing."""

    def failed(self, outcome: str, delivered: bool) -> None:
        """Nothing."""

    def worker_failed(self, worker: str, reason: str, *, migrated: bool) -> None:
        """Nothing."""


_OFF = _Off()


class _PoolCollector(Collector):
    """Per-worker state and the queue, read from the pool when Prometheus scrapes."""

    def __init__(self, pool: WorkerPool, admission: Admission, link_mode: Callable[[str], str]) -> None:
        self._pool = pool
        self._admission = admission
        self._link_mode = link_mode

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        in_flight = GaugeMetricFamily(
            "tokenmesh_router_in_flight", "Generations this router has open on the worker", labels=["worker"]
        )
        limit = GaugeMetricFamily(
            "tokenmesh_router_concurrency_limit",
            "Most generations this router sends the worker at once",
            labels=["worker"],
        )
        weight = GaugeMetricFamily(
            "tokenmesh_router_worker_weight", "Routing weight in force (0: never picked)", labels=["worker"]
        )
        state = GaugeMetricFamily(
            "tokenmesh_router_worker_state", "1 for the worker's state, 0 for the others", labels=["worker", "state"]
        )
        link = GaugeMetricFamily(
            "tokenmesh_router_worker_link",
            "1 for how generations reach the worker: batched (one Worker/Link), per-generation (a Worker/Generate "
            "call each), unknown (its link is being opened)",
            labels=["worker", "link"],
        )
        states = [label(s, router_pb2.WorkerState) for s in router_pb2.WorkerState.values()]
        for row in pool.table().workers:
            in_flight.add_metric([row.address], row.in_flight)
            limit.add_metric([row.address], row.concurrency_limit)
            weight.add_metric([row.address], row.weight)
            current = label(row.state, router_pb2.WorkerState)
            for name in states:
                state.add_metric([row.address, name], 1.0 if name == current else 0.0)
            mode = self._link_mode(row.address) or "unknown"
            for name in LINK_MODES:
                link.add_metric([row.address, name], 1.0 if name == mode else 0.0)
        yield from (in_flight, limit, weight, state, link)
        placements = CounterMetricFamily(
            "tokenmesh_router_placements",
            "Generations placed on a worker, by what placed them (session, prefix, none) and which worker took them "
            "(first: the key's first live choice; next: a later one in its order; least: the least loaded; turn: "
            "round-robin)",
            labels=["affinity", "choice"],
        )
        for (affinity, choice), count in sorted(pool.placements.items()):
            placements.add_metric([affinity, choice], count)
        yield placements
        yield GaugeMetricFamily(
            "tokenmesh_router_queued", "Generations waiting in the admission queue", value=len(self._admission.waiting)
        )
        yield GaugeMetricFamily(
            "tokenmesh_router_weight_table_version",
            "Version of the weight table in force (0: none yet)",
            value=pool.version,
        )
