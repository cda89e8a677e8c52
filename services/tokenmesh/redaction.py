"""Redacting personal data and secrets from text that telemetry captures, also as it streams in chunks.

Content goes into telemetry only when capture is switched on
(``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``), and then only
through :class:`StreamRedactor`: e-mail addresses, phone numbers, payment card
numbers (Luhn-checked), IBANs (mod-97-checked), IPv4/IPv6 addresses and API
keys or secrets (known prefixes, and long high-entropy tokens) become typed
placeholders such as ``<EMAIL>``. A value split across two streamed chunks is
caught too: the redactor holds back exactly the tail that could still be the
start of a match (the ``regex`` package's partial matching says where that
starts) and releases it once the next chunk decides.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import regex

from tokenmesh.config import ConfigError, parse_bool

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def capture_enabled() -> bool:
    """Whether prompts and outputs may go into telemetry (redacted), per the opt-in variable.

    Unset or empty is off (OpenTelemetry's rule for an empty variable); any other value that is not a boolean
    word raises ConfigError naming the variable, so a typo cannot quietly leave capture off (or on).
    """
    value = os.environ.get(CAPTURE_ENV, "")
    if not value.strip():
        return False
    try:
        return parse_bool(value)
    except ValueError as exc:
        raise ConfigError(f"{CAPTURE_ENV}={value!r} is not valid: {exc}") from None


_PATTERN = regex.compile(
    r"""
    (?P<EMAIL>[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,})
    | (?P<SECRET>(?:sk-(?:proj-)?|sk_live_|rk_live_|ghp_|gho_|ghs_|github_pat_|xox[abprs]-|glpat-|AKIA|ASIA|AIza)
                 [A-Za-z0-9_\-]{12,})
    | (?P<IBAN>\b[A-Z]{2}[0-9]{2}(?:[ ]?[A-Z0-9]{4}){2,7}(?:[ ]?[A-Z0-9]{1,3})?\b)
    | (?P<CARD>\b[0-9](?:[ -]?[0-9]){12,18}\b)
    | (?P<IP>\b(?:(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\b
             | \b(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\b
             | \b(?:[0-9A-Fa-f]{1,4}:){1,7}:(?:[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){0,6})?\b)
    | (?P<PHONE>(?<![\w+(])(?:\+[0-9]{1,3}[ .-]?)?\(?[0-9]{2,4}\)?(?:[ .-]?[0-9]{2,4}){2,3}\b)
    | (?P<TOKEN>\b[A-Za-z0-9+/_\-]{32,}={0,2})
    """,
    regex.VERBOSE,
)


_STARTS = regex.compile(r"\b\w|[+(]")
"""Where a value may begin."""


def _luhn(digits: str) -> bool:
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d) * (2 if i % 2 else 1)
        total += n - 9 if n > 9 else n
    return total % 10 == 0


def _iban(text: str) -> bool:
    compact = text.replace(" ", "")
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _placeholder(match: regex.Match[str]) -> str | None:
    """The placeholder for a match, or None when its check says it is not that kind of value."""
    kind = match.lastgroup or ""
    value = match.group()
    if kind == "CARD":
        digits = "".join(c for c in value if c.isdigit())
        if not (13 <= len(digits) <= 19 and _luhn(digits)):
            return "<PHONE>" if 9 <= len(digits) <= 15 and any(c in value for c in " -") else None
    elif kind == "IBAN" and not _iban(value):
        return None
    elif kind == "PHONE" and sum(c.isdigit() for c in value) < 9:
        return None
    elif kind == "TOKEN":
        # Long words of one kind of character (a hash in hex is still a secret; "aaaa..." is not).
        classes = sum(any(f(c) for c in value) for f in (str.islower, str.isupper, str.isdigit))
        if _entropy(value) < 3.5 or classes < 2:
            return None
        kind = "SECRET"
    return f"<{kind}>"


def redact(text: str) -> str:
    """Text with every recognised value replaced by its placeholder."""
    redactor = StreamRedactor()
    return redactor.feed(text) + redactor.flush()


class StreamRedactor:
    """Redacts a text that arrives in chunks: what :meth:`feed` returns never holds a value, even a split one."""

    _held: str

    def __init__(self) -> None:
        self._held = ""

    def feed(self, chunk: str) -> str:
        """The redacted text that is decided now; the undecided tail waits for the next chunk."""
        return self._run(self._held + chunk, final=False)

    def flush(self) -> str:
        """The rest, at the end of the text."""
        return self._run(self._held, final=True)

    def _run(self, text: str, *, final: bool) -> str:
        cut = len(text) if final else self._undecided(text)
        out: list[str] = []
        pos = 0
        for match in _PATTERN.finditer(text):
            if match.end() > cut:  # it reaches into the undecided tail: it waits with it
                cut = min(cut, match.start())
                break
            replacement = _placeholder(match)
            if replacement is None:
                continue
            out.append(text[pos : match.start()])
            out.append(replacement)
            pos = match.end()
        out.append(text[pos:cut])
        self._held = text[cut:]
        return "".join(out)

    @staticmethod
    def _undecided(text: str) -> int:
        """Where the tail that may still be (the start of) one value begins (len(text): none).

        Values begin at a word start, a '+' or a '('; the first such place
        from which all the rest could be the beginning of a match is the cut.
        (A search for partial matches is no help: it prefers a complete match
        further on to a partial one that starts earlier.)
        """
        for start in _STARTS.finditer(text):
            if _PATTERN.fullmatch(text, pos=start.start(), partial=True):
                return start.start()
        return len(text)
