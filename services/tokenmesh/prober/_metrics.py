"""The prober's Prometheus metrics: each worker as it sees it, the table it decided, what each router acked."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmesh.prober._weights import WorkerView
from tokenmesh.v1 import router_pb2


class PushState(Protocol):
    """What the metrics read of one router's weight push (the prober's link to it)."""

    @property
    def acked_version(self) -> int:
        """The latest table version the router acked."""

    @property
    def connected(self) -> bool:
        """Whether the push stream is open."""


class ProberMetrics:
    """Every metric of the prober, in its own registry."""

    registry: CollectorRegistry

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tables = Counter(
            "tokenmesh_prober_weight_tables_total", "Weight tables decided (each a new version)", registry=self.registry
        )

    def watch(
        self,
        table: Callable[[], router_pb2.WeightTable],
        views: Mapping[str, WorkerView],
        routers: Mapping[str, PushState],
    ) -> None:
        """Report the workers, the table and the routers' acks at every scrape.

        Args:
            table: the table decided last (called at each scrape: the prober replaces it).
            views: what the prober knows of each worker, by address (read at each scrape).
            routers: each router's weight push, by address (read at each scrape).

        """
        self.registry.register(_ProberCollector(table, views, routers))


class _ProberCollector(Collector):
    """The prober's state, read when Prometheus scrapes (the parts it reads, not the prober: no import back)."""

    def __init__(
        self,
        table: Callable[[], router_pb2.WeightTable],
        views: Mapping[str, WorkerView],
        routers: Mapping[str, PushState],
    ) -> None:
        self._table = table
        self._views = views
        self._routers = routers

    def collect(self) -> Iterator[Metric]:
        table = self._table()
        weight = GaugeMetricFamily(
            "tokenmesh_prober_worker_weight", "Weight in the table decided last", labels=["worker"]
        )
        for w in table.workers:
            weight.add_metric([w.address], w.weight)
        up = GaugeMetricFamily(
            "tokenmesh_prober_worker_up", "1 while the worker is reachable and SERVING", labels=["worker"]
        )
        rtt = GaugeMetricFamily(
            "tokenmesh_prober_probe_rtt_seconds", "Round trip of the last stats ping", labels=["worker"]
        )
        for address, view in sorted(self._views.items()):
            up.add_metric([address], 1.0 if view.reachable and view.serving else 0.0)
            if view.rtt_s is not None:
                rtt.add_metric([address], view.rtt_s)
        acked = GaugeMetricFamily(
            "tokenmesh_prober_router_acked_version", "Latest table version the router acked", labels=["router"]
        )
        connected = GaugeMetricFamily(
            "tokenmesh_prober_router_connected", "1 while the weight push stream is open", labels=["router"]
        )
        for address, link in sorted(self._routers.items()):
            acked.add_metric([address], link.acked_version)
            connected.add_metric([address], 1.0 if link.connected else 0.0)
        yield from (weight, up, rtt, acked, connected)
        yield GaugeMetricFamily(
            "tokenmesh_prober_weight_table_version", "Version of the table decided last", value=table.version
        )
