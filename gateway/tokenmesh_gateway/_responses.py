"""OpenAI Responses request bodies → ``tokenmesh.v1.GenerateRequest``, checked field by field.

Taken: ``model``, ``input`` (a string, or message items whose ``content`` is
a string or ``input_text`` parts; an assistant turn's parts may be
``output_text``), ``instructions`` (the system message before them),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``,
``background``, ``store``, ``metadata`` (up to 16 string pairs, echoed on the
Response), ``text.format`` (``text``, ``json_object`` or the flat
``json_schema``: ``_steering``; echoed on the Response), ``ignore_eos`` (as
on chat completions), ``user`` and
``safety_identifier`` (the generation's ``user`` label), ``prompt_cache_key``
then ``user`` (its session key, unless ``X-Session-ID`` names one:
``_session``). A field that would
change the answer and that the mesh cannot honour is refused with a 400
naming it, never dropped: ``previous_response_id`` and ``conversation``
(tokenmesh keeps no conversation state), tools, ``reasoning``, ``include``,
``prompt`` templates, ``n`` > 1, ``top_logprobs``, a ``text`` field other
than ``format``, ``truncation: "auto"``, any input item or part that is not text.
Their neutral values (``tools: []``, ``reasoning: null``...) pass, as SDKs
send them; fields nobody here knows are ignored, as on the other routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import _session, _steering
from tokenmesh_gateway._errors import invalid
from tokenmesh_gateway._fields import UINT32_MAX, boolean, integer, is_neutral, number, short, string, type_name
from tokenmesh_gateway._openai import ROLES

# field -> values that ask for nothing the mesh cannot do
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None, ""),
    "conversation": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "max_tool_calls": (None,),
    "reasoning": (None, {}),
    "include": (None, []),
    "prompt": (None,),
    "n": (None, 1),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "stream_options": (None, {}, {"include_obfuscation": False}, {"include_obfuscation": True}),
}

MAX_METADATA = 16
"""OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512."""

_PART_TYPES = {"user": ("input_text",), "system": ("input_text",), "assistant": ("output_text", "input_text")}


@dataclass(frozen=True, slots=True)
class Echo:
    """What the Response object repeats of its request (the mesh keeps the generation, not these)."""

    instructions: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    background: bool = False
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    """The caller's ``text.format`` (the output's format), repeated as given."""


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A checked Responses request: what to ask the mesh, how to answer, what the Response repeats."""

    request: inference_pb2.GenerateRequest
    stream: bool
    echo: Echo


def parse(body: dict[str, Any], default_model: str = "") -> ResponsesRequest:
    """Check body (a decoded ``POST /v1/responses`` request) and build the mesh's request."""
    for name, neutral in _NEUTRAL.items():
        if name in body and not is_neutral(body[name], neutral):
            raise invalid(f"{name} is not supported by tokenmesh (got {short(body[name])}); leave it out", name)
    request = inference_pb2.GenerateRequest(model=string(body, "model") or default_model)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid(f"instructions must be a string, got {type_name(instructions)}", "instructions")
    if instructions:
        request.messages.add(role="system", content=instructions)
    _input(body.get("input"), request)
    max_output_tokens = integer(body, "max_output_tokens")
    if max_output_tokens is not None:
        if not 1 <= max_output_tokens <= UINT32_MAX:
            raise invalid(f"max_output_tokens must be at least 1, got {max_output_tokens}", "max_output_tokens")
        request.max_tokens = max_output_tokens
    temperature, top_p = number(body, "temperature"), number(body, "top_p")
    if temperature is not None:
        request.temperature = temperature
    if top_p is not None:
        request.top_p = top_p
    request.ignore_eos = boolean(body, "ignore_eos")
    text_format = _text_format(body.get("text"), request)
    user = string(body, "safety_identifier") or string(body, "user")
    if user:
        request.labels["user"] = user
    _session.from_body(body, request, "prompt_cache_key", "user")
    background = boolean(body, "background")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid(f"store must be true or false, got {short(store)}", "store")
    if background and store is False:
        raise invalid("background responses are kept to be retrieved: send store: true (or leave it out)", "store")
    echo = Echo(
        instructions or None,
        _metadata(body.get("metadata")),
        max_output_tokens,
        temperature,
        top_p,
        store is not False,
        background,
        text_format,
    )
    return ResponsesRequest(request, boolean(body, "stream"), echo)


def _text_format(text: Any, request: inference_pb2.GenerateRequest) -> dict[str, Any]:
    """``text.format``, Responses' flat shape of the output's format, into the request; the format to repeat."""
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict):
        raise invalid(f"text must be an object with a format, got {type_name(text)}", "text")
    for key in text:
        if key != "format" and text[key] is not None:
            raise invalid(
                f"text.{key} is not supported by tokenmesh (got {short(text[key])}); leave it out", f"text.{key}"
            )
    value = text.get("format")
    _steering.response_format(value, "text.format", request)
    return value if isinstance(value, dict) else {"type": "text"}


def _input(value: Any, request: inference_pb2.GenerateRequest) -> None:
    """input: a string (one user turn), or message items (each {role, content}, type "message" or none)."""
    if isinstance(value, str):
        if not value:
            raise invalid("input is empty", "input")
        request.messages.add(role="user", content=value)
        return
    if not isinstance(value, list) or not value:
        raise invalid(f"input must be a string or a non-empty list of messages, got {short(value)}", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be a message object {{role, content}}, got {type_name(item)}", where)
        if item.get("type", "message") != "message":
            raise invalid(
                f"{where} is a {short(item.get('type'))} item; tokenmesh takes message items only", f"{where}.type"
            )
        role = item.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role is {short(role)}; use system, developer, user or assistant", f"{where}.role")
        request.messages.add(role=ROLES[role], content=_content(item.get("content"), ROLES[role], f"{where}.content"))


def _content(content: Any, role: str, where: str) -> str:
    """A message's text: a string, or text parts (joined); an image, file or audio part is refused, naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of input_text parts, got {type_name(content)}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        if kind not in _PART_TYPES[role] or not isinstance(part.get("text"), str):
            raise invalid(
                f'{where}[{j}] must be {{"type": "{_PART_TYPES[role][0]}", "text": "..."}}; tokenmesh takes text '
                f"only (got {short(kind)})",
                f"{where}[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"metadata must be an object of strings, got {type_name(value)}", "metadata")
    if len(value) > MAX_METADATA:
        raise invalid(f"metadata has {len(value)} keys; at most {MAX_METADATA}", "metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise invalid(
                f"metadata.{key[:64]}: keys are strings of up to 64 characters, values strings of up to 512 "
                f"(got {short(item)})",
                f"metadata.{key[:64]}",
            )
    return dict(value)
