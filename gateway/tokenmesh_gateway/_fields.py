"""The JSON checks every request parser shares: the body is an object, each field of its type, errors naming it.

Each check raises a 400 (:func:`~tokenmesh_gateway._errors.invalid`) whose
message and ``param`` name the field, with a short echo of what was sent.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenmesh_gateway._errors import invalid

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object in body; 400 for bytes that are not UTF-8, not JSON or not an object."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not UTF-8 (byte {exc.start}): send JSON encoded as UTF-8") from None
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid(f"the request body must be a JSON object, got {type_name(value)}")
    return value


def string(body: dict[str, Any], name: str) -> str:
    """The string field name ("" when absent or null)."""
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string, got {type_name(value)}", name)
    return value


def integer(body: dict[str, Any], name: str) -> int | None:
    """The integer field name (a bool is no integer), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {short(value)}", name)
    return value


def number(body: dict[str, Any], name: str) -> float | None:
    """The number field name as a float (a bool is no number), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{name} must be a number, got {short(value)}", name)
    return float(value)


def boolean(body: dict[str, Any], name: str, prefix: str = "") -> bool:
    """The boolean field name (false when absent or null); prefix is its parent's path, for the error."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{prefix}{name} must be true or false, got {short(value)}", f"{prefix}{name}")
    return value


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether value is one of the neutral values: numbers compare as numbers, but a bool is never a number."""
    if value is None:
        return True
    for candidate in neutral:
        if isinstance(candidate, bool) or isinstance(value, bool):
            if value is candidate:
                return True
        elif isinstance(candidate, int | float) and isinstance(value, int | float):
            if value == candidate:
                return True
        elif type(value) is type(candidate) and value == candidate:
            return True
    return False


def type_name(value: Any) -> str:
    """What a JSON value is, in words ("an object", "a list"...), for error messages."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def short(value: Any) -> str:
    """A value as JSON, cut to 60 characters, for error messages."""
    text = orjson.dumps(value).decode() if value is not None else "null"
    return text if len(text) <= 60 else text[:57] + "..."
