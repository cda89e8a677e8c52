"""Worker pool picking and the prober's weight function."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenmesh.errors import NotFound, Unavailable
from tokenmesh.prober import MIN_WEIGHT, Prober, ProberConfig, Scoring, WorkerView, compute_weight
from tokenmesh.router import Affinity, WorkerPool
from tokenmesh.v1 import inference_pb2, router_pb2, worker_pb2


def pool_with(*addresses: str, model: str = "m") -> WorkerPool:
    pool = WorkerPool()
    for address in addresses:
        entry = pool.add(address)
        entry.healthy = True
        entry.limit = 1000
        entry.models = {model: inference_pb2.ModelInfo(name=model, max_context=100, is_default=True)}
    return pool


def table(version: int, **weights: float) -> router_pb2.WeightTable:
    return router_pb2.WeightTable(
        version=version,
        workers=[router_pb2.WorkerWeight(address=a.replace("_", ":"), weight=w) for a, w in weights.items()],
    )


def test_without_a_table_healthy_workers_share_evenly() -> None:
    pool = pool_with("a:1", "b:1")
    picks = Counter()
    for _ in range(10):
        entry = pool.pick("m")
        picks[entry.address] += 1
        entry.served_total += 1
    assert picks == {"a:1": 5, "b:1": 5}


def test_zero_weight_and_unhealthy_workers_are_never_picked() -> None:
    pool = pool_with("a:1", "b:1", "c:1")
    assert pool.apply(table(5, a_1=0.0, b_1=1.0, c_1=1.0))
    pool.entries["c:1"].healthy = False
    assert {pool.pick("m").address for _ in range(50)} == {"b:1"}


def test_load_goes_to_the_less_busy_worker() -> None:
    pool = pool_with("a:1", "b:1")
    pool.entries["a:1"].in_flight = 3
    assert pool.pick("m").address == "b:1"


def test_at_equal_load_a_degraded_weight_goes_last_and_load_then_spreads() -> None:
    pool = pool_with("a:1", "b:1", "c:1")
    pool.apply(table(1, a_1=1.0, b_1=0.1, c_1=0.6))
    picks = []
    for _ in range(6):
        entry = pool.pick("m")
        picks.append(entry.address)
        entry.in_flight += 1
    # Ties on load: b (under half the best weight) last; a and c alike, by fewer served, then weight.
    assert picks == ["a:1", "c:1", "b:1"] * 2


def test_sequential_requests_on_an_idle_mesh_alternate_despite_unequal_weights() -> None:
    pool = pool_with("a:1", "b:1")
    pool.apply(table(1, a_1=1.0, b_1=0.8))  # b's TTFT average a little over the SLO
    served = Counter()
    for _ in range(8):
        entry = pool.pick("m")
        served[entry.address] += 1
        entry.served_total += 1  # one at a time: in flight is 0 at every pick
    assert served == {"a:1": 4, "b:1": 4}


def test_load_is_relative_to_each_workers_limit() -> None:
    pool = pool_with("a:1", "b:1")
    pool.entries["a:1"].limit, pool.entries["b:1"].limit = 8, 2
    picks = Counter()
    for _ in range(10):
        entry = pool.pick("m")
        picks[entry.address] += 1
        entry.in_flight += 1
    assert picks == {"a:1": 8, "b:1": 2}
    assert pool.pick("m") is None  # both full


def test_two_workers_with_four_slots_take_two_and_two() -> None:
    pool = pool_with("a:1", "b:1")
    pool.apply(table(3, a_1=1.0, b_1=0.75))  # the prober's lagging view of b's load must not skew the spread
    for entry in pool.entries.values():
        entry.limit = 4
    for _ in range(4):
        pool.pick("m").in_flight += 1
    assert [e.in_flight for e in pool.entries.values()] == [2, 2]


def test_older_tables_are_not_applied() -> None:
    pool = pool_with("a:1")
    assert pool.apply(table(10, a_1=0.5))
    assert not pool.apply(table(9, a_1=1.0))
    assert pool.entries["a:1"].weight == 0.5 and pool.version == 10


def test_pick_errors() -> None:
    pool = pool_with("a:1")
    pool.suspend(pool.entries["a:1"], 5, "stalled")
    assert pool.pick("m") is None
    with pytest.raises(Unavailable):
        pool.require_live("m")
    pool.entries["a:1"].suspended_until = 0
    pool.entries["a:1"].in_flight = 1000  # at its limit: live, but no free slot
    assert pool.pick("m") is None
    pool.require_live("m")
    pool.entries["a:1"].in_flight = 0
    with pytest.raises(NotFound):
        pool.resolve_model("other")
    assert pool.resolve_model("").name == "m"
    pool.entries["a:1"].healthy = False
    with pytest.raises(Unavailable):
        pool.resolve_model("")


def view(**stats_fields) -> WorkerView:
    v = WorkerView("a:1", reachable=True, serving=True, stats_at=100.0)
    v.stats = worker_pb2.WorkerStats(**stats_fields)
    return v


def test_weight_is_zero_when_unreachable_or_not_serving() -> None:
    unreachable = WorkerView("a:1", reachable=False, error="health UNAVAILABLE")
    w = compute_weight(unreachable, 100.0, Scoring())
    assert (w.weight, w.state) == (0.0, router_pb2.WORKER_STATE_UNREACHABLE)
    not_serving = view(concurrency_limit=4)
    not_serving.serving = False
    w = compute_weight(not_serving, 100.0, Scoring())
    assert (w.weight, w.state) == (0.0, router_pb2.WORKER_STATE_NOT_SERVING)


def test_weight_follows_free_capacity() -> None:
    assert compute_weight(view(concurrency_limit=4, in_flight=0), 100.0, Scoring()).weight == 1.0
    assert compute_weight(view(concurrency_limit=4, in_flight=1), 100.0, Scoring()).weight == 0.75
    assert compute_weight(view(concurrency_limit=4, in_flight=9), 100.0, Scoring()).weight == MIN_WEIGHT


def test_stale_stats_count_as_saturated() -> None:
    w = compute_weight(view(concurrency_limit=4, in_flight=0), 102.0, Scoring())
    assert w.weight == MIN_WEIGHT and "stale" in w.reason


def test_a_recent_device_oom_halves_the_weight() -> None:
    v = view(concurrency_limit=4, in_flight=0)
    v.oom_at = 95.0
    w = compute_weight(v, 100.0, Scoring(stale_after_s=10.0))
    assert w.weight == 0.5 and "out of memory 5 s ago" in w.reason
    v.oom_at = 0.0
    assert compute_weight(v, 100.0, Scoring(stale_after_s=200.0)).weight == 1.0


def test_nonsense_stats_are_recognised() -> None:
    from tokenmesh.prober import nonsense

    assert nonsense(worker_pb2.WorkerStats(concurrency_limit=4, in_flight=1)) == ""
    assert "concurrency_limit 0" in nonsense(worker_pb2.WorkerStats(concurrency_limit=0))
    bad_memory = worker_pb2.WorkerStats(
        concurrency_limit=4, devices=[worker_pb2.DeviceStats(index=0, memory_used_bytes=90, memory_total_bytes=80)]
    )
    assert "memory used 90 > total 80" in nonsense(bad_memory)
    assert "utilization 140%" in nonsense(
        worker_pb2.WorkerStats(concurrency_limit=4, devices=[worker_pb2.DeviceStats(index=0, utilization_percent=140)])
    )


def test_cpu_sets_parse_and_format() -> None:
    from tokenmesh.config import ConfigError
    from tokenmesh.worker import format_cpus, parse_cpus

    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert format_cpus({0, 1, 2, 5}) == "0-2,5"
    with pytest.raises(ConfigError, match="not N or N-M"):
        parse_cpus("a-b")


GIB = 1024**3


def test_device_memory_over_the_threshold_lowers_the_weight() -> None:
    def with_memory(used_gib: float) -> float:
        device = worker_pb2.DeviceStats(index=0, memory_used_bytes=int(used_gib * GIB), memory_total_bytes=100 * GIB)
        return compute_weight(view(concurrency_limit=4, devices=[device]), 100.0, Scoring()).weight

    assert with_memory(50) == 1.0 and with_memory(92) == 1.0
    assert with_memory(96) == 0.5  # halfway from the 92% threshold to full
    assert with_memory(99.9) == MIN_WEIGHT
    device = worker_pb2.DeviceStats(index=0, memory_used_bytes=96 * GIB, memory_total_bytes=100 * GIB)
    assert (
        "device 0 memory 96% > 92%"
        in compute_weight(view(concurrency_limit=4, devices=[device]), 100.0, Scoring()).reason
    )


def test_no_gpu_readings_leave_the_weight_alone() -> None:
    assert compute_weight(view(concurrency_limit=4, devices=[]), 100.0, Scoring()).weight == 1.0


def test_ttft_over_the_slo_scales_the_weight() -> None:
    w = compute_weight(view(concurrency_limit=4, ttft_ms=4000.0), 100.0, Scoring(ttft_slo_ms=2000.0))
    assert w.weight == 0.5 and "TTFT 4000 ms > SLO 2000 ms" in w.reason


def chat(system: str, user: str = "hi") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        messages=[
            inference_pb2.ChatMessage(role="system", content=system),
            inference_pb2.ChatMessage(role="user", content=user),
        ]
    )


def test_prefix_keys() -> None:
    from tokenmesh.router import prefix_key

    long_system = "You are a careful assistant. " * 20
    assert prefix_key(chat(long_system, "a")) == prefix_key(chat(long_system, "b")) != ""
    assert prefix_key(chat("short")) == ""  # not worth pinning
    assert prefix_key(inference_pb2.GenerateRequest(prompt="x" * 2000)) == "x" * 512
    assert prefix_key(inference_pb2.GenerateRequest(prompt="hello")) == ""


def test_prefix_policy_keeps_a_prefix_on_one_worker_within_the_load_bound() -> None:
    pool = pool_with("a:1", "b:1", "c:1")
    pool.policy = "prefix"
    homes = {}
    for p in range(8):
        picks = {pool.pick("m", Affinity.prefix(f"system prompt {p}")).address for _ in range(5)}
        assert len(picks) == 1  # idle mesh: always the prefix's own worker
        homes[p] = picks.pop()
    assert len(set(homes.values())) > 1  # different prefixes spread over workers
    # One hot prefix: its worker takes load only up to 1.25x the average, then the next in its order.
    hot = pool.entries[homes[0]]
    hot.in_flight = 4
    assert pool.pick("m", Affinity.prefix("system prompt 0")) is not hot


def test_a_prefix_yields_to_balance_by_more_the_shorter_it_is() -> None:
    pool = pool_with("a:1", "b:1")
    short, long = "s" * 300, "l" * 4096  # one extra generation, three extra
    for key in (short, long):
        home = pool.pick("m", Affinity.prefix(key))
        other = next(e for e in pool.entries.values() if e is not home)
        home.in_flight, other.in_flight = 10, 9
        assert pool.pick("m", Affinity.prefix(key)) is home  # one ahead: the warm prefix is worth it
        home.in_flight = 11
        assert pool.pick("m", Affinity.prefix(key)) is (other if key is short else home)
        home.in_flight = 13
        assert pool.pick("m", Affinity.prefix(key)) is other  # four ahead: balance wins for both
        home.in_flight = other.in_flight = 0


def test_round_robin_and_least_loaded_policies() -> None:
    pool = pool_with("a:1", "b:1", "c:1")
    pool.policy = "round-robin"
    assert [pool.pick("m").address for _ in range(6)] == ["b:1", "c:1", "a:1", "b:1", "c:1", "a:1"]
    pool.policy = "least-loaded"
    pool.entries["a:1"].in_flight, pool.entries["b:1"].in_flight, pool.entries["c:1"].in_flight = 3, 1, 2
    assert pool.pick("m").address == "b:1"


async def test_a_limit_measured_before_the_worker_served_is_not_published() -> None:
    prober = Prober(ProberConfig(port=0, workers=("a:1", "b:1")))
    prober.views["a:1"] = view(serving=False, concurrency_limit=1)  # stats from before its model loaded
    prober.views["b:1"] = view(serving=True, concurrency_limit=64)
    assert [w.concurrency_limit for w in prober.compute_table()] == [0, 64]  # 0: the router keeps its own


def test_a_worker_coming_back_to_serving_takes_its_describe_limit_over_the_tables() -> None:
    pool = pool_with("a:1")
    pool.apply(router_pb2.WeightTable(version=1, workers=[router_pb2.WorkerWeight(address="a:1", weight=1.0)]))
    entry = pool.entries["a:1"]
    entry.limit = 1  # a table's, from before its model loaded
    pool.set_health(entry, False, "loading", worker_pb2.DescribeResponse())
    assert entry.limit == 1
    pool.set_health(entry, True, "", worker_pb2.DescribeResponse(concurrency_limit=64))
    assert entry.limit == 64
    pool.set_health(entry, True, "", worker_pb2.DescribeResponse(concurrency_limit=3))
    assert entry.limit == 64  # while it serves, a table's limit wins over a Describe's


def test_a_prober_that_reaches_no_worker_leaves_routing_to_the_routers_own_health_view() -> None:
    pool = pool_with("a:1", "b:1", "c:1")
    unreachable = router_pb2.WORKER_STATE_UNREACHABLE
    cut = router_pb2.WeightTable(
        version=2,
        workers=[router_pb2.WorkerWeight(address=a, weight=0.0, state=unreachable) for a in ("a:1", "b:1", "c:1")],
    )
    pool.entries["c:1"].healthy = False  # this router's own watch says c is down
    assert pool.apply(cut) and pool.prober_blind
    assert {pool.pick("m").address for _ in range(50)} <= {"a:1", "b:1"}
    rows = {w.address: w for w in pool.table().workers}
    assert rows["a:1"].state == router_pb2.WORKER_STATE_SERVING and rows["a:1"].weight == 1.0
    assert rows["c:1"].state == router_pb2.WORKER_STATE_NOT_SERVING and rows["c:1"].weight == 0.0
    assert "the prober reaches no worker" in rows["a:1"].reason
    # One worker it still reaches: its verdict on the others counts again (how a lost node is seen early).
    partly = router_pb2.WeightTable(version=3, workers=[*cut.workers[:2], router_pb2.WorkerWeight(address="c:1")])
    partly.workers[2].weight, partly.workers[2].state = 1.0, router_pb2.WORKER_STATE_SERVING
    pool.entries["c:1"].healthy = True
    assert pool.apply(partly) and not pool.prober_blind
    assert {pool.pick("m").address for _ in range(50)} == {"c:1"}


def test_a_lone_worker_the_prober_cannot_reach_is_not_routed_to() -> None:
    # One worker: a frozen worker (SIGSTOP keeps its connections up) and a cut-off prober look the same; the
    # prober's pings are the only sign of the first, so its verdict stands.
    pool = pool_with("a:1")
    unreachable = router_pb2.WorkerWeight(address="a:1", weight=0.0, state=router_pb2.WORKER_STATE_UNREACHABLE)
    assert pool.apply(router_pb2.WeightTable(version=2, workers=[unreachable])) and not pool.prober_blind
    assert pool.pick("m") is None


def adapter_pool(*not_loaded: bool, limit: int = 2) -> WorkerPool:
    """Workers a:1, b:1... each declaring adapter m:x of model m, loaded or not (in that order)."""
    pool = pool_with(*(f"{chr(97 + i)}:1" for i in range(len(not_loaded))))
    for entry, absent in zip(pool.entries.values(), not_loaded, strict=True):
        entry.limit = limit
        entry.models["m:x"] = inference_pb2.ModelInfo(name="m:x", max_context=100, base="m", not_loaded=absent)
    return pool


@pytest.mark.parametrize("policy", ["prefix", "least-loaded", "round-robin"])
def test_an_adapter_goes_to_the_worker_that_has_it_loaded_while_it_has_room_then_to_one_that_declares_it(
    policy: str,
) -> None:
    pool = adapter_pool(True, False, True)
    pool.policy = policy
    picks = []
    for i in range(4):
        entry = pool.pick("m:x", Affinity(key=f"p{i}", source="prefix"))
        assert entry is not None
        picks.append(entry.address)
        entry.in_flight += 1
    assert picks[:2] == ["b:1", "b:1"]  # while b has room, though a and c are idle
    assert set(picks[2:]) <= {"a:1", "c:1"}  # b full: a worker that declares it (and loads it)
    # The base model is not steered: it goes by load alone.
    assert pool.pick("m").address in {"a:1", "c:1"}


def test_listmodels_says_not_loaded_only_while_no_live_worker_has_the_adapter_loaded() -> None:
    pool = adapter_pool(True, True)
    assert pool.resolve_model("m:x").not_loaded
    described = worker_pb2.DescribeResponse(
        models=[inference_pb2.ModelInfo(name="m:x", max_context=100, base="m"), pool.entries["b:1"].models["m"]]
    )
    pool.set_models(pool.entries["b:1"], described)  # b loaded it (its Describe read again)
    assert not pool.resolve_model("m:x").not_loaded and pool.pick("m:x").address == "b:1"
