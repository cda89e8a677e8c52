"""The worker's backend over Triton: start or reach a server, wait for its models, serve generations."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import tenacity
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tokenmesh.v1 import worker_pb2
from tokenmesh.worker._backend import (
    Backend,
    BackendError,
    EngineStats,
    Generation,
    GenerationParams,
    ModelSpec,
    parse_adapters,
)
from tokenmesh.worker.triton._codec import LOGPROBS_FLAG, USAGE_FLAGS
from tokenmesh.worker.triton._generation import TritonGeneration
from tokenmesh.worker.triton._metrics import _fetch_text, parse_metrics
from tokenmesh.worker.triton._process import PortTaken, TritonProcess, TritonProcessConfig
from tokenmesh.worker.triton._sse import TritonSseGeneration

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 3
"""Starts of our own tritonserver, each on new ports, before a port taken under it fails the start."""
READY_POLL_S = 0.25
"""How often start asks Triton whether its models are READY."""
EXPLICIT_LOADS_REFUSED = "explicit model load / unload is not allowed"
"""Triton's answer to load_model unless it runs with --model-control-mode=explicit."""
TRITON_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
"""Our own channel to Triton (generations, statistics): messages of any size, as tritonclient allows."""


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
    tls: tuple[str, str, str] | None = None
    """(CA, key, certificate) files: reach the Triton at url over TLS, verifying it against the CA and presenting
    the certificate when key and certificate are set (Triton's --grpc-use-ssl-mutual); None: plaintext."""


class _Starting(Exception):
    """Triton does not answer yet, or still loads a model: ask again."""


