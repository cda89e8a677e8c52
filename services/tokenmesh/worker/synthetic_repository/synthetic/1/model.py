"""A synthetic decoupled Triton Python-backend model: placeholder tokens at a fixed rate.

Runs inside Triton's Python backend stub; it may import only
``triton_python_backend_utils`` and ``numpy``. Each request streams
``max_tokens`` tokens (" t0 t1 ...") at ``tokens_per_s``, in at most
``responses_per_s`` responses a second, after ``ttft_ms``; the final response
carries ``finish_reason`` "length" and the token counts, as smollm2's does.
A cancelled request stops at its next response.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


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
        """Read the rates."""
        _exit_with_triton()
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        tokens_per_s = float(params.get("tokens_per_s", "1000"))
        responses_per_s = float(params.get("responses_per_s", "200"))
        self._interval = max(1 / tokens_per_s, 1 / responses_per_s)
        self._per_response = max(1, round(tokens_per_s * self._interval))
        self._ttft = float(params.get("ttft_ms", "5")) / 1000
        self._stopping = False

    def execute(self, requests: list[Any]) -> None:
        """One streaming thread per request."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                sampling = json.loads(_input_str(request, "sampling_parameters") or "{}")
                max_tokens = int(sampling.get("max_tokens") or 16)
                if max_tokens < 1:
                    raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
                prompt = _input_str(request, "messages") or _input_str(request, "text_input") or ""
            except Exception as exc:  # noqa: BLE001 - a bad request must be answered, not crash the stub
                sender.send(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"bad request: {exc}", pb_utils.TritonError.INVALID_ARG)
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            args = (sender, max_tokens, len(prompt.split()))
            threading.Thread(target=self._stream, args=args, daemon=True).start()
        return None

    def finalize(self) -> None:
        """Running streams end at their next response."""
        self._stopping = True

    def _stream(self, sender: Any, max_tokens: int, prompt_tokens: int) -> None:
        sent = 0
        finish = "length"
        due = time.monotonic() + self._ttft
        while sent < max_tokens:
            time.sleep(max(0.0, due - time.monotonic()))
            if self._stopping or sender.is_cancelled():
                finish = "cancelled"
                break
            count = min(self._per_response, max_tokens - sent)
            text = "".join(f" t{i}" for i in range(sent, sent + count))
            sender.send(_response(text, "", 0, count))
            sent += count
            due += self._interval  # a fixed schedule: a late response does not slow the rest
        sender.send(_response("", finish, prompt_tokens, sent), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _input_str(request: Any, name: str) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _response(text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([finish.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([prompt_tokens], dtype=np.uint32)),
            pb_utils.Tensor("num_output_tokens", np.array([completion_tokens], dtype=np.uint32)),
        ]
    )
