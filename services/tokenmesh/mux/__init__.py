"""The one multiplexing layer under both multiplexed hops: ``Worker/Link`` and ``Inference/GenerateStream``.

Both calls carry many generations as logical streams on one bidi call, by
the same wire rules, written once here:

- The server end announces its settings first (protocol, a stream's default
  window, the largest message, the most streams).
- The caller end picks stream ids: > 0, increasing, never reused on a call;
  a start that reuses one ends that id with INVALID_ARGUMENT, and a start
  beyond ``max_streams`` ends at once with RESOURCE_EXHAUSTED. Per-stream
  refusals never end the call.
- Credit is per stream: a chunk costs its UTF-8 text bytes plus
  :data:`CHUNK_OVERHEAD`; an end costs nothing. The caller end returns what
  its consumer took once it owes a quarter of the window; a chunk larger
  than the credit left goes while at least 3/4 of the window is left
  (:func:`fits`), so a merged chunk cannot wait for ever.
- Each end sends everything pending when its writer runs as one message
  (the caller: commands in order and credit in columns; the server: every
  ready stream's chunks and ends), never over the peer's ``max_batch_bytes``.
- When the caller half-closes it can return no more credit: the server sends
  every stream on to its end without credit, then ends the call.

:mod:`._caller` is the caller end (the router's ``Worker/Link`` session and
the client's ``GenerateStream`` session build on it), :mod:`._server` the
server end (the worker's ``Link`` and the router's ``GenerateStream``). Each
service keeps only what is its own: what a frame carries for it, and what it
does with a delivered chunk.
"""

from tokenmesh.mux._caller import CallerSession, Inbox, Outbox, read_settings
from tokenmesh.mux._server import Batch, Served, ServerSession, Wake
from tokenmesh.mux._wire import (
    BROKEN_CODES,
    CHUNK_OVERHEAD,
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_WINDOW_BYTES,
    MAX_STREAMS,
    PROTOCOL,
    SETTINGS_WAIT_S,
    UNLIMITED,
    cost,
    fits,
)

__all__ = [
    "BROKEN_CODES",
    "CHUNK_OVERHEAD",
    "DEFAULT_MAX_BATCH_BYTES",
    "DEFAULT_WINDOW_BYTES",
    "MAX_STREAMS",
    "PROTOCOL",
    "SETTINGS_WAIT_S",
    "UNLIMITED",
    "Batch",
    "CallerSession",
    "Inbox",
    "Outbox",
    "Served",
    "ServerSession",
    "Wake",
    "cost",
    "fits",
    "read_settings",
]
