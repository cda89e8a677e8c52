"""What ``tokenmesh bench`` drives: the mesh's router, Triton directly (the baseline), or an OpenAI API.

The OpenAI target is any OpenAI-compatible HTTP endpoint: tokenmesh's gateway, vLLM, ...
"""

from __future__ import annotations

import abc
import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np
import orjson
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from tokenmesh.bench import apis
from tokenmesh.bench.http1 import Http1Client
from tokenmesh.bench.metrics import RequestResult
from tokenmesh.bench.prompts import Prompt
from tokenmesh.client import Client
from tokenmesh.errors import MeshError, from_rpc_error
from tokenmesh.v1 import inference_pb2, router_pb2, router_pb2_grpc
from tokenmesh.worker.triton._codec import USAGE_FLAGS

CONNECT_TIMEOUT_S = 5.0


class TargetError(Exception):
    """The target cannot be used (unreachable, unknown model)."""


class Target(abc.ABC):
    """Somewhere generations run; :meth:`run` measures one."""

    name: str

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and check the model; TargetError when that fails."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""

    @abc.abstractmethod
    async def run(self, prompt: Prompt, result: RequestResult) -> None:
        """Send prompt and fill result as its stream arrives (result.sent is already set)."""


class MeshTarget(Target):
    """The mesh's ``tokenmesh.v1.Inference`` through :class:`tokenmesh.client.Client`, as internal callers use it.

    ``addr`` may name several routers (comma-separated): the client spreads
    generations over them, retries before the first chunk and resumes a
    broken stream on another router, so the figures are what such a caller sees.
    ``batched`` (the client's default): every request to a router on its shared ``GenerateStream`` call;
    False: one ``Generate`` call per request.
    """

    name = "mesh"

    def __init__(
        self,
        addr: str,
        model: str = "",
        *,
        ignore_eos: bool = True,
        seed: int | None = 0,
        credentials: grpc.ChannelCredentials | None = None,
        batched: bool = True,
    ) -> None:
        self.addr = addr
        self.batched = batched
        self.model = model
        self.ignore_eos = ignore_eos
        self.seed = seed
        self.credentials = credentials
        self._channel: grpc.aio.Channel | None = None
        self._client: Client | None = None

    async def open(self) -> None:
        """Connect and resolve the model (the default when none is named)."""
        try:
            self._client = Client(self.addr, credentials=self.credentials, batched=self.batched)
        except ValueError as exc:
            raise TargetError(f"--addr: {exc}") from exc
        first = self.addr.split(",")[0].strip()  # the routing table's router
        self._channel = (
            grpc.aio.insecure_channel(first)
            if self.credentials is None
            else grpc.aio.secure_channel(first, self.credentials)
        )
        try:
            listed = await self._client.list_models(timeout=CONNECT_TIMEOUT_S)
        except MeshError as exc:
            raise TargetError(f"cannot reach the mesh at {self.addr}: {exc.grpc_code.name}: {exc.message}") from exc
        names = [m.name for m in listed.models]
        if not names:
            raise TargetError(f"the mesh at {self.addr} serves no model now (no live worker); try again shortly")
        if not self.model:
            self.model = next((m.name for m in listed.models if m.is_default), names[0])
        if self.model not in names:
            served = ", ".join(names)
            raise TargetError(f"model {self.model!r} is not served by the mesh at {self.addr} (served: {served})")

    async def triton_endpoints(self) -> list[str]:
        """Every worker's Triton gRPC URL, from the router's routing table."""
        assert self._channel is not None
        try:
            table = await router_pb2_grpc.RouterStub(self._channel).GetRoutingTable(
                router_pb2.GetRoutingTableRequest(), timeout=CONNECT_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            raise TargetError(
                f"cannot read the routing table at {self.addr}: {error.grpc_code.name}: {error.message}"
            ) from exc
        urls = [w.triton_url for w in table.workers if w.triton_url and w.state == router_pb2.WORKER_STATE_SERVING]
        if not urls:
            raise TargetError(f"the router at {self.addr} lists no SERVING worker with a Triton URL; give --triton-url")
        return urls

    async def close(self) -> None:
        """Close the channels."""
        if self._channel is not None:
            await self._channel.close()
        if self._client is not None:
            await self._client.close()

    async def run(self, prompt: Prompt, result: RequestResult) -> None:
        """Stream one generation; a seq that skips ends it as SEQ_GAP (the client drops repeats of a replay)."""
        assert self._client is not None
        request = inference_pb2.GenerateRequest(
            model=self.model, prompt=prompt.text, max_tokens=prompt.max_tokens, ignore_eos=self.ignore_eos
        )
        for role, content in prompt.messages:
            request.messages.add(role=role, content=content)
        if self.seed is not None:
            request.seed = self.seed
        expected = 1
        try:
            async for chunk in self._client.generate(request):
                now = time.monotonic()
                if chunk.seq != expected:
                    result.error = "SEQ_GAP"
                    result.ended = now
                    return
                expected += 1
                if chunk.text:
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(chunk.token_count)
                if chunk.finish_reason:
                    _final(chunk, result, now)
            if result.ended is None:
                result.error, result.ended = "NO_FINAL_CHUNK", time.monotonic()
        except MeshError as exc:
            result.error = exc.grpc_code.name
            result.ended = time.monotonic()


def _final(chunk: inference_pb2.GenerateChunk, result: RequestResult, now: float) -> None:
    """What the final chunk says: the tokens, where the time to the first token went, an error end."""
    result.output_tokens = chunk.usage.completion_tokens
    result.ended = now
    if chunk.timing.HasField("engine_ttft_ms"):
        result.engine_ttft = chunk.timing.engine_ttft_ms / 1000
    if chunk.timing.HasField("router_ttft_ms"):
        result.router_ttft = chunk.timing.router_ttft_ms / 1000
    if chunk.timing.HasField("queue_ms"):
        result.queued = chunk.timing.queue_ms / 1000
    if chunk.finish_reason == inference_pb2.FINISH_REASON_ERROR:
        result.error = "FINISH_REASON_ERROR"


def stream_inputs(text: str, sampling: dict[str, Any], messages: Sequence[tuple[str, str]] = ()) -> list[InferInput]:
    """The inputs of one decoupled streaming request (the vLLM backend's tensors)."""
    inputs = [
        bytes_input("text_input", text),
        true_input("stream"),
        bytes_input("sampling_parameters", json.dumps(sampling)),
    ]
    # The vLLM backend reports finish reason and token counts only when asked.
    inputs += [true_input(switch) for switch in USAGE_FLAGS]
    if messages:
        inputs.append(bytes_input("messages", json.dumps([{"role": r, "content": c} for r, c in messages])))
    return inputs


def read_response(response: Any) -> tuple[str, int | None, bool]:
    """A streamed response's text, its num_output_tokens (None when the model reports none), whether it is final."""
    texts = response.as_numpy("text_output")
    text = b"".join(texts.reshape(-1)).decode(errors="replace") if texts is not None else ""
    tokens = response.as_numpy("num_output_tokens")
    final = bool(response.get_response().parameters["triton_final_response"].bool_param)
    return text, int(tokens.reshape(-1)[0]) if tokens is not None else None, final


def true_input(name: str) -> InferInput:
    """A one-element BOOL input set true (``stream``, the vLLM backend's ``return_*`` switches)."""
    tensor = InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True], dtype=bool))
    return tensor


