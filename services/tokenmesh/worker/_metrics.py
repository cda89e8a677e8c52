"""The worker's Prometheus metrics: its generations, failures by class, its state and engine queue at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmesh.errors import label
from tokenmesh.metrics import ITL_BUCKETS, TTFT_BUCKETS
from tokenmesh.v1 import inference_pb2, worker_pb2
from tokenmesh.worker._limits import Limits
from tokenmesh.worker._telemetry import Telemetry


@dataclass(frozen=True, kw_only=True)
class WorkerState:
    """What the scrape-time gauges read of a worker: its parts, not the servicer (no import back from here)."""

    limits: Limits
    telemetry: Telemetry
    in_flight: Callable[[], int]
    """Generations started and not settled."""
    serving: Callable[[], bool]
    """Whether Generate accepts new generations."""
    has_model: Callable[[], bool]
    """Whether the backend has a model loaded (the concurrency limit is known then)."""
    adapters: Callable[[], list[tuple[str, str]]]
    """(model, adapter) of every LoRA adapter the engine has loaded now."""
    held: Callable[[], int]
    """Generations held for Resume."""
    restarts: Callable[[], int]
    """Times the worker restarted its engine."""


class WorkerMetrics:
    """Every metric of one worker, in its own registry."""

    registry: CollectorRegistry
    enabled: bool
    """False (--metrics-port 0): generations record nothing; the scrape-time gauges cost nothing anyway."""

    def __init__(self) -> None:
        self.enabled = True
        r = self.registry = CollectorRegistry()
        self.engine_ttft = Histogram(
            "tokenmesh_worker_engine_time_to_first_token_seconds",
            "From the worker handing a generation to the engine to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.engine_itl = Histogram(
            "tokenmesh_worker_engine_inter_token_latency_seconds",
            "Engine time per token between two responses",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            "tokenmesh_worker_generations_total",
            "Generations that ended on this worker, by finish reason or failure class",
            ["outcome"],
            registry=r,
        )
        self.failures = Counter(
            "tokenmesh_worker_failures_total", "Generations the backend failed, by class", ["error_class"], registry=r
        )
        self.denied = Counter(
            "tokenmesh_worker_permission_denied_total",
            "Calls refused because the peer's mTLS identity may not make them, by RPC group",
            ["group"],
            registry=r,
        )
        self.output_tokens = Counter(
            "tokenmesh_worker_generation_tokens_total", "Tokens the engine produced", registry=r
        )
        self.adapter_generations = Counter(
            "tokenmesh_worker_adapter_generations_total",
            "Generations started with a LoRA adapter applied, by model and adapter (the model's own: none)",
            ["model", "adapter"],
            registry=r,
        )

    def watch(self, state: WorkerState) -> None:
        """Report the worker's state and its engine's queue at every scrape."""
        self.registry.register(_StateCollector(state))

    def timing(self, ttft_s: float | None, gap_s: float | None) -> None:
        """The engine's first token, or its time per token between two responses."""
        if not self.enabled:
            return
        if ttft_s is not None:
            self.engine_ttft.observe(ttft_s)
        elif gap_s is not None:
            self.engine_itl.observe(gap_s)

    def adapter_generation(self, model: str, adapter: str) -> None:
        """A generation started with one of model's adapters (labels bounded: the adapters the model declares)."""
        if self.enabled:
            self.adapter_generations.labels(model, adapter).inc()

    def settled(self, last: worker_pb2.WorkerEvent | None, tokens: int) -> None:
        """A generation ended; last: its final event (end or error)."""
        if not self.enabled:
            return
        self.output_tokens.inc(tokens)
        if last is None:
            outcome = "dropped"
        elif last.WhichOneof("event") == "end":
            outcome = label(last.end.finish_reason, inference_pb2.FinishReason)
        elif last.WhichOneof("event") == "error":
            outcome = error_label(last.error.error_class)
            self.failures.labels(outcome).inc()
        else:
            outcome = "cancelled"
        self.generations.labels(outcome).inc()


def error_label(error_class: worker_pb2.ErrorClass) -> str:
    """ERROR_CLASS_OUT_OF_MEMORY -> out_of_memory."""
    return label(error_class, worker_pb2.ErrorClass)


class _StateCollector(Collector):
    def __init__(self, state: WorkerState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        s = self._state
        t = s.telemetry
        in_flight = s.in_flight()
        yield GaugeMetricFamily("tokenmesh_worker_in_flight", "Generations running on this worker", value=in_flight)
        yield GaugeMetricFamily(
            "tokenmesh_worker_concurrency_limit",
            "The limit the worker reports to routers",
            value=s.limits.concurrency_limit(in_flight) if s.has_model() else 0,
        )
        yield GaugeMetricFamily(
            "tokenmesh_worker_serving", "1 while health is SERVING", value=1.0 if s.serving() else 0.0
        )
        yield GaugeMetricFamily(
            "tokenmesh_worker_held_generations",
            "Generations held for Resume (running or finished, within the resume grace)",
            value=s.held(),
        )
        yield GaugeMetricFamily(
            "tokenmesh_worker_out_of_memory_total", "Device out-of-memory failures seen", value=s.limits.oom_total
        )
        yield GaugeMetricFamily(
            "tokenmesh_worker_backend_restarts_total", "Times the worker restarted its Triton", value=s.restarts()
        )
        if t.engine_pending is not None:
            yield GaugeMetricFamily(
                "tokenmesh_worker_triton_pending",
                "Requests waiting in Triton's own scheduler queue (nv_inference_pending_request_count)",
                value=t.engine_pending,
            )
        if t.engine_queue_ms is not None:
            yield GaugeMetricFamily(
                "tokenmesh_worker_triton_queue_seconds",
                "Moving average of the time requests spent in Triton's queue",
                value=t.engine_queue_ms / 1000,
            )
        yield from _adapter_metrics(s)
        used = GaugeMetricFamily(
            "tokenmesh_worker_device_memory_used_bytes", "Device memory in use (NVML)", labels=["device"]
        )
        size = GaugeMetricFamily(
            "tokenmesh_worker_device_memory_total_bytes", "Device memory in all (NVML)", labels=["device"]
        )
        for device in s.limits.device_readings:
            used.add_metric([str(device.index)], device.memory_used_bytes)
            size.add_metric([str(device.index)], device.memory_total_bytes)
        yield from (used, size)


def _adapter_metrics(s: WorkerState) -> Iterator[Metric]:
    """The LoRA adapters loaded now, and the engine's loads and evictions (its own counts, read from it)."""
    loaded = GaugeMetricFamily(
        "tokenmesh_worker_adapter_loaded",
        "1 for each LoRA adapter the engine has loaded now (a request for another declared one loads it)",
        labels=["model", "adapter"],
    )
    for model, adapter in s.adapters():
        loaded.add_metric([model, adapter], 1.0)
    yield loaded
    state = s.telemetry.adapters
    if state is None:
        return
    loads = CounterMetricFamily(
        "tokenmesh_worker_adapter_loads",
        "LoRA adapter loads by the engine since it started (with its model, and on demand)",
        labels=["model", "adapter"],
    )
    unloads = CounterMetricFamily(
        "tokenmesh_worker_adapter_unloads",
        "LoRA adapters the engine evicted since it started (the least recently used, at its bound)",
        labels=["model", "adapter"],
    )
    for family, counts in ((loads, state.loads), (unloads, state.unloads)):
        for (model, adapter), count in sorted(counts.items()):
            family.add_metric([model, adapter], count)
    yield from (loads, unloads)
