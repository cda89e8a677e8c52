"""The one request front: what every generation route does the same way, whichever API's dialect it speaks.

OpenAI chat and completions, Anthropic Messages and OpenAI Responses differ
only in how a body becomes a ``GenerateRequest`` and how the chunks are
written back (a :class:`Dialect` and its ``Answer``). Everything else is
here, once: the caller's tenant (401 without a valid key), the 503 while
draining, the body under ``--max-body-bytes``, the caller's
``X-Request-Id`` kept apart per tenant (the mesh sees ``<tenant>/<id>``, so
one tenant can neither resume nor cancel another's generations), the span
that is the router's parent, the timeout, and answering through
:class:`~tokenmesh_gateway._stream.Exchanges`, from the start or after a
``Last-Event-ID``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace

from tokenmesh.client import Client
from tokenmesh.tracing import from_mapping, inject, operation
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import _session
from tokenmesh_gateway._auth import tenant_of
from tokenmesh_gateway._config import GatewayConfig
from tokenmesh_gateway._errors import DEFAULT_RETRY_AFTER_MS, HttpError, invalid
from tokenmesh_gateway._fields import decode_body
from tokenmesh_gateway._http import Receive, Scope, Send, header, read_body
from tokenmesh_gateway._ids import last_event, request_id_of
from tokenmesh_gateway._openai import Kind
from tokenmesh_gateway._stream import Answer, Exchanges


class Front:
    """The gateway's request front: tenants, draining, spans and the mesh's client, for every dialect.

    Args:
        client: the mesh's client (several routers; retries and resumes).
        config: the gateway's settings.
        keys: sha256 hex of each accepted API key -> its tenant; None accepts any caller.

    """

    client: Client
    config: GatewayConfig
    keys: dict[str, str] | None
    exchanges: Exchanges
    """Every answer being written (the drain waits for them)."""
    draining: bool
    """New generations get 503 and /health says draining."""
    tracer: trace.Tracer
    """A span per generation (OpenTelemetry's no-op tracer while tracing is off)."""

    def __init__(self, client: Client, config: GatewayConfig, keys: dict[str, str] | None) -> None:
        self.client = client
        self.config = config
        self.keys = keys
        self.exchanges = Exchanges(config.keepalive_s)
        self.draining = False
        self.tracer = trace.NoOpTracer()

    def tenant(self, scope: Scope) -> str:
        """The caller's tenant ('' without keys); 401 without a valid key."""
        if self.keys is None:
            return ""
        return tenant_of(self.keys, header(scope, b"authorization"), header(scope, b"x-api-key"))

    def refuse_if_draining(self) -> None:
        """503 once the gateway drains: a new generation belongs on another gateway."""
        if self.draining:
            raise HttpError(
                503,
                "this gateway is shutting down; send the request to another one",
                code="unavailable",
                retry_after_ms=DEFAULT_RETRY_AFTER_MS,
            )

    def timeout(self) -> float | None:
        """A generation's deadline in seconds (None: no deadline)."""
        return self.config.timeout_s or None

    def caller(self, scope: Scope, receive: Receive) -> Incoming:
        """The caller of a request without a body to read (its tenant checked; 401 without a valid key)."""
        tenant = self.tenant(scope)
        return Incoming(self, scope, receive, tenant, f"{tenant}/" if tenant else "", {})

    async def open(self, scope: Scope, receive: Receive) -> Incoming:
        """The caller of a new generation: its tenant checked, refused while draining, its body read."""
        tenant = self.tenant(scope)
        self.refuse_if_draining()
        body = decode_body(await read_body(scope, receive, self.config.max_body_bytes))
        return Incoming(self, scope, receive, tenant, f"{tenant}/" if tenant else "", body)

    def span(self, scope: Scope, kind: Kind, model: str) -> tuple[trace.Span, tuple[tuple[str, str], ...]]:
        """The request's span and the metadata that makes it the router's parent.

        The span is the child of the caller's W3C traceparent; with tracing off it is the no-op tracer's, which
        carries the caller's trace context on to the router.
        """
        carrier = {
            name: value.decode("latin-1")
            for name in ("traceparent", "tracestate")
            if (value := header(scope, name.encode())) is not None
        }
        name = operation(kind == "chat")
        span = self.tracer.start_span(
            f"{name} {model}",
            context=from_mapping(carrier),
            kind=trace.SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": name,
                "gen_ai.request.model": model,
                "http.request.method": scope.get("method", ""),
                "url.path": scope.get("path", ""),
            },
        )
        return span, tuple(inject(span).items())


