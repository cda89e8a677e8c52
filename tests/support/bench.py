"""``tokenmesh bench`` run as the command it is (a child process), for the tests of it and of the gateway."""

from __future__ import annotations

import asyncio
import subprocess
import sys


async def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m tokenmesh bench`` with ``args`` (no progress bar, no warm-up); killed if it outlives 120 s."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenmesh",
        "bench",
        "--progress",
        "off",
        "--warmup",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode or 0, stdout.decode(), stderr.decode())
