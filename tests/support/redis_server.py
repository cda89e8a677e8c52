"""A real redis-server on a free loopback port, started and stopped by the test (by its PID), for shared quotas."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """One redis-server without persistence (a restart starts empty, as a lost Redis does)."""

    port: int
    process: subprocess.Popen[bytes] | None

    def __init__(self, port: int) -> None:
        self.port = port
        self.process = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        self.process = subprocess.Popen(  # noqa: S603 - Debian's redis-server, our arguments
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop it by its PID (SIGTERM, then SIGKILL)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    """A started redis-server, stopped after the test (also on failure); the test is skipped without one."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test-deps installs Debian's)")
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
