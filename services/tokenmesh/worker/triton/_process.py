"""The ``tritonserver`` child process: its folder, environment, ports and lifetime.

Runs the binary shipped in the nvidia-pytriton wheel on loopback ports, in a
per-worker folder laid out with the Python backend stub for this interpreter
and a copy of the model repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import socket
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tokenmesh.process import dies_with_parent
from tokenmesh.worker.triton._shm import ShmRegions

log = logging.getLogger(__name__)

_WORKER_DIR = Path(__file__).parent.parent
"""tokenmesh/worker/, where the shipped model repositories live (package data)."""
DEFAULT_MODEL_REPOSITORY = _WORKER_DIR / "model_repository"
SHIPPED_REPOSITORIES = {
    "smollm2": DEFAULT_MODEL_REPOSITORY,
    # Placeholder tokens at a fixed rate: measures the mesh, not a model.
    "synthetic": _WORKER_DIR / "synthetic_repository",
}
"""The model repositories tokenmesh ships, by the model they hold (``tokenmesh up --model``)."""


def synthetic_repository(folder: Path, **parameters: float) -> Path:
    """A copy of the synthetic model's repository in folder with its config parameters set.

    parameters: any of the model's ``config.pbtxt`` parameters (``ttft_ms``,
    ``tokens_per_s``, ``responses_per_s``, ``n_parallel``, ``n_ctx``).
    """
    repository = folder / "synthetic_repository"
    shutil.copytree(SHIPPED_REPOSITORIES["synthetic"], repository)
    config = repository / "synthetic" / "config.pbtxt"
    text = config.read_text()
    for key, value in parameters.items():
        pattern = rf'(parameters {{ key: "{key}" value: {{ string_value: ")[^"]*(" }} }})'
        shown = str(int(value)) if float(value).is_integer() else repr(float(value))  # no exponents: int() reads it
        text, found = re.subn(pattern, rf"\g<1>{shown}\g<2>", text)
        if not found:
            raise ValueError(f"the synthetic model has no parameter {key!r}")
    config.write_text(text)
    return repository


class PortTaken(RuntimeError):
    """Triton could not bind a port we picked for it."""


def _install(source: Path, target: Path) -> None:
    """Copy source to target by a rename, never by writing over it.

    A worker restarted in its own work folder (a container restart keeps its emptyDir) may find the previous
    Triton's stubs still running from target for a moment: writing over a running executable fails with "Text
    file busy", replacing its directory entry does not (the old processes keep the old file).
    """
    partial = target.with_name(f".{target.name}.partial")
    shutil.copy2(source, partial)
    partial.replace(target)


def _pytriton_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent


def _free_ports(host: str, count: int) -> list[int]:
    """Ports free on host now, all different.

    Bound at once: one after the other, the kernel may hand out the port just released twice, and Triton then
    refused to serve gRPC and metrics on one port.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]