def bytes_input(name: str, value: str) -> InferInput:
    """A one-element BYTES input (the vLLM backend's text and JSON tensors)."""
    tensor = InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    return tensor


class TritonTarget(Target):
    """A Triton model straight over ``stream_infer`` (the vLLM backend's tensors), over several URLs.

    Each request goes to the Triton with the fewest requests outstanding (ties
    in turn): the ideal balancer, which knows every engine's load exactly, so
    ``--compare`` measures the mesh against the best placement.
    """

    name = "triton"

    def __init__(self, urls: Sequence[str], model: str, *, ignore_eos: bool = True, seed: int | None = 0) -> None:
        if not urls:
            raise TargetError("no Triton URL: give --triton-url HOST:PORT")
        self.urls = list(urls)
        self.model = model
        self.ignore_eos = ignore_eos
        self.seed = seed
        self._clients: list[triton_aio.InferenceServerClient] = []
        self.outstanding: list[int] = []
        """Requests in flight per URL."""
        self._turn = 0

    async def open(self) -> None:
        """Connect to every URL and check the model is ready on each."""
        for url in self.urls:
            client = triton_aio.InferenceServerClient(url)
            self._clients.append(client)
            try:
                if not await client.is_server_live(client_timeout=CONNECT_TIMEOUT_S):
                    raise TargetError(f"Triton at {url} is not live")
                ready = await client.is_model_ready(self.model, client_timeout=CONNECT_TIMEOUT_S)
            except InferenceServerException as exc:
                raise TargetError(f"cannot reach Triton at {url}: {exc.message()}") from None
            if not ready:
                index = await client.get_model_repository_index(as_json=True, client_timeout=CONNECT_TIMEOUT_S)
                served = ", ".join(m["name"] for m in index.get("models", []) if m.get("state") == "READY")
                raise TargetError(f"model {self.model!r} is not ready on Triton at {url} (ready: {served or 'none'})")
        self.outstanding = [0] * len(self._clients)

    async def close(self) -> None:
        """Close every client."""
        for client in self._clients:
            await client.close()

    async def run(self, prompt: Prompt, result: RequestResult) -> None:
        """Stream one decoupled inference; tokens from num_output_tokens when the model reports it."""
        sampling: dict[str, Any] = {"max_tokens": prompt.max_tokens, "ignore_eos": self.ignore_eos}
        if self.seed is not None:
            sampling["seed"] = self.seed
        inputs = stream_inputs(prompt.text, sampling, prompt.messages)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs}

        index = self._least_outstanding()
        client = self._clients[index]
        self.outstanding[index] += 1
        counted = 0
        try:
            async for response, error in client.stream_infer(requests()):
                now = time.monotonic()
                if error is not None:
                    raise error
                text, reported, final = read_response(response)
                tokens = reported if reported is not None else (1 if text else 0)
                if text:
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(tokens if not final else max(tokens - counted, 0))
                if final:
                    # The final response carries the request's total (the model's usage extension).
                    result.output_tokens = max(tokens, counted) if reported is not None else counted + tokens
                    result.ended = now
                    return
                counted += tokens
            result.error, result.ended = "NO_FINAL_RESPONSE", time.monotonic()
        except InferenceServerException as exc:
            result.error = (exc.status() or "TRITON_ERROR").removeprefix("StatusCode.")
            result.ended = time.monotonic()
        finally:
            self.outstanding[index] -= 1

    def _least_outstanding(self) -> int:
        """The URL with the fewest requests in flight; ties go round in turn."""
        count = len(self._clients)
        self._turn = (self._turn + 1) % count
        return min(range(count), key=lambda i: (self.outstanding[i], (i - self._turn) % count))


