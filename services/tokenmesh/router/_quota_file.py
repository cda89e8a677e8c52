"""The quota file (``--quota-file``): per tenant, tokens and requests per window and generations at once, in TOML.

::

    [tenants]
    search = { tokens_per_minute = 100000, requests_per_minute = 600, concurrent = 16 }
    batch = { tokens_per_minute = 20000 }
    "*" = { tokens_per_minute = 5000, concurrent = 4 }   # each tenant not listed, on its own budget

A tenant is a request's ``labels["tenant"]`` (the gateway's API key's tenant;
"" when none). A limit left out is not limited; a tenant not listed is not
limited unless ``"*"`` is there. "minute" is the window, ``--quota-window-s``
(60 unless a test shortens it). TOML because Python reads it without a
dependency (``tomllib``) and its errors name a line.

A file with a mistake is refused whole, with one line naming the file, the
line and what to change: at start that stops the router (exit 2); on a
reload the limits in force stay.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmesh.config import ConfigError

ANY_TENANT = "*"
"""The entry that applies to every tenant the file does not list (each on its own budget)."""


@dataclass(frozen=True)
class Limits:
    """One tenant's quota; None: not limited."""

    tokens: int | None = None
    """Tokens (prompt + completion) per window (``tokens_per_minute``)."""
    requests: int | None = None
    """Requests per window (``requests_per_minute``)."""
    concurrent: int | None = None
    """Generations running at once (``concurrent``)."""

    def share(self, parts: int) -> Limits:
        """The quota split evenly over parts routers (rounded down): what one router grants alone."""
        return Limits(*(None if value is None else value // parts for value in self.figures()))

    def figures(self) -> tuple[int | None, int | None, int | None]:
        """(tokens, requests, concurrent)."""
        return (self.tokens, self.requests, self.concurrent)


FIELDS = {"tokens_per_minute": "tokens", "requests_per_minute": "requests", "concurrent": "concurrent"}
"""The file's names of a tenant's limits, and the Limits field of each."""

_AT_LINE = re.compile(r"\(at line (\d+), column \d+\)")


def load_quotas(path: str) -> dict[str, Limits]:
    """The tenants' limits in the quota file; ConfigError (one line: file, line, what to change) when it is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"quota_file {path}: cannot read it ({exc})") from None
    return parse_quotas(text, path)


def parse_quotas(text: str, path: str = "quota file") -> dict[str, Limits]:
    """The tenants' limits in the text of a quota file (see :func:`load_quotas`)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        at = _AT_LINE.search(str(exc))
        where = f"{path}:{at.group(1)}" if at else path
        reason = _AT_LINE.sub("", str(exc)).strip()
        raise ConfigError(f"quota_file {where}: not valid TOML ({reason})") from None
    for key in document:
        if key != "tenants":
            raise ConfigError(f"quota_file {path}:{_line_of(text, key)}: unknown table {key!r}; only [tenants]")
    tenants = document.get("tenants", {})
    return {name: _limits(name, entry, text, path) for name, entry in tenants.items()}


def _limits(tenant: str, entry: Any, text: str, path: str) -> Limits:
    """One tenant's entry as Limits; ConfigError naming its line."""
    where = f"quota_file {path}:{_line_of(text, tenant)}: tenant {tenant!r}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table such as {{ tokens_per_minute = 1000 }}, got {entry!r}")
    values: dict[str, int] = {}
    for key, value in entry.items():
        if key not in FIELDS:
            raise ConfigError(f"{where}: unknown limit {key!r}; use {', '.join(FIELDS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: {key} must be a whole number >= 0, got {value!r}")
        values[FIELDS[key]] = value
    return Limits(**values)


def _line_of(text: str, key: str) -> str:
    """The line number where key is defined (``key =`` or ``[tenants.key]``), "?" when it cannot be told."""
    quoted = rf"(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')"
    pattern = re.compile(rf"^\s*(?:\[\s*(?:tenants\s*\.\s*)?{quoted}\s*\]|{quoted}\s*=)")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return str(number)
    return "?"