@dataclass(frozen=True, kw_only=True)
class TritonProcessConfig:
    """How a worker starts its own Triton server."""

    work_dir: Path
    """Per-worker folder for the backend binaries, model copy and log."""
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    """Source model repository; copied, with parameter overrides applied."""
    model_parameters: tuple[tuple[str, str], ...] = ()
    """config.pbtxt parameters to override in every model (e.g. n_threads)."""
    cuda_visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES for Triton; None inherits ours."""
    host: str = "127.0.0.1"
    """Address Triton listens on."""
    nice: int = 0
    """Niceness added to Triton and its models (the worker's own is unchanged)."""
    start_timeout_s: float = 180.0
    """How long to wait for every model to be READY."""
    extra_args: tuple[str, ...] = ()
    """More tritonserver flags, after ours (e.g. ``--model-control-mode=explicit``)."""


_LOAD_FAILED = re.compile(r"""\] "failed to load '(?P<model>[^']+)' version \d+: (?P<reason>.*?)(?:\\n|"$)""")
"""Triton's log line for a model that failed to load; its reason (the model's own exception) up to the first
escaped newline (a traceback follows)."""


def load_failures(log: str) -> list[str]:
    """'<model>: <reason>' for each model Triton's log says failed to load.

    A tritonserver whose model fails exits with only "failed to load all models" as its last line, the model's
    own error some 40 lines above (the tables of backends, models and options come between), and its repository
    index, which has the reason too, is gone with it.
    """
    return [f"{m['model']}: {m['reason']}" for m in map(_LOAD_FAILED.search, log.splitlines()) if m is not None]


class TritonProcess:
    """A ``tritonserver`` child process; :meth:`stop` is safe to call twice."""

    def __init__(self, config: TritonProcessConfig) -> None:
        self.config = config
        self.grpc_port = 0
        self.http_port = 0
        self.metrics_port = 0
        self._proc: asyncio.subprocess.Process | None = None
        self.log_path = config.work_dir / "tritonserver.log"
        self._log_start = 0
        self.shm = ShmRegions()

    @property
    def url(self) -> str:
        """host:port of Triton's gRPC endpoint."""
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        """PID of the tritonserver process while it runs."""
        return self._proc.pid if self._proc else None

    def _prepare(self) -> tuple[Path, Path]:
        """Lay out backends/python (with the stub for our Python) and models/."""
        cfg = self.config
        dist = _pytriton_dir() / "tritonserver"
        backend_dir = cfg.work_dir / "backends"
        py_backend = backend_dir / "python"
        py_backend.mkdir(parents=True, exist_ok=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            _install(dist / "backends" / "python" / name, py_backend / name)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
        _install(stub, py_backend / "triton_python_backend_stub")

        models = cfg.work_dir / "models"
        if models.exists():
            shutil.rmtree(models)
        shutil.copytree(cfg.model_repository, models, ignore=shutil.ignore_patterns("__pycache__"))
        if cfg.model_parameters:
            for config_file in models.glob("*/config.pbtxt"):
                model_config = text_format.Parse(config_file.read_text(), mc.ModelConfig())
                for key, value in cfg.model_parameters:
                    model_config.parameters[key].string_value = value
                config_file.write_text(text_format.MessageToString(model_config))
        return backend_dir, models

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        libs = [
            str(sysconfig.get_config_var("LIBDIR")),  # libpython of *this* interpreter (see ARCHITECTURE pitfalls)
            str(_pytriton_dir().parent / "nvidia_pytriton.libs"),
        ]
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        # The stub's embedded Python ignores PYTHONPATH and finds its prefix by
        # looking up "python3" on PATH: our venv's bin first makes it use the
        # venv's site-packages (xllamacpp, numpy<2) and not the system's.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        if self.config.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.config.cuda_visible_devices
        return env

    async def start(self) -> None:
        """Start Triton and return once its server is live (models may still load)."""
        cfg = self.config
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        backend_dir, models = self._prepare()
        self.grpc_port, self.http_port, self.metrics_port = _free_ports(cfg.host, 3)
        binary = _pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
        self.shm.claim()  # what a killed Triton (this one's last, or a dead worker's) left in /dev/shm goes
        args = [
            str(binary),
            f"--model-repository={models}",
            f"--backend-directory={backend_dir}",
            f"--cache-directory={_pytriton_dir() / 'tritonserver' / 'caches'}",
            f"--grpc-address={cfg.host}",
            f"--grpc-port={self.grpc_port}",
            # HTTP for the generations' streams (._sse: cheaper per token than a gRPC read), gRPC for the rest.
            f"--http-address={cfg.host}",
            f"--http-port={self.http_port}",
            f"--metrics-address={cfg.host}",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=5",
            "--log-verbose=0",
            *self.shm.backend_config(),
            *cfg.extra_args,
        ]
        log_file = self.log_path.open("ab")
        self._log_start = log_file.tell()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *dies_with_parent(args, cfg.nice),  # Triton must not outlive its worker, even a SIGKILLed one
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env=self._environment(),
                cwd=cfg.work_dir,
            )
        finally:
            log_file.close()
        log.info("tritonserver pid %d on %s (log %s)", self._proc.pid, self.url, self.log_path)

    def exited(self) -> bool:
        """True once the process has ended."""
        return self._proc is not None and self._proc.returncode is not None

    async def wait(self) -> int:
        """Wait for the process to end; return its exit code."""
        assert self._proc is not None
        return await self._proc.wait()

    def log_tail(self, lines: int = 15) -> str:
        """The end of Triton's log since its latest start, for error messages."""
        return "\n".join(self._log_since_start().splitlines()[-lines:])

    def load_failures(self) -> list[str]:
        """Each model that failed to load since the latest start, with the reason Triton logged."""
        return load_failures(self._log_since_start())

    def _log_since_start(self) -> str:
        try:
            with self.log_path.open("rb") as log_file:
                log_file.seek(self._log_start)
                return log_file.read().decode(errors="replace")
        except OSError:
            return ""

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not ended in 10 s; then its shared-memory regions go."""
        try:
            await self._end()
        finally:
            if self.exited():  # not while a cancelled stop leaves it running
                self.shm.release()

    async def _end(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
