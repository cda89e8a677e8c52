"""Cluster fixtures: the mesh in network namespaces (tests/support/cluster.py); skipped where they cannot be made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import Cluster, ClusterConfig
from tests.support.netns import why_not_available


@pytest.fixture(autouse=True)
def _namespaces_available() -> None:
    reason = why_not_available()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """3 workers (real Triton, synthetic model: 8 slots, 50 tokens/s), a router, the prober and the gateway."""
    reason = why_not_available()
    if reason:
        pytest.skip(reason)
    running = Cluster(ClusterConfig(log_dir=tmp_path_factory.mktemp("cluster") / "logs"))
    try:
        running.start()
        yield running
    finally:
        left = running.stop()
    assert not left, f"left behind: {left}"
