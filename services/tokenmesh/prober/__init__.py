"""The prober: watches workers, computes routing weights, pushes them to routers."""

from tokenmesh.prober.prober import Prober, ProberConfig, compute_weight

__all__ = ["Prober", "ProberConfig", "compute_weight"]
