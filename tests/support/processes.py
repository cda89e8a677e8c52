"""Process trees and their CPU time (psutil), for the tests and the benchmarks that watch the mesh's processes.

The services never need these: they stop their children with ``tokenmesh.process.stop_process``.
"""

from __future__ import annotations

import psutil


def descendants(pid: int) -> list[int]:
    """The process and every process below it (a tritonserver and its model stubs); [pid] once it is gone."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return [pid]


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time the processes still alive among pids have used."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue  # ended meanwhile
        total += times.user + times.system
    return total