@dataclass(frozen=True, slots=True)
class Incoming:
    """One request at the front: who sent it, its body, and the mesh's ids in its tenant's space."""

    front: Front
    scope: Scope
    receive: Receive
    tenant: str
    """The caller's tenant ('' without keys)."""
    prefix: str
    """What the mesh's request ids carry in front of the caller's (``<tenant>/``); the caller never sees it."""
    body: dict[str, Any]
    """The decoded JSON body ({} for a request that has none)."""

    def mesh_id(self, request_id: str) -> str:
        """The mesh's id of the caller's request_id (in its tenant's space)."""
        return self.prefix + request_id

    def identify(self, request: inference_pb2.GenerateRequest, request_id: str | None = None) -> None:
        """Set the request's session (``X-Session-ID``), its id in the tenant's space and its tenant label.

        request_id None: the caller's ``X-Request-Id``, read here, after ``X-Session-ID`` (a Responses create with
        both bad is refused naming the session header); '' leaves the id to the client.
        """
        _session.from_header(self.scope, request)
        if request_id is None:
            request_id = request_id_of(self.scope)
        if request_id:
            request.request_id = self.mesh_id(request_id)
        if self.tenant:
            request.labels["tenant"] = self.tenant

    def resume_point(self, request_id: str) -> tuple[str, int] | None:
        """(request id, seq) of a POST that resumes a stream after its ``Last-Event-ID``; None for a new one.

        A ``Last-Event-ID`` must name the request's ``X-Request-Id`` when it has one.
        """
        value = header(self.scope, b"last-event-id")
        if value is None:
            return None
        point = last_event(value.decode("latin-1"), request_id)
        if self.body.get("stream") is not True:
            raise invalid("Last-Event-ID resumes a stream: send stream: true", "stream")
        return point

    def model(self) -> str:
        """The body's model ('' when it names none): what a resumed stream's chunks are said to come from."""
        model = self.body.get("model")
        return model if isinstance(model, str) else ""

    async def generate(self, kind: Kind, request: inference_pb2.GenerateRequest, answer: Answer, send: Send) -> None:
        """Run the generation on the mesh and write its chunks as answer says."""
        span, metadata = self.front.span(self.scope, kind, request.model or "default")
        front = self.front
        try:
            await front.exchanges.answer(
                lambda: front.client.generate(request, timeout=front.timeout(), metadata=metadata),
                answer,
                self.receive,
                send,
            )
        finally:
            span.end()

    async def replay(self, kind: Kind, request_id: str, after: int, answer: Answer, send: Send) -> None:
        """Every chunk of the caller's request_id after seq ``after``, then live, written as answer says."""
        front = self.front
        span, metadata = front.span(self.scope, kind, self.model() or front.config.default_model or "default")
        try:
            await front.exchanges.answer(
                lambda: front.client.resume(
                    self.mesh_id(request_id), after, timeout=front.timeout(), metadata=metadata
                ),
                answer,
                self.receive,
                send,
            )
        finally:
            span.end()


class Dialect(Protocol):
    """How one API's POST becomes a generation and how its answer is written (the rest is the front's)."""

    @property
    def kind(self) -> Kind:
        """The generation's kind (a chat, or a completion of a prompt)."""
        ...

    def start(self, incoming: Incoming, request_id: str) -> tuple[inference_pb2.GenerateRequest, Answer]:
        """The request (identified as request_id at the front) and its answer, from the body (400 naming a field)."""
        ...

    def resumed(self, incoming: Incoming, after: int) -> Answer:
        """The answer of a stream resumed after seq ``after`` (its opening events were sent before)."""
        ...


async def post(front: Front, dialect: Dialect, scope: Scope, receive: Receive, send: Send) -> None:
    """A generation's POST in any dialect: a new generation, or (with ``Last-Event-ID``) the rest of one."""
    incoming = await front.open(scope, receive)
    request_id = request_id_of(scope)
    point = incoming.resume_point(request_id)
    if point is not None:
        resumed_id, after = point
        await incoming.replay(dialect.kind, resumed_id, after, dialect.resumed(incoming, after), send)
        return
    request, answer = dialect.start(incoming, request_id)
    await incoming.generate(dialect.kind, request, answer, send)
