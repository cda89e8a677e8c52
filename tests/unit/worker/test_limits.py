"""The worker's limits follow the slots of the models loaded now, however late they load."""

from __future__ import annotations

from typing import Any

from tokenmesh.worker import AdaptiveLimit
from tokenmesh.worker._limits import QUEUE_FACTOR, Limits


class Slots:
    """A backend whose loaded models (their slots) the test sets; Limits reads only models()."""

    def __init__(self, *slots: int) -> None:
        self.slots = list(slots)

    def models(self) -> list[Any]:
        return [type("Spec", (), {"slots": n})() for n in self.slots]


def test_a_worker_polled_before_its_models_load_reports_every_slot_once_they_do() -> None:
    backend = Slots()
    limits = Limits(backend, memory_threshold=0.92)  # type: ignore[arg-type]
    assert limits.concurrency_limit(0) == 1  # nothing loaded: the floor
    backend.slots = [64]
    assert limits.concurrency_limit(0) == 64
    assert limits.admission_limit() == QUEUE_FACTOR * 64


def test_a_reload_with_fewer_slots_lowers_the_limit_and_more_raises_it() -> None:
    backend = Slots(64)
    limits = Limits(backend, memory_threshold=0.92)  # type: ignore[arg-type]
    assert limits.concurrency_limit(0) == 64
    backend.slots = [8]
    assert limits.concurrency_limit(0) == 8
    backend.slots = []  # Triton restarting: nothing loaded
    assert limits.concurrency_limit(0) == 1
    backend.slots = [16, 16]
    assert limits.concurrency_limit(0) == 32


def test_a_limit_the_engine_queue_lowered_stays_lowered_within_new_slots() -> None:
    limit = AdaptiveLimit(initial=64, maximum=64, window=1)
    limit.observe_engine(pending=40, in_flight=50)  # the engine runs 10
    assert limit.value == 10
    limit.resize(128)
    assert limit.value == 10
    limit.resize(4)
    assert limit.value == 4
    limit.observe_engine(pending=0, in_flight=4)
    assert limit.value == 4  # at the bound: one more per quiet poll stops there
