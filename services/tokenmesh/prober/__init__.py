"""The prober: watches workers, computes routing weights, pushes them to routers."""

from tokenmesh.prober._config import ProberConfig
from tokenmesh.prober._prober import Prober
from tokenmesh.prober._weights import MIN_WEIGHT, OOM_PENALTY_S, Scoring, Weight, WorkerView, compute_weight, nonsense

__all__ = [
    "MIN_WEIGHT",
    "OOM_PENALTY_S",
    "Prober",
    "ProberConfig",
    "Scoring",
    "Weight",
    "WorkerView",
    "compute_weight",
    "nonsense",
]
