"""The shared-memory regions of a Triton's Python backend in /dev/shm: named per Triton, removed once it is gone.

The Python backend passes every request and response between Triton and the model's stub process through
regions in /dev/shm (1 MiB each at first, growing with the tensors), and unlinks them when Triton shuts down.
A Triton that is killed (SIGKILL, the OOM killer, the death of its worker, which takes Triton with it) leaves
them behind. On a pod's memory-backed /dev/shm (the chart's emptyDir, kept across container restarts) they add
up, one set per crash, until the volume's sizeLimit evicts the pod; on a host they are RAM nobody frees.

So each Triton a worker starts names its regions with a prefix of its own, and the worker holds an ``flock`` on
that prefix's lock file for as long as it may run that Triton. The kernel drops the lock when the worker dies,
however it dies and whatever PID namespace it ran in, so at every start the regions of each prefix whose lock
nobody holds are a dead worker's and are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
PREFIX = "tokenmesh_triton_"
"""Every region name (and lock file) of ours starts so; Triton's default prefix is ``triton_python_backend_``."""


class ShmRegions:
    """One Triton's region prefix and its lock (held from :meth:`claim` to :meth:`release`)."""

    def __init__(self, folder: Path = SHM) -> None:
        self.folder = folder
        self.token = secrets.token_hex(6)
        self._lock: int | None = None

    @property
    def prefix(self) -> str:
        """The Python backend's ``shm-region-prefix-name`` for this Triton (its regions are prefix + a UUID)."""
        return f"{PREFIX}{self.token}_"

    def backend_config(self) -> list[str]:
        """The tritonserver flag that names the regions, or none where there is no /dev/shm to keep tidy."""
        if not self.folder.is_dir():
            return []
        return [f"--backend-config=python,shm-region-prefix-name={self.prefix}"]

    def claim(self) -> None:
        """Hold this prefix's lock (once), then remove every dead worker's regions and this prefix's own.

        Call before each start of the Triton: an earlier Triton of this prefix has exited by then.
        """
        if not self.folder.is_dir():
            return
        if self._lock is None:
            # Locked before it has its name: a sweep never finds the file unlocked and takes it for a dead one's.
            partial = self.folder / f".{PREFIX}{self.token}.partial"
            fd = os.open(partial, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            partial.rename(self._lock_path(self.token))
            self._lock = fd
        self.sweep()
        self._remove(self.token)

    def sweep(self) -> int:
        """Remove the regions and lock files of every prefix whose lock nobody holds; return the regions removed."""
        removed = 0
        for lock in self.folder.glob(f"{PREFIX}*.lock"):
            token = lock.name.removeprefix(PREFIX).removesuffix(".lock")
            if token == self.token:
                continue
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # another worker's sweep took it first
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its worker is alive
                os.close(fd)
                continue
            try:
                removed += self._remove(token)
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
            finally:
                os.close(fd)
        if removed:
            log.info("removed %d shared-memory region(s) of Tritons that died without removing them", removed)
        return removed

    def release(self) -> None:
        """Remove this prefix's regions (its Triton has exited) and give up the lock."""
        if self._lock is None:
            return
        self._remove(self.token)
        with contextlib.suppress(FileNotFoundError):
            self._lock_path(self.token).unlink()
        os.close(self._lock)
        self._lock = None

    def _lock_path(self, token: str) -> Path:
        return self.folder / f"{PREFIX}{token}.lock"

    def _remove(self, token: str) -> int:
        removed = 0
        for region in self.folder.glob(f"{PREFIX}{token}_*"):
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
                removed += 1
        return removed