def _log_port_taken(state: tenacity.RetryCallState) -> None:
    log.warning("Triton's port was taken before it bound (attempt %d); trying new ports", state.attempt_number)


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

        async def attempt() -> None:
            try:
                await self._start_once()
            except PortTaken:
                await self.stop()
                raise

        # The free ports were picked by binding and releasing them, so another
        # process can take one before Triton binds: then again, on new ports.
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(PortTaken),
            stop=tenacity.stop_after_attempt(PORT_ATTEMPTS),
            before_sleep=_log_port_taken,
        )
        try:
            await retrying(attempt)
        except tenacity.RetryError as exc:
            raise RuntimeError(f"tritonserver could not bind free ports in {PORT_ATTEMPTS} attempts") from (
                exc.last_attempt.exception()
            )

    async def _start_once(self) -> None:
        if self.process is not None:
            await self.process.start()
        await self._connect()
        timeout = self.config.process.start_timeout_s if self.config.process else 60.0
        # Triton has no event for "every model READY": poll its index until then.
        polling = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(_Starting),
            wait=tenacity.wait_fixed(READY_POLL_S),
            stop=tenacity.stop_after_delay(timeout),
        )
        try:
            await polling(self._read_models)
        except tenacity.RetryError as exc:
            tail = self.process.log_tail() if self.process else ""
            raise RuntimeError(
                f"Triton at {self.endpoint} had no READY model after {timeout:.0f} s "
                f"({exc.last_attempt.exception()})\n{tail}"
            ) from exc.last_attempt.exception()

    async def _read_models(self) -> None:
        """Take the READY models' specs; :class:`_Starting` while Triton is unreachable or loading."""
        if self.process is not None and self.process.exited():
            tail = self.process.log_tail()
            if "already in use" in tail:
                raise PortTaken(tail)
            # The model's own error, which the tail (Triton's tables, then "failed to load all models") lacks.
            failures = self.process.load_failures()
            why = f" (model {'; model '.join(failures)})" if failures else ""
            raise RuntimeError(f"tritonserver exited during start{why}:\n{tail}")
        try:
            self._models = await self._model_specs()
        except InferenceServerException as exc:
            raise _Starting(f"not answering: {exc}") from exc

    async def _model_specs(self) -> list[ModelSpec]:
        assert self._client is not None
        index = await self._client.get_model_repository_index(as_json=True, client_timeout=5)
        entries = index.get("models", [])
        if not entries:
            raise _Starting("no model in the repository index yet")
        loading = [
            f"{e['name']} {e.get('state') or 'UNKNOWN'}"
            for e in entries
            if e.get("state") not in ("READY", "UNAVAILABLE")
        ]
        if loading:
            raise _Starting(f"still loading: {', '.join(loading)}")
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
            inputs = {i.get("name") for i in config.get("input", [])}
            adapters = parse_adapters(parameters.get("lora_adapters", ""))
            specs.append(
                ModelSpec(
                    name=name,
                    max_context=max_context,
                    slots=slots,
                    chat="messages" in inputs,
                    adapters=adapters,
                    flags=tuple(flag for flag in (*USAGE_FLAGS, LOGPROBS_FLAG) if flag in inputs),
                )
            )
        return specs

    @property
    def metrics_url(self) -> str | None:
        """Triton's Prometheus endpoint: ours, or the one configured for an external Triton."""
        if self.process is not None:
            return f"http://{self.process.config.host}:{self.process.metrics_port}/metrics"
        return self.config.metrics_url

    async def engine_stats(self) -> EngineStats | None:
        """Queue totals from Triton's statistics API; the pending gauge and adapter state from its metrics."""
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
        pending = adapters = None
        if self.metrics_url:
            try:
                text = await asyncio.to_thread(_fetch_text, self.metrics_url)
                pending, adapters = parse_metrics(text)
            except (OSError, ValueError) as exc:  # ValueError: not Prometheus text (some other endpoint)
                log.debug("Triton metrics unavailable at %s: %s", self.metrics_url, exc)
        return EngineStats(queued_total=queued, queue_ns_total=queue_ns, pending=pending, adapters=adapters)

    def models(self) -> list[ModelSpec]:
        """Models found READY at start."""
        return list(self._models)

    def generate(self, params: GenerationParams) -> Generation:
        """A streaming generation on Triton: over HTTP on our own (._sse says why), over gRPC on one by URL."""
        if self._stub is None:
            raise BackendError(worker_pb2.ERROR_CLASS_UNAVAILABLE, "Triton backend is not started")
        if self.process is not None:
            return TritonSseGeneration(self.process.config.host, self.process.http_port, params)
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
        try:
            for spec in self._models:
                await self._client.load_model(spec.name)
        except InferenceServerException as exc:
            if EXPLICIT_LOADS_REFUSED not in str(exc):
                raise
            # Triton's model control mode is none or poll (its default is none):
            # it loads its models itself, so reconnecting is all a restart can do.
            log.warning("Triton at %s does not let clients load models; reconnecting without a reload", self.endpoint)
        await self.start()

    async def _connect(self) -> None:
        """A new client and channel to Triton; those of before (a restart's) are closed first."""
        await self._disconnect()
        tls = self.config.tls if self.config.url else None  # our own Triton is on loopback, plaintext
        if tls is None:
            self._client = triton_aio.InferenceServerClient(self.endpoint)
            self._channel = grpc.aio.insecure_channel(self.endpoint, options=TRITON_CHANNEL_OPTIONS)
        else:
            ca, key, cert = tls
            self._client = triton_aio.InferenceServerClient(
                self.endpoint, ssl=True, root_certificates=ca, private_key=key or None, certificate_chain=cert or None
            )
            pem = [Path(f).read_bytes() if f else None for f in (ca, key, cert)]
            self._channel = grpc.aio.secure_channel(
                self.endpoint, grpc.ssl_channel_credentials(*pem), options=TRITON_CHANNEL_OPTIONS
            )
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def _disconnect(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await client.close()
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def stop(self) -> None:
        """Close the client and stop our Triton (if we started it)."""
        await self._disconnect()
        if self.process is not None:
            await self.process.stop()
