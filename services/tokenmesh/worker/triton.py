"""Triton Inference Server: the process a worker starts, and the backend over it.

:class:`TritonProcess` runs the ``tritonserver`` binary shipped in the
nvidia-pytriton wheel on loopback ports, in a per-worker folder.
:class:`TritonBackend` forwards generations to a Triton (its own or one given by
URL) as one ``ModelStreamInfer`` call each, on a decoupled model whose tensors
follow the Triton vLLM backend contract, and reads queue statistics through the
same generated stub; ``tritonclient`` serves the rest (model index, configs,
readiness, loading).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import sysconfig
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import tritonclient.grpc.aio as triton_aio
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tokenmesh.errors import classify_backend_message
from tokenmesh.process import dies_with_parent
from tokenmesh.v1 import worker_pb2
from tokenmesh.worker.backend import (
    Backend,
    BackendError,
    Delta,
    EngineStats,
    Finished,
    Generation,
    GenerationParams,
    ModelSpec,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL_REPOSITORY = Path(__file__).parent / "model_repository"
SHIPPED_REPOSITORIES = {
    "smollm2": DEFAULT_MODEL_REPOSITORY,
    # Placeholder tokens at a fixed rate: measures the mesh, not a model.
    "synthetic": Path(__file__).parent / "synthetic_repository",
}
"""The model repositories tokenmesh ships, by the model they hold (``tokenmesh up --model``)."""
PORT_ATTEMPTS = 3
TRITON_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
"""Our own channel to Triton (generations, statistics): messages of any size, as tritonclient allows."""


class PortTaken(RuntimeError):
    """Triton could not bind a port we picked for it."""


def _pytriton_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own Triton's endpoint
        return str(response.read().decode())


def parse_pending(metrics: str) -> int | None:
    """Sum of ``nv_inference_pending_request_count`` over models in Prometheus text; None if absent."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("nv_inference_pending_request_count{")
    ]
    return int(sum(values)) if values else None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


