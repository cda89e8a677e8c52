"""tokenmesh.process.stop_process, and the process-tree helpers of tests/support (psutil)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.processes import cpu_seconds, descendants
from tokenmesh.process import stop_process

# A parent with two children, the second with a child of its own: four processes.
TREE = "sleep 30 & bash -c 'sleep 30 & wait' & wait"
SPIN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)"


@pytest.fixture
def tree() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["bash", "-c", TREE], start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole tree, also when the test failed
        proc.wait()


def wait_for_size(pid: int, size: int) -> list[int]:
    deadline = time.monotonic() + 5
    while len(found := descendants(pid)) < size and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def test_descendants_are_the_process_then_everything_below_it(tree: subprocess.Popen[bytes]) -> None:
    found = wait_for_size(tree.pid, 4)
    assert found[0] == tree.pid and len(found) == 4 and len(set(found)) == 4
    assert os.getpid() not in found


def test_a_gone_process_has_only_itself_and_no_cpu_time() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert descendants(proc.pid) == [proc.pid]
    assert cpu_seconds([proc.pid]) == 0.0


def test_cpu_seconds_add_user_and_system_time_of_the_live_processes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        deadline = time.monotonic() + 10
        while cpu_seconds([proc.pid]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = cpu_seconds([proc.pid])
        assert 0.3 <= spent < 5
        assert cpu_seconds([proc.pid, 2**22 + 1]) == pytest.approx(spent, abs=0.05)  # the unknown pid adds nothing
    finally:
        stop_process(proc, 5)