class OpenAITarget(Target):
    """An HTTP endpoint speaking OpenAI's APIs (or Anthropic's Messages): one streamed request per prompt.

    ``api`` picks the route (:mod:`tokenmesh.bench.apis`): ``chat``,
    ``completions``, ``responses`` or ``messages``; ``auto`` sends prompts with
    messages to chat and raw prompts to completions. Server-Sent Events are
    parsed as they arrive, over :mod:`tokenmesh.bench.http1` (a client far
    cheaper than the servers it measures), the same way for every API: TTFT is
    the first event with text. ``ignore_eos`` and ``seed`` are sent as the mesh
    target sends them (vLLM's extension; ``--allow-eos`` leaves ``ignore_eos`` out);
    ``usage_per_event`` asks chat and completions for the tokens of each event.
    """

    name = "openai"

    def __init__(  # wide: keyword-only options, each with a default
        self,
        url: str,
        model: str = "",
        *,
        api: str = "auto",
        api_key: str = "",
        ignore_eos: bool = True,
        seed: int | None = 0,
        usage_per_event: bool = True,
    ) -> None:
        if api != "auto" and api not in apis.APIS:
            raise TargetError(f"unknown API {api!r}: one of auto, {', '.join(apis.APIS)}")
        self.url = url.rstrip("/")
        self.model = model
        self.api = api
        self.ignore_eos = ignore_eos
        self.seed = seed
        self.usage_per_event = usage_per_event
        self._api_key = api_key
        self._http: Http1Client | None = None

    async def open(self) -> None:
        """Connect and resolve the model (the first one /models lists when none is named)."""
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            self._http = Http1Client(self.url, headers, connect_timeout_s=CONNECT_TIMEOUT_S)
            async with self._http.request("GET", "/models") as response:
                status, body = response.status, await asyncio.wait_for(response.read(), CONNECT_TIMEOUT_S)
        except (ValueError, OSError, TimeoutError) as exc:
            raise TargetError(f"cannot reach {self.url}: {exc}") from None
        if status != 200:
            raise TargetError(f"GET {self.url}/models answered {status}: {body[:200].decode(errors='replace')}")
        try:
            names = [str(m["id"]) for m in orjson.loads(body)["data"]]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise TargetError(f"GET {self.url}/models did not answer an OpenAI model list") from None
        if not names:
            raise TargetError(f"{self.url}/models lists no model")
        if not self.model:
            self.model = names[0]
        if self.model not in names:
            raise TargetError(f"model {self.model!r} is not served at {self.url} (served: {', '.join(names)})")

    async def close(self) -> None:
        """Close the connections."""
        if self._http is not None:
            await self._http.close()

    async def run(self, prompt: Prompt, result: RequestResult) -> None:
        """Stream one request, timing each event with text."""
        assert self._http is not None
        api = apis.resolve(self.api, prompt)
        path, body = apis.request(
            api, prompt, self.model, ignore_eos=self.ignore_eos, seed=self.seed, usage_per_event=self.usage_per_event
        )
        try:
            async with self._http.request("POST", path, body) as response:
                if response.status != 200:
                    result.error, result.ended = _http_error(response.status, await response.read()), time.monotonic()
                    return
                await apis.read(response, apis.READERS[api](result), time.monotonic)
        except OSError as exc:
            result.error, result.ended = type(exc).__name__.upper(), time.monotonic()


def _http_error(status: int, body: bytes) -> str:
    """The error's code (OpenAI's) or type (Anthropic's) in upper case (RESOURCE_EXHAUSTED...), else HTTP_<status>."""
    try:
        error = orjson.loads(body)["error"]
        code = error.get("code") or error.get("type")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        code = None
    return str(code).upper() if isinstance(code, str) and code else f"HTTP_{status}"
