"""The wire rules both ends of both multiplexed calls must agree on."""

from __future__ import annotations

import grpc

PROTOCOL = 1
"""The protocol both calls speak (their settings' ``protocol``)."""
CHUNK_OVERHEAD = 16
"""Credit a chunk costs beyond its text's bytes, so that empty chunks cost something too."""
UNLIMITED = 2**62
"""A stream's credit once the caller half-closed (it can return none any more)."""
SETTINGS_WAIT_S = 5.0
"""How long a new call waits for the server end's settings before it counts as broken."""
DEFAULT_MAX_BATCH_BYTES = 256 * 1024
"""The largest message: a big one delays every stream behind it on the one HTTP/2 stream by its transfer time."""
DEFAULT_WINDOW_BYTES = 4096
"""A stream's credit when a start names none and the settings name none either."""
BROKEN_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
)
"""Codes a call ends with when its peer or the connection went away mid-stream (a killed peer's call ends
UNAVAILABLE, a reset one CANCELLED or INTERNAL "RST_STREAM"): its streams are resumed elsewhere, not failed."""
MAX_STREAMS = 10_000
"""Streams open at once on one call, unless the server end announces fewer."""


def cost(text: str) -> int:
    """The credit a chunk of text costs."""
    return len(text.encode()) + CHUNK_OVERHEAD


def fits(cost: int, credit: int, window: int) -> bool:
    """Whether a chunk of cost may go with credit left of window.

    A chunk larger than the credit left goes while that is at least 3/4 of the window: the caller end keeps back
    less than a quarter of it unreturned, so once it has read everything sent the credit is there.
    """
    return cost <= credit or credit >= window - window // 4
