"""Triton's wire format for the worker's tensors: requests out, raw outputs back.

BYTES tensors travel as raw contents, each element a 4-byte little-endian
length followed by that many bytes (UTF-8 text here); UINT32 as 4 bytes.
A BYTES element whose prefix or length does not fit its bytes raises
:class:`MalformedBytes` instead of decoding to whatever the slice holds.
"""

from __future__ import annotations

import json
from typing import Any

from tritonclient.grpc import service_pb2

from tokenmesh.v1 import inference_pb2
from tokenmesh.worker._backend import Delta, Finished, GenerationParams

USAGE_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
"""The vLLM backend's optional inputs that make it send finish_reason and the token counts (Triton 24.12 on):
sent true to a model that declares them, or its usage is 0 and every generation ends ``stop``."""
LOGPROBS_FLAG = "return_logprobs"
"""The vLLM backend's switch for the ``logprobs`` output (Triton 24.12 on): sent to a request that asks for them."""


def _add_input(request: service_pb2.ModelInferRequest, name: str, datatype: str, raw: bytes) -> None:
    request.inputs.add(name=name, datatype=datatype, shape=[1])
    request.raw_input_contents.append(raw)


class MalformedBytes(ValueError):
    """A BYTES element whose 4-byte length prefix does not match the bytes that carry it."""


def encode_bytes(value: str) -> bytes:
    """One BYTES element: the UTF-8 of ``value`` after its 4-byte little-endian length."""
    data = value.encode("utf-8")
    return len(data).to_bytes(4, "little") + data


def decode_first(raw: bytes) -> str:
    """The first BYTES element of a tensor's raw contents, as text (invalid UTF-8 replaced).

    Raises:
        MalformedBytes: ``raw`` is shorter than the 4-byte prefix, or the prefix
            counts more bytes than follow it.

    """
    size = int.from_bytes(raw[:4], "little")
    if 4 + size > len(raw):  # a prefix cut short fails this too (size >= 0)
        if len(raw) < 4:
            raise MalformedBytes(f"BYTES element of {len(raw)} bytes is shorter than its 4-byte length prefix")
        raise MalformedBytes(f"BYTES element's length prefix says {size} bytes, {len(raw) - 4} follow it")
    return raw[4 : 4 + size].decode("utf-8", errors="replace")


def sampling_parameters(params: GenerationParams) -> dict[str, Any]:
    """The vLLM backend's ``sampling_parameters`` for a generation (what both transports send, as JSON)."""
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
    for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(params, name)
        if value is not None:
            sampling[name] = value
    if params.logit_bias:
        sampling["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}  # JSON keys are text
    if params.logprobs is not None:
        sampling["logprobs"] = params.logprobs  # vLLM: the sampled token's, and this many alternatives
    if params.structured is not None:
        # A JSON string: what every vLLM backend release parses (GuidedDecodingParams, then StructuredOutputsParams).
        sampling["guided_decoding"] = json.dumps(params.structured)
    if params.adapter:
        sampling["lora_name"] = params.adapter  # the vLLM backend's key, which our llama.cpp model reads too
    return sampling


def build_request(params: GenerationParams) -> service_pb2.ModelInferRequest:
    """The vLLM-backend tensors for a generation (plus the messages extension), as raw contents."""
    request = service_pb2.ModelInferRequest(model_name=params.model, id=params.request_id)
    _add_input(request, "text_input", "BYTES", encode_bytes(params.prompt))
    _add_input(request, "stream", "BOOL", b"\x01")
    _add_input(request, "sampling_parameters", "BYTES", encode_bytes(json.dumps(sampling_parameters(params))))
    if params.messages:
        _add_input(request, "messages", "BYTES", encode_bytes(messages_json(params)))
    for flag in flags(params):
        _add_input(request, flag, "BOOL", b"\x01")
    return request


def flags(params: GenerationParams) -> tuple[str, ...]:
    """The switches sent true: the usage ones the model declares, and return_logprobs when asked for."""
    if params.logprobs is None:
        return tuple(flag for flag in params.flags if flag != LOGPROBS_FLAG)
    return params.flags


def logprobs_of(text: str, alternatives: int) -> tuple[inference_pb2.TokenLogprob, ...]:
    """The vLLM backend's ``logprobs`` output (JSON: per token, {token id: {logprob, rank, decoded_token}}).

    vLLM puts the sampled token first in each position's dict (then the alternatives, which may repeat it):
    the first entry is the token, the rest by rank are its alternatives (the sampled one included when it ranks
    among them, as OpenAI's top_logprobs).
    """
    if not text or text == "null":
        return ()
    out = []
    for position in json.loads(text):
        entries = list(position.values())
        if not entries:
            continue
        token = entries[0]
        ranked = sorted((e for e in entries if e.get("rank") is not None), key=lambda e: (e["rank"], -e["logprob"]))
        seen: set[str] = set()
        top = []
        for entry in ranked:
            piece = str(entry.get("decoded_token") or "")
            if piece in seen:
                continue
            seen.add(piece)
            top.append(inference_pb2.TopLogprob(token=piece, logprob=entry["logprob"], bytes=piece.encode()))
        piece = str(token.get("decoded_token") or "")
        out.append(
            inference_pb2.TokenLogprob(
                token=piece, logprob=token["logprob"], top_logprobs=top[:alternatives], bytes=piece.encode()
            )
        )
    return tuple(out)


def messages_json(params: GenerationParams) -> str:
    """The ``messages`` extension's JSON: the chat as role/content objects, for the model's own template."""
    return json.dumps([{"role": role, "content": content} for role, content in params.messages])


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
        """The output's first element; "" when it is absent or has none; :class:`MalformedBytes` if cut."""
        # The lookup is written out rather than through _raw so a token costs
        # the same two calls (text, then the decoder) as before the codec check.
        response = self.response
        for i, output in enumerate(response.outputs):
            if output.name == name:
                contents = response.raw_output_contents
                raw = contents[i] if i < len(contents) else b""
                return decode_first(raw) if raw else ""
        return ""

    def uint(self, name: str) -> int:
        raw = self._raw(name)
        return int.from_bytes(raw[:4], "little") if len(raw) >= 4 else 0

    @property
    def final(self) -> bool:
        return bool(self.response.parameters["triton_final_response"].bool_param)


def last_events(
    finish_reason: str, input_tokens: int, cached_tokens: int, text: str, tokens: int, completion_tokens: int
) -> tuple[Delta | Finished, ...]:
    """The events of a final response: its text, if any (a non-streaming backend sends it all there), then the end.

    Args:
        finish_reason: its ``finish_reason`` ("" reads as "stop").
        input_tokens: its ``num_input_tokens``.
        cached_tokens: its ``num_cached_tokens`` (smollm2's extension; 0 for a model without it).
        text: its ``text_output``.
        tokens: its ``num_output_tokens`` (a total, or this response's share).
        completion_tokens: tokens streamed before it.

    """
    finished = Finished(finish_reason or "stop", input_tokens, max(tokens, completion_tokens), cached_tokens)
    if not text:
        return (finished,)
    return Delta(text, max(tokens - completion_tokens, 0)), finished
