"""The ids and positions a request names: ``X-Request-Id``, ``Last-Event-ID``, ``starting_after``, query flags.

Each check raises a 400 naming what is wrong (``_errors.invalid``).
"""

from __future__ import annotations

import re

from tokenmesh_gateway._errors import invalid
from tokenmesh_gateway._http import Scope, header

REQUEST_ID = re.compile(r"[A-Za-z0-9._~:-]{1,128}")
"""What an ``X-Request-Id`` may be: no '/', so it is one path segment (and tenants' ids stay apart)."""


def request_id_of(scope: Scope) -> str:
    """The request's ``X-Request-Id`` ('' without one); 400 for one that is not an id."""
    value = header(scope, b"x-request-id")
    if value is None:
        return ""
    request_id = value.decode("latin-1")
    check_id(request_id, "X-Request-Id")
    return request_id


def check_id(request_id: str, what: str) -> None:
    """400 naming what unless request_id is 1-128 characters of ``REQUEST_ID``."""
    if not REQUEST_ID.fullmatch(request_id):
        raise invalid(
            f"{what} must be 1-128 characters of A-Z a-z 0-9 . _ ~ : -, got {request_id[:140]!r}", "request_id"
        )


def last_event(value: str, request_id: str) -> tuple[str, int]:
    """(request id, seq) of a ``Last-Event-ID: <request_id>:<seq>``; it must match request_id when one is given."""
    event_id, colon, seq = value.strip().rpartition(":")
    if not colon:
        raise invalid(
            f"Last-Event-ID must be <request_id>:<seq>, as the events' id lines, got {value[:140]!r}", "Last-Event-ID"
        )
    check_id(event_id, "Last-Event-ID's request id")
    if request_id and event_id != request_id:
        raise invalid(f"Last-Event-ID names {event_id!r}, the request {request_id!r}", "Last-Event-ID")
    return event_id, seq_of(seq, "Last-Event-ID")


def seq_of(value: str, what: str) -> int:
    """A seq (a whole number >= 0) given as text; 400 naming what otherwise."""
    if not (value.isascii() and value.isdigit()) or len(value) > 19:
        raise invalid(f"{what}: the seq must be a whole number >= 0, got {value[:40]!r}", what)
    return int(value)


def flag(query: dict[str, list[str]], name: str) -> bool:
    """Whether the query's last value of name says yes (1, true, yes, on)."""
    values = query.get(name) or [""]
    return values[-1].lower() in ("1", "true", "yes", "on")