class TritonProcess:
    """A ``tritonserver`` child process; :meth:`stop` is safe to call twice."""

    def __init__(self, config: TritonProcessConfig) -> None:
        self.config = config
        self.grpc_port = 0
        self.metrics_port = 0
        self._proc: asyncio.subprocess.Process | None = None
        self.log_path = config.work_dir / "tritonserver.log"
        self._log_start = 0

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
            shutil.copy2(dist / "backends" / "python" / name, py_backend / name)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
        shutil.copy2(stub, py_backend / "triton_python_backend_stub")

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
        self.grpc_port = _free_port(cfg.host)
        self.metrics_port = _free_port(cfg.host)
        binary = _pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
        args = [
            str(binary),
            f"--model-repository={models}",
            f"--backend-directory={backend_dir}",
            f"--cache-directory={_pytriton_dir() / 'tritonserver' / 'caches'}",
            f"--grpc-address={cfg.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-http=false",
            f"--metrics-address={cfg.host}",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=5",
            "--log-verbose=0",
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
        try:
            with self.log_path.open("rb") as log_file:
                log_file.seek(self._log_start)
                text = log_file.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not ended in 10 s."""
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


def _add_input(request: service_pb2.ModelInferRequest, name: str, datatype: str, raw: bytes) -> None:
    request.inputs.add(name=name, datatype=datatype, shape=[1])
    request.raw_input_contents.append(raw)


def _bytes_element(value: str) -> bytes:
    data = value.encode("utf-8")
    return len(data).to_bytes(4, "little") + data  # Triton's BYTES: 4-byte length, then the bytes


def build_request(params: GenerationParams) -> service_pb2.ModelInferRequest:
    """The vLLM-backend tensors for a generation (plus the messages extension), as raw contents."""
    sampling: dict[str, Any] = {"max_tokens": params.max_tokens}
    if params.temperature is not None:
        sampling["temperature"] = params.temperature
    if params.top_p is not None:
        sampling["top_p"] = params.top_p
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.seed is not None:
        sampling["seed"] = params.seed
    if params.ignore_eos:
        sampling["ignore_eos"] = True
    request = service_pb2.ModelInferRequest(model_name=params.model, id=params.request_id)
    _add_input(request, "text_input", "BYTES", _bytes_element(params.prompt))
    _add_input(request, "stream", "BOOL", b"\x01")
    _add_input(request, "sampling_parameters", "BYTES", _bytes_element(json.dumps(sampling)))
    if params.messages:
        messages = [{"role": role, "content": content} for role, content in params.messages]
        _add_input(request, "messages", "BYTES", _bytes_element(json.dumps(messages)))
    return request


class _Outputs:
    """The first element of each output of one Triton response, read from its raw bytes.

    Per token this is the worker's hot path: reading ``raw_output_contents``
    directly (BYTES: 4-byte little-endian length, then the bytes; UINT32: 4
    bytes) skips a numpy deserialization of every tensor.
    """

    def __init__(self, response: service_pb2.ModelInferResponse) -> None:
        self.response = response

    def _raw(self, name: str) -> bytes:
        for i, output in enumerate(self.response.outputs):
            if output.name == name:
                raw = self.response.raw_output_contents
                return raw[i] if i < len(raw) else b""
        return b""

    def text(self, name: str) -> str:
        raw = self._raw(name)
        if len(raw) < 4:
            return ""
        size = int.from_bytes(raw[:4], "little")
        return raw[4:4 + size].decode("utf-8", errors="replace")

    def uint(self, name: str) -> int:
        raw = self._raw(name)
        return int.from_bytes(raw[:4], "little") if len(raw) >= 4 else 0

    @property
    def final(self) -> bool:
        return bool(self.response.parameters["triton_final_response"].bool_param)


def _rpc_error_class(exc: grpc.aio.AioRpcError) -> worker_pb2.ErrorClass:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return worker_pb2.ERROR_CLASS_TIMEOUT
    if code == grpc.StatusCode.UNAVAILABLE:
        return worker_pb2.ERROR_CLASS_UNAVAILABLE
    return classify_backend_message(exc.details() or "")


class TritonGeneration(Generation):
    """One decoupled ``ModelStreamInfer`` call; cancelling it cancels the Triton request.

    The call is made with the generated gRPC stub, not tritonclient's
    ``stream_infer``: one write of a request built with raw contents, then
    reads, with no request-iterator task and no per-response wrapper objects
    (the worker's CPU per token competes with the engine on small machines).
    """

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, params: GenerationParams) -> None:
        self._stub = stub
        self._params = params
        self._call: Any = None
        self._cancelled = False

    def cancel(self) -> None:
        """Cancel the gRPC call: Triton marks the request cancelled, the model stops."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        """Deltas as Triton streams them, then Finished (or BackendError)."""
        params = self._params
        completion_tokens = 0
        if self._cancelled:
            yield Finished("cancelled", 0, 0)
            return
        call = self._call = self._stub.ModelStreamInfer(timeout=params.timeout_s)
        try:
            await call.write(build_request(params))
            await call.done_writing()  # Triton ends the stream after the final response
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                if message.error_message:
                    error = message.error_message
                    raise BackendError(classify_backend_message(error), f"Triton: {error}")
                outputs = _Outputs(message.infer_response)
                text = outputs.text("text_output")
                tokens = outputs.uint("num_output_tokens")
                final = outputs.final
                if not final:
                    completion_tokens += tokens
                    if text:
                        yield Delta(text, tokens)
                    continue
                finish = outputs.text("finish_reason") or "stop"
                if text:  # non-streaming backends put everything in the final response
                    yield Delta(text, tokens - completion_tokens if tokens > completion_tokens else 0)
                yield Finished(finish, outputs.uint("num_input_tokens"), max(tokens, completion_tokens))
                return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            if self._cancelled:
                yield Finished("cancelled", 0, completion_tokens)
                return
            if isinstance(exc, asyncio.InvalidStateError):
                raise
            message = f"{exc.code().name}: {exc.details()}"
            raise BackendError(_rpc_error_class(exc), f"Triton: {message}") from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._cancelled and task is not None and task.cancelling() == 0:
                yield Finished("cancelled", 0, completion_tokens)
                return
            raise
        finally:
            call.cancel()  # no-op once Triton ended the stream
        if self._cancelled:
            yield Finished("cancelled", 0, completion_tokens)
            return
        raise BackendError(worker_pb2.ERROR_CLASS_BACKEND, "Triton closed the stream before the final response")


@dataclass(frozen=True, kw_only=True)
class TritonBackendConfig:
    """Where the backend's Triton is, and what to assume of external models."""

    url: str | None = None
    """An existing Triton's gRPC host:port; None starts our own (process config)."""
    metrics_url: str | None = None
    """An existing Triton's metrics endpoint (http://host:8002/metrics), for its pending count."""
    process: TritonProcessConfig | None = None
    """How to start our own Triton (when url is None)."""
    default_max_context: int = 4096
    """Context per request for models whose config does not say (n_ctx/n_parallel)."""
    default_slots: int = 4
    """Concurrent generations for models whose config does not say (n_parallel)."""


class TritonBackend(Backend):
    """Generations through Triton; starts its own server unless given a URL."""

    def __init__(self, config: TritonBackendConfig) -> None:
        if config.url is None and config.process is None:
            raise ValueError("TritonBackend needs a url or a process config")
        self.config = config
        self.process = TritonProcess(config.process) if config.url is None and config.process else None
        self._client: triton_aio.InferenceServerClient | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self._models: list[ModelSpec] = []

    @property
    def endpoint(self) -> str:
        """Triton's gRPC host:port."""
        return self.process.url if self.process else (self.config.url or "")

    @property
    def pid(self) -> int | None:
        """PID of our tritonserver (None over an external Triton)."""
        return self.process.pid if self.process else None

    async def start(self) -> None:
        """Start (or reach) Triton and wait until every model is READY."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                await self._start_once()
                return
            except PortTaken:
                # The free ports were picked by binding and releasing them, so
                # another process can take one before Triton binds: new ports.
                log.warning("Triton's port was taken before it bound (attempt %d); trying new ports", attempt)
                await self.stop()
        raise RuntimeError(f"tritonserver could not bind free ports in {PORT_ATTEMPTS} attempts")

    async def _start_once(self) -> None:
        if self.process is not None:
            await self.process.start()
        self._client = triton_aio.InferenceServerClient(self.endpoint)
        self._channel = grpc.aio.insecure_channel(self.endpoint, options=TRITON_CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        timeout = self.config.process.start_timeout_s if self.config.process else 60.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.process is not None and self.process.exited():
                tail = self.process.log_tail()
                if "already in use" in tail:
                    raise PortTaken(tail)
                raise RuntimeError(f"tritonserver exited during start:\n{tail}")
            with contextlib.suppress(InferenceServerException):
                if await self._load_models():
                    return
            if loop.time() > deadline:
                tail = self.process.log_tail() if self.process else ""
                raise RuntimeError(f"Triton at {self.endpoint} had no READY model after {timeout:.0f} s\n{tail}")
            await asyncio.sleep(0.25)

    async def _load_models(self) -> bool:
        assert self._client is not None
        index = await self._client.get_model_repository_index(as_json=True, client_timeout=5)
        entries = index.get("models", [])
        if not entries or any(entry.get("state") not in ("READY", "UNAVAILABLE") for entry in entries):
            return False  # still loading
        ready = [entry["name"] for entry in entries if entry.get("state") == "READY"]
        if not ready:
            failed = "; ".join(f"{e['name']}: {e.get('reason', '')}" for e in entries)
            raise RuntimeError(f"no model loaded: {failed}")
        specs = []
        for name in sorted(ready):
            config = (await self._client.get_model_config(name, as_json=True, client_timeout=5))["config"]
            parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
            slots = int(parameters.get("n_parallel") or self.config.default_slots)
            n_ctx = parameters.get("n_ctx")
            max_context = int(n_ctx) // slots if n_ctx else self.config.default_max_context
            specs.append(ModelSpec(name=name, max_context=max_context, slots=slots))
        self._models = specs
        return True

    async def ready(self) -> bool:
        """True when Triton answers and every model is READY."""
        if self._client is None or (self.process is not None and self.process.exited()):
            return False
        try:
            for spec in self._models:
                if not await self._client.is_model_ready(spec.name, client_timeout=2):
                    return False
        except InferenceServerException:
            return False
        return True

    @property
    def metrics_url(self) -> str | None:
        """Triton's Prometheus endpoint: ours, or the one configured for an external Triton."""
        if self.process is not None:
            return f"http://{self.process.config.host}:{self.process.metrics_port}/metrics"
        return self.config.metrics_url

    async def engine_stats(self) -> EngineStats | None:
        """Queue totals from Triton's statistics API; the pending gauge from its metrics endpoint."""
        if self._stub is None:
            return None
        try:
            # The generated stub, not tritonclient's as_json: a JSON round trip of every model's
            # statistics each poll cost more CPU than the rest of an idle worker.
            stats = await self._stub.ModelStatistics(service_pb2.ModelStatisticsRequest(), timeout=2)
        except grpc.aio.AioRpcError as exc:
            log.debug("Triton statistics unavailable: %s", exc.details())
            return None
        queued = queue_ns = 0
        for model in stats.model_stats:
            queued += model.inference_stats.queue.count
            queue_ns += model.inference_stats.queue.ns
        pending = None
        if self.metrics_url:
            try:
                text = await asyncio.to_thread(_fetch_text, self.metrics_url)
                pending = parse_pending(text)
            except OSError as exc:
                log.debug("Triton metrics unavailable at %s: %s", self.metrics_url, exc)
        return EngineStats(queued_total=queued, queue_ns_total=queue_ns, pending=pending)

    def models(self) -> list[ModelSpec]:
        """Models found READY at start."""
        return list(self._models)

    def generate(self, params: GenerationParams) -> Generation:
        """A streaming generation on Triton."""
        if self._stub is None:
            raise BackendError(worker_pb2.ERROR_CLASS_UNAVAILABLE, "Triton backend is not started")
        return TritonGeneration(self._stub, params)

    async def failed(self) -> str:
        """Wait for our tritonserver to exit; return its exit code as the reason."""
        if self.process is None:
            return await super().failed()
        code = await self.process.wait()
        return f"tritonserver exited with {code}\n{self.process.log_tail(5)}"

    async def restart(self) -> None:
        """Restart our tritonserver (new ports), or reload the models of an external one."""
        if self.process is not None:
            await self.stop()
            await self.start()
            return
        assert self._client is not None
        for spec in self._models:
            await self._client.load_model(spec.name)
        await self.start()

    async def stop(self) -> None:
        """Close the client and stop our Triton (if we started it)."""
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await client.close()
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()
        if self.process is not None:
            await self.process.stop()
