"""A generation's session key (``labels["session"]``): the routers keep a conversation's turns on one worker by it.

First found wins: the ``X-Session-ID`` header; then the body's ``prompt_cache_key`` (OpenAI's field for it, on
chat completions, completions and Responses); then its ``user`` (Anthropic Messages: ``metadata.user_id``). A key
the mesh would refuse as a label (over ``MAX_LABEL_VALUE_CHARS``, or not printable) is a 400 naming where it came
from, before anything is sent.
"""

from __future__ import annotations

from typing import Any

from tokenmesh.v1 import inference_pb2
from tokenmesh.validation import MAX_LABEL_VALUE_CHARS
from tokenmesh_gateway._errors import invalid
from tokenmesh_gateway._fields import string
from tokenmesh_gateway._http import Scope, header

HEADER = b"x-session-id"
LABEL = "session"
"""The label the routers place by (``tokenmesh.router.affinity_of``)."""


def check(value: str, param: str) -> str:
    """value, or a 400 naming param when the mesh would refuse it as a label value."""
    if len(value) > MAX_LABEL_VALUE_CHARS or not value.isprintable():
        raise invalid(
            f"{param} is the session key: at most {MAX_LABEL_VALUE_CHARS} printable characters, got "
            f"{len(value)} characters",
            param,
        )
    return value


def from_body(body: dict[str, Any], request: inference_pb2.GenerateRequest, *names: str) -> None:
    """Set the session label from the first of the body's string fields names that is set."""
    for name in names:
        value = string(body, name)
        if value:
            request.labels[LABEL] = check(value, name)
            return


def from_header(scope: Scope, request: inference_pb2.GenerateRequest) -> None:
    """Set the session label from ``X-Session-ID`` when the caller sent one (it wins over the body's)."""
    value = header(scope, HEADER)
    if value:
        request.labels[LABEL] = check(value.decode("latin-1"), "X-Session-ID")
