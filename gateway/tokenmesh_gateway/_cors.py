"""CORS for browser pages of other origins, opt-in by a list of origins (``--cors-origins``).

A page's request from a listed origin gets ``Access-Control-Allow-Origin`` naming that origin (never ``*``:
the list is the policy); one from any other origin gets no CORS header, so the browser keeps the answer from
the page. A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from a listed origin is answered
204 with the path's methods; from another origin 403. API keys travel in a header (``Authorization``,
``x-api-key``), not a cookie, so no ``Access-Control-Allow-Credentials`` is needed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenmesh_gateway._errors import HttpError

_ORIGIN = re.compile(r"(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")
"""What a browser sends as ``Origin``: scheme, host and port, nothing after."""
_HEADER_LIST = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
"""A comma-separated list of header names (HTTP tokens): what ``Access-Control-Request-Headers`` may be."""

EXPOSED = b"x-request-id, retry-after, retry-after-ms"
"""Response headers a page's script may read besides the CORS-safelisted ones."""
MAX_AGE_S = b"600"
"""How long a browser may reuse a preflight's answer (Chromium caps it at 7200)."""


def origin_error(origin: str) -> str:
    """Why origin is not ``scheme://host[:port]`` as browsers send it ('' when it is)."""
    if not _ORIGIN.fullmatch(origin):
        return "must be scheme://host[:port] (http or https, no path, no trailing '/'), as browsers send Origin"
    return ""


class Cors:
    """The CORS policy of one gateway: which origins' pages may call it.

    Args:
        origins: ``scheme://host[:port]`` of each page origin to allow (compared as browsers send them, in
            lower case).

    """

    origins: frozenset[bytes]

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origin.lower().encode() for origin in origins)

    def headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """The CORS headers of any answer to a request with this ``Origin`` (none without one)."""
        if origin is None:
            return []
        vary = (b"vary", b"origin")  # the answer differs by origin: caches must not hand one origin's to another
        if origin not in self.origins:
            return [vary]
        return [(b"access-control-allow-origin", origin), (b"access-control-expose-headers", EXPOSED), vary]

    def preflight(self, origin: bytes | None, allow: str, requested_headers: bytes | None) -> list[tuple[bytes, bytes]]:
        """The headers of a 204 to a preflight on a path that takes allow; 403 unless the origin is listed.

        The requested headers are allowed as asked (SDKs send headers of their own, such as ``x-stainless-*``),
        once they are a list of header names.
        """
        if origin is None or origin not in self.origins:
            shown = origin.decode("latin-1")[:200] if origin is not None else "none"
            raise HttpError(
                403,
                f"the origin {shown!r} may not call this gateway from a browser; its --cors-origins lists the "
                "origins that may",
                code="cors_origin_not_allowed",
            )
        headers = [(b"access-control-allow-methods", allow.encode()), (b"access-control-max-age", MAX_AGE_S)]
        if requested_headers is not None and requested_headers.strip():
            if not _HEADER_LIST.fullmatch(requested_headers.strip()):
                raise HttpError(
                    400, "Access-Control-Request-Headers must be a comma-separated list of header names", code="invalid"
                )
            headers.append((b"access-control-allow-headers", requested_headers.strip()))
        return headers
