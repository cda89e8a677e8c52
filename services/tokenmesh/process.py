"""Child processes that never outlive their parent, and how to stop them."""

from __future__ import annotations

import os
import subprocess
import sys

# Runs in the child: ask the kernel for SIGKILL when the parent dies (even by
# SIGKILL), give up if it already has, take the niceness asked for, then become
# the real program (same PID; every thread it starts inherits the niceness).
# A trampoline rather than preexec_fn: forking a process that has gRPC threads
# and running Python in the child before exec crashed tritonserver at start
# ("epoll_wait error: Bad file descriptor") in about one start out of four.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)\n"  # 1 = PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.nice(int(sys.argv[2]))\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dies_with_parent(argv: list[str], nice: int = 0) -> list[str]:
    """Argv wrapped so the program gets SIGKILL when this process dies (and runs ``nice`` lower).

    Fork it from a thread that lives as long as the process (the event loop's): the kernel sends the signal when
    the *thread* that forked the child exits, e.g. a pool thread of asyncio.to_thread.
    """
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), str(nice), *argv]


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, wait up to timeout_s, then SIGKILL; return the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
