"""Test model: streams "tokN " tokens fast, and fails on demand like real backends.

A prompt "fault:<kind>:<path>" fails only if this process removes <path>
first (os.unlink is atomic), so exactly one worker of a mesh sees the fault
and the others serve the retried request normally. Kinds and the texts sent
(as PyTorch/vLLM and the CUDA runtime report them):

- oom:      "CUDA out of memory. Tried to allocate ..." for this request.
- cudalost: "CUDA error: an illegal memory access was encountered" for this
            and every later request, as a lost CUDA context does, until the
            model is loaded again (Triton restarted).
"""

import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which "
    "3.06 MiB is free. Of the allocated memory 76.12 GiB is allocated by PyTorch"
)
CUDA_LOST = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call"
)


def _tensor(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(-1)[0]


def _response(text, finish, n_in, n_out):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([n_in], dtype=np.uint32)),
        pb_utils.Tensor("num_output_tokens", np.array([n_out], dtype=np.uint32)),
    ])


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
    def initialize(self, args):
        _exit_with_triton()
        self.broken = False

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = (_tensor(request, "text_input") or b"").decode()
            messages = _tensor(request, "messages")
            if messages:
                prompt = json.loads(messages)[-1]["content"]
            sampling = json.loads((_tensor(request, "sampling_parameters") or b"{}").decode())
            threading.Thread(target=self._run, args=(sender, prompt, sampling), daemon=True).start()
        return None

    def _fail(self, sender, message):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _run(self, sender, prompt, sampling):
        if self.broken:
            return self._fail(sender, CUDA_LOST)
        if prompt.startswith("fault:"):
            _, kind, path = prompt.split(":", 2)
            try:
                os.unlink(path)
            except FileNotFoundError:
                kind = ""  # another worker took the fault
            if kind == "oom":
                return self._fail(sender, OOM)
            if kind == "cudalost":
                self.broken = True
                return self._fail(sender, CUDA_LOST)
        first = prompt.count("tok")
        n = int(sampling.get("max_tokens", 16))
        for i in range(n):
            if sender.is_cancelled():
                return sender.send(_response("", "cancelled", 3, i), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            time.sleep(0.005)
            sender.send(_response(f"tok{first + i} ", "", 0, 1))
        sender.send(_response("", "length", 3 + first, n), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
