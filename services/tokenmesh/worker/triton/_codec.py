"""Triton's wire format for the worker's tensors: requests out, raw outputs back.

BYTES tensors travel as raw contents, each element a 4-byte little-endian
length followed by that many bytes (UTF-8 text here); UINT32 as 4 bytes.
"""

from __future__ import annotations

import json
from typing import Any

from tritonclient.grpc import service_pb2

from tokenmesh.worker.backend import GenerationParams


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
