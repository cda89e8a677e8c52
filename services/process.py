"""Child processes that never outlive their parent, and how to stop them."""

from __future__ import annotations

import ctypes
import signal
import subprocess


def die_with_parent() -> None:
    """In a child (preexec_fn): get SIGKILL when the parent dies, even by SIGKILL."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, wait up to timeout_s, then SIGKILL; return the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
