"""Log lines: plain text for people, or one JSON object per line (``--log-format json``) for collectors.

Each JSON line carries the generation it is about (``request_id``) and, with
tracing on, the ``trace_id`` and ``span_id`` of its span, so a log search and a
trace lead to each other. Services set them with :func:`about` when a call
begins; each call is a task with its own copy of the context variables, so a
call's lines, and only its lines, carry them.
"""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import UTC, datetime

from opentelemetry import trace

FORMATS = ("text", "json")

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("tokenmesh_request_id", default="")
SPAN_CONTEXT: contextvars.ContextVar[trace.SpanContext] = contextvars.ContextVar(
    "tokenmesh_span_context", default=trace.INVALID_SPAN_CONTEXT
)


def about(request_id: str, span: trace.Span = trace.INVALID_SPAN) -> None:
    """From here on, this task's log lines are about request_id (and span, when it records).

    Every gRPC call runs in a task of its own, which has its own copy of the
    context variables: nothing to reset, and no other call is affected. A
    span that does not record (tracing off: the no-op tracer's, which carries
    the caller's context) gives the lines no ids: they would name a span that
    no collector holds.
    """
    REQUEST_ID.set(request_id)
    SPAN_CONTEXT.set(span.get_span_context() if span.is_recording() else trace.INVALID_SPAN_CONTEXT)


class CallContext(logging.Filter):
    """Puts the call's request_id, trace_id and span_id on each record as it is logged (in the call's task)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the ids; never drops a record."""
        record.request_id = REQUEST_ID.get()
        context = SPAN_CONTEXT.get()
        record.trace_id = format(context.trace_id, "032x") if context.is_valid else ""
        record.span_id = format(context.span_id, "016x") if context.is_valid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, pid, message, and the call's ids when known."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line."""
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, "")
            if value:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """Set up the root logger for a tokenmesh process."""
    handler = logging.StreamHandler()
    handler.addFilter(CallContext())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
