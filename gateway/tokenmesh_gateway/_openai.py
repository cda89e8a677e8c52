"""OpenAI request bodies → ``tokenmesh.v1.GenerateRequest``, checked field by field.

Fields are taken as vLLM's OpenAI server takes them: the sampling
extensions, ``logit_bias``, ``response_format`` and vLLM's ``guided_*``
through ``_steering``, as every dialect. A field that would change the
answer and that the mesh cannot honour (``n`` > 1, ``prompt_logprobs``,
tools, ``guided_regex``...) is refused with a 400 naming it in
``param``, never silently dropped; its neutral values (``n: 1``,
``tools: []``...) are accepted, as SDKs send them.
Fields nobody here knows are ignored, as vLLM ignores them (SDKs add
vendor fields through ``extra_body``). ``prompt_cache_key``, then ``user``,
is the generation's session key unless ``X-Session-ID`` names one
(``_session``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import _session, _steering
from tokenmesh_gateway._errors import invalid
from tokenmesh_gateway._fields import (
    UINT32_MAX,
    UINT64_MAX,
    boolean,
    integer,
    is_neutral,
    number,
    short,
    string,
    type_name,
)

Kind = Literal["chat", "completion"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Chat roles accepted, and the mesh's role for each (OpenAI's "developer" is a system message)."""

# field -> values that ask for nothing the mesh cannot do
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "prompt_logprobs": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "echo": (None, False),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "guided_regex": (None,),
    "structured_outputs": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A checked request: what to ask the mesh, and how to answer."""

    kind: Kind
    request: inference_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with the usage and no choices."""
    continuous_usage: bool
    """stream_options.continuous_usage_stats (with include_usage): the usage so far on every chunk."""


def parse(body: dict[str, Any], kind: Kind, default_model: str = "") -> Parsed:
    """Check body (a decoded Chat Completions or Completions request) and build the mesh's request."""
    _refuse_unsupported(body)
    request = inference_pb2.GenerateRequest(model=string(body, "model") or default_model)
    _input(body, kind, request)
    _limits(body, request)
    _sampling(body, request)
    _steering.sampling(body, request)
    _logprobs(body, kind, request)
    _steering.response_format(body.get("response_format"), "response_format", request)
    _steering.guided(body, request)
    _session.from_body(body, request, "prompt_cache_key", "user")
    stream = boolean(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    return Parsed(kind, request, stream, include_usage, continuous)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """400 for a field that would change the answer in a way the mesh cannot honour."""
    for name, neutral in _NEUTRAL.items():
        if name in body and not is_neutral(body[name], neutral):
            raise invalid(f"{name} is not supported by tokenmesh (got {short(body[name])}); leave it out", name)


def _input(body: dict[str, Any], kind: Kind, request: inference_pb2.GenerateRequest) -> None:
    """The chat's messages or the completion's prompt (the other endpoint's field is refused)."""
    if kind == "chat":
        if "prompt" in body:
            raise invalid("prompt belongs to /v1/completions; send messages here", "prompt")
        _messages(body, request)
    else:
        if "messages" in body:
            raise invalid("messages belongs to /v1/chat/completions; send prompt here", "messages")
        request.prompt = _prompt(body)


def _limits(body: dict[str, Any], request: inference_pb2.GenerateRequest) -> None:
    """max_completion_tokens (or the older max_tokens), within its range."""
    max_tokens = integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens")
        limit_name = "max_tokens"
    else:
        limit_name = "max_completion_tokens"
    if max_tokens is not None:
        if not 1 <= max_tokens <= UINT32_MAX:
            raise invalid(
                f"{limit_name} must be at least 1 and at most the model's context, got {max_tokens}", limit_name
            )
        request.max_tokens = max_tokens


def _sampling(body: dict[str, Any], request: inference_pb2.GenerateRequest) -> None:
    """The sampling fields (temperature, top_p, seed), stop strings and ignore_eos; and the user label."""
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            setattr(request, name, value)
    seed = integer(body, "seed")
    if seed is not None:
        if not 0 <= seed <= UINT64_MAX:
            raise invalid(f"seed must be 0..{UINT64_MAX}, got {seed}", "seed")
        request.seed = seed
    request.stop.extend(_stop(body))
    request.ignore_eos = boolean(body, "ignore_eos")
    user = string(body, "user")
    if user:
        request.labels["user"] = user


def _logprobs(body: dict[str, Any], kind: Kind, request: inference_pb2.GenerateRequest) -> None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs``; completions' ``logprobs`` (a count of alternatives)."""
    if kind == "chat":
        request.logprobs = boolean(body, "logprobs")
        top = integer(body, "top_logprobs")
        if top is not None:
            if not 0 <= top <= UINT32_MAX:
                raise invalid(f"top_logprobs must be 0..20, got {top}", "top_logprobs")
            if top and not request.logprobs:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            request.top_logprobs = top
        return
    if "top_logprobs" in body and body["top_logprobs"] not in (None, 0):
        raise invalid("top_logprobs belongs to /v1/chat/completions; here logprobs is the count", "top_logprobs")
    count = integer(body, "logprobs")
    if count is not None:
        if not 0 <= count <= UINT32_MAX:
            raise invalid(f"logprobs must be 0..20 (alternatives per token), got {count}", "logprobs")
        request.logprobs, request.top_logprobs = True, count


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """include_usage and continuous_usage_stats (only with include_usage); stream_options needs stream: true."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise invalid(f"stream_options must be an object, got {type_name(options)}", "stream_options")
    if not stream:
        raise invalid("stream_options can only be set with stream: true", "stream_options")
    include_usage = boolean(options, "include_usage", "stream_options.")
    return include_usage, boolean(options, "continuous_usage_stats", "stream_options.") and include_usage


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """include_usage and continuous_usage_stats of a body's stream_options (for a POST that resumes)."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return False, False
    include = boolean(options, "include_usage", "stream_options.")
    return include, include and boolean(options, "continuous_usage_stats", "stream_options.")


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
            raise invalid(f"{where}.role is {short(role)}; use system, user or assistant", f"{where}.role")
        request.messages.add(role=ROLES[role], content=_content(message.get("content"), f"{where}.content"))


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of {type: "text", text} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type_name(part)
                raise invalid(
                    f'{where}[{j}] must be {{"type": "text", "text": "..."}}; tokenmesh takes '
                    f"text only (got {short(kind)})",
                    f"{where}[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where} must be a string or a list of text parts, got {type_name(content)}", where)


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise invalid(
                "prompt must be a string or a list of one string (one prompt per request; token ids "
                f"are not accepted), got a list of {len(prompt)}",
                "prompt",
            )
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid(f"prompt must be a string, got {type_name(prompt)}", "prompt")
    if not prompt:
        raise invalid("prompt is empty", "prompt")
    return prompt


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise invalid(f"stop must be a string, a list of strings or null, got {type_name(stop)}", "stop")
