"""A synthetic decoupled Triton Python-backend model: placeholder tokens at a fixed rate.

Runs inside Triton's Python backend stub; it may import only
``triton_python_backend_utils`` and ``numpy``. Each request streams
``max_tokens`` tokens (" t0 t1 ...") at ``tokens_per_s``, in at most
``responses_per_s`` responses a second, after ``ttft_ms``; the final response
carries ``finish_reason`` "length" and the token counts, as smollm2's does.
A cancelled request stops at its next response.

With ``shared_steps`` 1 every stream's responses fall on one clock (the
multiples of the response interval), as a batched engine's decode steps
do: vLLM, TensorRT-LLM and llama.cpp's server decode every running sequence
in one step, so their tokens come out together. With 0 (the default) each
stream keeps the phase of its own start.

A few sender threads (``sender_threads``, 16) send every stream's
responses, each at its due time (a heap of due times per thread): thousands
of slow streams cost 16 threads, not one each. One thread is not enough: a
response ``send`` blocks until Triton has it, and one thread's sends in a
row halved what 24 fast streams got (router_cost.py: 12.8k vs 19.9k tokens/s).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
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


class _Stream:
    """One request being streamed."""

    __slots__ = ("max_tokens", "prompt_tokens", "sender", "sent")

    def __init__(self, sender: Any, max_tokens: int, prompt_tokens: int) -> None:
        self.sender = sender
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.sent = 0


class _Lane:
    """One sender thread and the heap of its streams' due times."""

    def __init__(self, name: str, interval: float, per_response: int) -> None:
        self._interval = interval
        self._per_response = per_response
        self._stopping = False
        self._due: list[tuple[float, int, _Stream]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def schedule(self, due: float, stream: _Stream) -> None:
        """Send stream's next response at due."""
        with self._wake:
            heapq.heappush(self._due, (due, next(self._order), stream))
            if self._due[0][2] is stream:  # a new earliest: the thread's wait is too long now
                self._wake.notify()

    def stop(self) -> None:
        """End every stream left, as cancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def _next(self) -> tuple[float, _Stream] | None:
        """The next stream due (waiting until it is); None once stopping and none is left."""
        with self._wake:
            while True:
                if self._stopping:  # every stream left ends now, in any order
                    if not self._due:
                        return None
                    due, _, stream = self._due.pop()
                    return due, stream
                now = time.monotonic()
                if self._due and self._due[0][0] <= now:
                    due, _, stream = heapq.heappop(self._due)
                    return due, stream
                self._wake.wait(self._due[0][0] - now if self._due else None)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            due, stream = item
            if self._stopping or stream.sender.is_cancelled():
                _finish(stream, "cancelled")
                continue
            count = min(self._per_response, stream.max_tokens - stream.sent)
            text = "".join(f" t{i}" for i in range(stream.sent, stream.sent + count))
            stream.sender.send(_response(text, "", 0, count))
            stream.sent += count
            if stream.sent >= stream.max_tokens:
                _finish(stream, "length")
            else:
                # A fixed schedule: a late response does not slow the rest.
                self.schedule(due + self._interval, stream)


def _finish(stream: _Stream, reason: str) -> None:
    stream.sender.send(
        _response("", reason, stream.prompt_tokens, stream.sent), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    )


class TritonPythonModel:
    """Triton entry point: ``initialize``, ``execute``, ``finalize``."""

    def initialize(self, args: dict[str, Any]) -> None:
        """Read the rates; start the sender threads."""
        _exit_with_triton()
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        tokens_per_s = float(params.get("tokens_per_s", "1000"))
        responses_per_s = float(params.get("responses_per_s", "200"))
        interval = max(1 / tokens_per_s, 1 / responses_per_s)
        per_response = max(1, round(tokens_per_s * interval))
        self._ttft = float(params.get("ttft_ms", "5")) / 1000
        self._step = interval if params.get("shared_steps", "0") == "1" else 0.0
        lanes = max(1, int(params.get("sender_threads", "16")))
        self._lanes = [_Lane(f"synthetic-sender-{i}", interval, per_response) for i in range(lanes)]
        self._turn = itertools.count()

    def execute(self, requests: list[Any]) -> None:
        """Schedule each request's first response after the TTFT, on the sender threads in turn."""
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
            lane = self._lanes[next(self._turn) % len(self._lanes)]
            due = time.monotonic() + self._ttft
            if self._step:  # the first response at the next step of the one clock: every stream in lockstep
                due = math.ceil(due / self._step) * self._step
            lane.schedule(due, _Stream(sender, max_tokens, len(prompt.split())))
        return None

    def finalize(self) -> None:
        """Running streams end at once, as cancelled."""
        for lane in self._lanes:
            lane.stop()


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
