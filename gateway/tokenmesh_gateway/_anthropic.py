"""Anthropic Messages request bodies → ``tokenmesh.v1.GenerateRequest``, checked field by field.

Taken: ``model``, ``messages`` (user and assistant turns, each a string or
text blocks), ``system`` (a string or text blocks), ``max_tokens``
(required, as Anthropic requires it), ``temperature`` (0..1, as Anthropic),
``top_p``, ``top_k`` and ``output_format`` (``_steering``, as the OpenAI
routes take them), ``stop_sequences``, ``stream``, ``metadata.user_id`` (the
generation's ``user`` label, and its session key unless ``X-Session-ID``
names one: ``_session``) and ``ignore_eos`` (not Anthropic's: the OpenAI
routes' extension, so that ``tokenmesh bench`` asks every API for the same
lengths). A field that would change the answer in a way
the mesh cannot honour (tools, images and documents, extended thinking,
a last assistant turn to continue...) is refused with a 400 naming
it, never silently dropped; its neutral values (``tools: []``,
``thinking: {"type": "disabled"}``...) are accepted. Other fields are
ignored, as the OpenAI routes ignore them (``cache_control`` on a block only
hints at caching and is ignored too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import _session, _steering
from tokenmesh_gateway._errors import invalid
from tokenmesh_gateway._fields import UINT32_MAX, boolean, is_neutral, number, short, string, type_name

ROLES = ("user", "assistant")
"""The roles of Anthropic's messages (the system prompt is the top-level ``system``)."""

# field -> values that ask for nothing the mesh cannot do
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, {"type": "auto"}, {"type": "none"}),
    "thinking": (None, {"type": "disabled"}),
    "mcp_servers": (None, []),
    "container": (None,),
    "context_management": (None,),
    "output_config": (None, {}),
}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A checked Messages request: what to ask the mesh, and whether to stream the answer."""

    request: inference_pb2.GenerateRequest
    stream: bool


def parse(body: dict[str, Any], default_model: str = "") -> MessagesRequest:
    """Check body (a decoded Messages request) and build the mesh's request."""
    for name, neutral in _NEUTRAL.items():
        if name in body and not is_neutral(body[name], neutral):
            raise invalid(f"{name} is not supported by tokenmesh (got {short(body[name])}); leave it out", name)
    request = inference_pb2.GenerateRequest(model=string(body, "model") or default_model)
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            request.messages.add(role="system", content=text)
    _messages(body, request)
    request.max_tokens = _max_tokens(body)
    _sampling(body, request)
    _steering.sampling(body, request, penalties=False)  # Anthropic's top_k; it has no penalties
    _steering.response_format(body.get("output_format"), "output_format", request)
    request.ignore_eos = boolean(body, "ignore_eos")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {short(stream)}", "stream")
    return MessagesRequest(request, bool(stream))


def _messages(body: dict[str, Any], request: inference_pb2.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid(f"messages must be a list of {{role, content}} objects, got {type_name(messages)}", "messages")
    if not messages:
        raise invalid("messages is empty: send at least one {role, content}", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with role and content, got {type_name(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(
                f"{where}.role is {short(role)}; use user or assistant (the system prompt is the top-level system)",
                f"{where}.role",
            )
        request.messages.add(role=role, content=_text(message.get("content"), f"{where}.content"))
    if messages[-1].get("role") == "assistant":
        # Anthropic continues a last assistant turn (prefill); the mesh's chat template would close it and start a
        # new turn, a different answer.
        where = f"messages[{len(messages) - 1}]"
        raise invalid(
            f"{where} is an assistant turn: tokenmesh cannot continue (prefill) an assistant message; end with user",
            f"{where}.role",
        )


def _text(content: Any, where: str) -> str:
    """A string, or text blocks (joined); any other block is refused, naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text blocks, got {type_name(content)}", where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type_name(block)
        if kind != "text" or not isinstance(block.get("text"), str):
            raise invalid(
                f'{where}[{j}] must be {{"type": "text", "text": "..."}}; tokenmesh takes text only '
                f"(got {short(kind)})",
                f"{where}[{j}]",
            )
        if block.get("citations"):
            raise invalid(f"{where}[{j}].citations is not supported by tokenmesh", f"{where}[{j}].citations")
        texts.append(block["text"])
    return "".join(texts)


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens")
    if value is None:
        raise invalid("max_tokens is required: the most tokens to generate, at least 1", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= UINT32_MAX:
        raise invalid(f"max_tokens must be a whole number of at least 1, got {short(value)}", "max_tokens")
    return value


def _sampling(body: dict[str, Any], request: inference_pb2.GenerateRequest) -> None:
    """The sampling fields (temperature 0..1, Anthropic's range; top_p), stop_sequences and metadata.user_id."""
    temperature = number(body, "temperature")
    if temperature is not None:
        if not 0 <= temperature <= 1:
            raise invalid(f"temperature must be 0..1, got {temperature}", "temperature")
        request.temperature = temperature
    top_p = number(body, "top_p")
    if top_p is not None:
        request.top_p = top_p
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid(f"stop_sequences must be a list of strings, got {short(stops)}", "stop_sequences")
        request.stop.extend(s for s in stops if s)
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid(f"metadata must be an object, got {type_name(metadata)}", "metadata")
    for key, value in metadata.items():
        if key != "user_id":
            raise invalid(f"metadata.{key} is not a field of metadata (only user_id is)", f"metadata.{key}")
        if value is not None and not isinstance(value, str):
            raise invalid(f"metadata.user_id must be a string, got {short(value)}", "metadata.user_id")
        if value:
            request.labels["user"] = value
            request.labels[_session.LABEL] = _session.check(value, "metadata.user_id")
