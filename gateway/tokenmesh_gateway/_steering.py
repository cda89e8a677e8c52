"""What callers steer an engine with, read once for every HTTP dialect: sampling extensions and the output's format.

Each dialect names where its fields are (OpenAI's ``response_format``,
Responses' ``text.format``, vLLM's ``guided_*``); the shapes are read here
into the one ``GenerateRequest`` contract. Shapes are checked here (a 400
naming the field), and a JSON Schema with the router's own check, so its 400
names the caller's field; ranges are the router's, whose INVALID_ARGUMENT
comes back as a 400 naming the proto field.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenmesh import validation
from tokenmesh.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._errors import invalid
from tokenmesh_gateway._fields import UINT32_MAX, integer, number, short, type_name

PENALTIES = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
"""Number fields taken by the same name as vLLM's OpenAI server takes them."""


def sampling(body: dict[str, Any], request: inference_pb2.GenerateRequest, *, penalties: bool = True) -> None:
    """top_k (vLLM's -1 or 0: every token), min_p, the penalties and logit_bias, where the body sets them."""
    top_k = integer(body, "top_k")
    if top_k is not None and top_k not in (-1, 0):
        if not 1 <= top_k <= UINT32_MAX:
            raise invalid(f"top_k must be >= 1 (or -1 / 0: every token), got {top_k}", "top_k")
        request.top_k = top_k
    if not penalties:
        return
    for name in PENALTIES:
        value = number(body, name)
        if value is not None:
            setattr(request, name, value)
    _logit_bias(body, request)


def _logit_bias(body: dict[str, Any], request: inference_pb2.GenerateRequest) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise invalid(f"logit_bias must be an object of token id -> bias, got {type_name(bias)}", "logit_bias")
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit()) or int(token) > UINT32_MAX:
            raise invalid(f"logit_bias keys are token ids (whole numbers >= 0), got {token[:40]!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f"logit_bias[{token}] must be a number, got {type_name(value)}", f"logit_bias[{token}]")
        request.logit_bias[int(token)] = float(value)


def response_format(value: Any, param: str, request: inference_pb2.GenerateRequest) -> None:
    """OpenAI's ``response_format`` (nested ``json_schema``) or Responses' ``text.format`` (flat) into the request.

    ``{"type": "text"}`` asks for nothing; ``json_object`` for any JSON object; ``json_schema`` for output that
    validates against ``schema`` (OpenAI's ``strict`` is what the engine does anyway: it samples only valid text).
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid(f"{param} must be an object with a type, got {type_name(value)}", param)
    kind = value.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        request.structured_output.json_object.SetInParent()
        return
    if kind != "json_schema":
        raise invalid(f"{param}.type must be text, json_object or json_schema, got {short(kind)}", f"{param}.type")
    nested = value.get("json_schema")
    where, holder = (f"{param}.json_schema", nested) if isinstance(nested, dict) else (param, value)
    schema = holder.get("schema")
    if not isinstance(schema, dict):
        raise invalid(f"{where}.schema must be the JSON Schema (an object), got {type_name(schema)}", f"{where}.schema")
    request.structured_output.json_schema = _checked(schema, f"{where}.schema")


def _checked(schema: dict[str, Any], param: str) -> str:
    """The schema as JSON text, checked as the router checks it, so the 400 names the caller's own field."""
    text = orjson.dumps(schema).decode()
    try:
        validation.json_schema(text)
    except InvalidArgument as error:
        raise invalid(error.message.replace("structured_output.json_schema", param), param) from None
    return text


def guided(body: dict[str, Any], request: inference_pb2.GenerateRequest) -> None:
    """Read the guided_json, guided_choice and guided_grammar of vLLM (one format per request)."""
    given = [name for name in ("guided_json", "guided_choice", "guided_grammar") if body.get(name) is not None]
    if request.HasField("structured_output"):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise invalid(f"set one output format, not {' and '.join(given)}", given[1])
    if not given or given[0] == "response_format":
        return
    name = given[0]
    value = body[name]
    if name == "guided_json":
        schema = value
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                schema = orjson.loads(value)
            except orjson.JSONDecodeError as exc:  # the caller's text: a 400 naming it, never a 500
                raise invalid(f"guided_json is not valid JSON: {exc}", name) from None
        if not isinstance(schema, dict):
            raise invalid(f"guided_json must be a JSON Schema (an object or its JSON), got {type_name(value)}", name)
        request.structured_output.json_schema = _checked(schema, name)
    elif name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(option, str) for option in value):
            raise invalid(f"guided_choice must be a list of strings, got {short(value)}", name)
        request.structured_output.choice.options.extend(value)
    else:
        if not isinstance(value, str):
            raise invalid(f"guided_grammar must be a GBNF grammar (a string), got {type_name(value)}", name)
        request.structured_output.grammar = value
