"""The gateway's routes, as one raw ASGI application over :class:`tokenmesh.client.Client`.

:data:`ROUTES` is the one list of what the gateway serves: each route's method,
path template, what it does and its endpoint. It drives dispatch (once per
request; a stream's chunks never pass through it), the 404 for a path no route
has, the 405 with ``Allow`` for a method a path does not take (with ``--cors-origins``, a
browser's ``OPTIONS`` preflight gets the same methods in a 204 instead), the route label
of the requests counter (the template, never the caller's path) and the docs
(:func:`routes_markdown`).

With API keys, a caller's ``X-Request-Id`` is kept apart per tenant (the
mesh sees ``<tenant>/<id>``), so one tenant can neither resume nor cancel
another's generations.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter

from tokenmesh.client import Client
from tokenmesh.errors import MeshError
from tokenmesh.tracing import from_mapping, inject, operation
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import _anthropic, _session
from tokenmesh_gateway._anthropic_sse import ANTHROPIC_ERRORS, MessagesAnswer
from tokenmesh_gateway._auth import tenant_of
from tokenmesh_gateway._config import GatewayConfig
from tokenmesh_gateway._cors import Cors
from tokenmesh_gateway._errors import DEFAULT_RETRY_AFTER_MS, OPENAI_ERRORS, ErrorShape, HttpError, from_mesh, invalid
from tokenmesh_gateway._fields import decode_body
from tokenmesh_gateway._http import Receive, Scope, Send, header, read_body, respond, respond_error
from tokenmesh_gateway._ids import check_id as _check_id
from tokenmesh_gateway._ids import flag as _flag
from tokenmesh_gateway._ids import last_event as _last_event
from tokenmesh_gateway._ids import request_id_of as _request_id
from tokenmesh_gateway._ids import seq_of as _seq
from tokenmesh_gateway._openai import Kind, parse, stream_flags
from tokenmesh_gateway._responses_api import ResponsesApi
from tokenmesh_gateway._sse import OpenAIAnswer, response_id
from tokenmesh_gateway._stream import Answer, Exchanges

_PREFLIGHT = b"access-control-request-method"
"""The header that makes an ``OPTIONS`` a CORS preflight."""

_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}


class GatewayApp:
    """The ASGI application (``http`` scopes only; run without lifespan).

    Args:
        client: the mesh's client (several routers; retries and resumes).
        config: the gateway's settings.
        keys: sha256 hex of each accepted API key -> its tenant; None accepts any caller.

    """

    client: Client
    config: GatewayConfig
    keys: dict[str, str] | None
    exchanges: Exchanges
    responses: ResponsesApi
    """The /v1/responses routes and the background responses this gateway follows."""
    draining: bool
    """New generations get 503 and /health says draining."""
    cors: Cors | None
    """Which browser pages of other origins may call (None: no CORS, ``--cors-origins`` empty)."""
    created: int
    """Unix time the gateway started (the models' ``created``)."""

    def __init__(self, client: Client, config: GatewayConfig, keys: dict[str, str] | None = None) -> None:
        self.client = client
        self.config = config
        self.keys = keys
        self.exchanges = Exchanges(config.keepalive_s)
        self.responses = ResponsesApi(self)
        self.draining = False
        self.cors = Cors(config.cors_origins) if config.cors_origins else None
        self.created = int(time.time())
        self.tracer: trace.Tracer = trace.NoOpTracer()
        """A span per generation (OpenTelemetry's no-op tracer while tracing is off)."""
        self.registry = CollectorRegistry()
        """The gateway's Prometheus metrics, served on ``--metrics-port`` (never on the public port)."""
        self.requests = Counter(
            "tokenmesh_gateway_http_requests_total",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one request (and count it by route and status)."""
        if scope["type"] != "http":
            return  # no websockets; the lifespan protocol is off
        counted = _Counted(send, self.cors.headers(header(scope, b"origin")) if self.cors is not None else [])
        label = "other"
        shape: ErrorShape = OPENAI_ERRORS
        try:
            path: str = scope["path"]
            found = TABLE.find(path)
            if found is None:
                raise HttpError(404, f"no route {path}; this gateway serves {TABLE.listing}", code="not_found")
            at, params = found
            label, shape = at.template, at.errors
            route = at.methods.get(scope["method"])
            if route is not None:
                await route.endpoint(self, scope, receive, counted, params)
            elif self.cors is not None and scope["method"] == "OPTIONS" and header(scope, _PREFLIGHT) is not None:
                await self._preflight(self.cors, scope, at.allow, counted)
            else:
                raise _MethodNotAllowed(scope["method"], at.allow)
        except HttpError as error:
            await respond_error(counted, error, shape)
        except ConnectionResetError:
            return  # the caller left before its request was read
        finally:
            self.requests.labels(label, str(counted.status or "none")).inc()

    # -- generations ------------------------------------------------------------

    async def _generate(self, kind: Kind, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = self._tenant(scope)
        self._refuse_if_draining()
        body = decode_body(await read_body(scope, receive, self.config.max_body_bytes))
        request_id = _request_id(scope)
        last_event = header(scope, b"last-event-id")
        if last_event is not None:
            after_id, after = _last_event(last_event.decode("latin-1"), request_id)
            if body.get("stream") is not True:
                raise invalid("Last-Event-ID resumes a stream: send stream: true", "stream")
            include, continuous = stream_flags(body)
            model = body.get("model")
            model = model if isinstance(model, str) else ""
            await self._resume(kind, after_id, after, tenant, include, continuous, receive, send, model, scope)
            return
        parsed = parse(body, kind, self.config.default_model)
        request = parsed.request
        _session.from_header(scope, request)
        prefix = self._identify(request, request_id, tenant)
        answer = OpenAIAnswer(
            kind, parsed.stream, parsed.include_usage, parsed.continuous_usage, request.model, int(time.time()), prefix
        )
        await self._answer(kind, request, answer, scope, receive, send)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An Anthropic Messages request: the same generation, answered in Anthropic's format."""
        tenant = self._tenant(scope)
        self._refuse_if_draining()
        body = decode_body(await read_body(scope, receive, self.config.max_body_bytes))
        request_id = _request_id(scope)
        last_event = header(scope, b"last-event-id")
        if last_event is not None:
            await self._resume_messages(body, last_event, request_id, tenant, scope, receive, send)
            return
        parsed = _anthropic.parse(body, self.config.default_model)
        request = parsed.request
        _session.from_header(scope, request)
        prefix = self._identify(request, request_id, tenant)
        await self._answer("chat", request, MessagesAnswer(parsed.stream, request.model, prefix), scope, receive, send)

    async def _resume_messages(  # wide: one request's resume coordinates (the request front carries them next)
        self,
        body: dict[str, Any],
        last_event: bytes,
        request_id: str,
        tenant: str,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """A repeated Messages POST with ``Last-Event-ID``: the rest of that stream, without its opening events."""
        after_id, after = _last_event(last_event.decode("latin-1"), request_id)
        if body.get("stream") is not True:
            raise invalid("Last-Event-ID resumes a stream: send stream: true", "stream")
        model = body.get("model")
        model = model if isinstance(model, str) else ""
        prefix = f"{tenant}/" if tenant else ""
        answer = MessagesAnswer(True, model or self.config.default_model, prefix, after=after)
        await self._replay("chat", after_id, after, answer, receive, send, model, scope)

    @staticmethod
    def _identify(request: inference_pb2.GenerateRequest, request_id: str, tenant: str) -> str:
        """Set the request's id (the caller's, in its tenant's space) and tenant label; the ids' prefix."""
        prefix = f"{tenant}/" if tenant else ""
        if request_id:
            request.request_id = prefix + request_id
        if tenant:
            request.labels["tenant"] = tenant
        return prefix

    async def _answer(
        self,
        kind: Kind,
        request: inference_pb2.GenerateRequest,
        answer: Answer,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        span, metadata = self._span(scope, kind, request.model or "default")
        try:
            await self.exchanges.answer(
                lambda: self.client.generate(request, timeout=self._timeout(), metadata=metadata), answer, receive, send
            )
        finally:
            span.end()

    async def _resume_get(self, kind: Kind, request_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = self._tenant(scope)
        self._refuse_if_draining()
        _check_id(request_id, "the path's request id")
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        after = 0
        last_event = header(scope, b"last-event-id")
        if last_event is not None:
            _, after = _last_event(last_event.decode("latin-1"), request_id)  # its id must be the path's
        elif "starting_after" in query:
            after = _seq(query["starting_after"][-1], "starting_after")
        include = _flag(query, "include_usage")
        continuous = include and _flag(query, "continuous_usage_stats")
        await self._resume(kind, request_id, after, tenant, include, continuous, receive, send, scope=scope)

    async def _resume(  # wide: one request's resume coordinates (the request front carries them next)
        self,
        kind: Kind,
        request_id: str,
        after: int,
        tenant: str,
        include_usage: bool,
        continuous_usage: bool,
        receive: Receive,
        send: Send,
        model: str = "",
        scope: Scope | None = None,
    ) -> None:
        # A resumed stream's chunks may name no model: the caller's (a repeated POST), else the default.
        prefix = f"{tenant}/" if tenant else ""
        answer = OpenAIAnswer(
            kind, True, include_usage, continuous_usage, model or self.config.default_model, int(time.time()), prefix
        )
        await self._replay(kind, request_id, after, answer, receive, send, model, scope)

    async def _replay(  # wide: one request's resume coordinates (the request front carries them next)
        self,
        kind: Kind,
        request_id: str,
        after: int,
        answer: Answer,
        receive: Receive,
        send: Send,
        model: str,
        scope: Scope | None,
    ) -> None:
        """Every chunk of request_id (in the answer's tenant's space) after seq ``after``, then live, as answer says."""
        span, metadata = (
            self._span(scope, kind, model or self.config.default_model or "default")
            if scope is not None
            else (trace.INVALID_SPAN, ())
        )
        try:
            await self.exchanges.answer(
                lambda: self.client.resume(
                    answer.id_prefix + request_id, after, timeout=self._timeout(), metadata=metadata
                ),
                answer,
                receive,
                send,
            )
        finally:
            span.end()

    def _span(self, scope: Scope, kind: Kind, model: str) -> tuple[trace.Span, tuple[tuple[str, str], ...]]:
        """The request's span and the metadata that makes it the router's parent.

        The span is the child of the caller's W3C traceparent; with tracing off
        it is the no-op tracer's, which carries the caller's trace context on
        to the router.
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

    async def _cancel(self, kind: Kind, request_id: str, scope: Scope, send: Send) -> None:
        tenant = self._tenant(scope)
        _check_id(request_id, "the path's request id")
        try:
            response = await self.client.cancel((f"{tenant}/" if tenant else "") + request_id)
        except MeshError as error:
            raise from_mesh(error) from error
        await respond(
            send,
            200,
            orjson.dumps(
                {
                    "id": response_id(kind, request_id),
                    "object": f"{_OBJECT[kind]}.deleted",
                    "deleted": response.cancelled,
                }
            ),
        )

    # -- the rest -----------------------------------------------------------------

    async def _models(self, scope: Scope, send: Send, name: str | None) -> None:
        self._tenant(scope)
        try:
            listed = await self.client.list_models()
        except MeshError as error:
            raise from_mesh(error) from error
        models = [_model(m, self.created) for m in listed.models]
        if name is None:
            await respond(send, 200, orjson.dumps({"object": "list", "data": models}))
            return
        for model in models:
            if model["id"] == name:
                await respond(send, 200, orjson.dumps(model))
                return
        raise HttpError(
            404,
            f"the model {name!r} does not exist; GET /v1/models lists the models",
            param="model",
            code="model_not_found",
        )

    async def _health(self, send: Send) -> None:
        if self.draining:
            await respond(send, 503, b'{"status":"draining"}')
        else:
            await respond(send, 200, b'{"status":"ok"}')

    @staticmethod
    async def _preflight(cors: Cors, scope: Scope, allow: str, send: Send) -> None:
        """A browser asks whether its page may call: 204 with the path's methods (403 for an unlisted origin)."""
        headers = cors.preflight(header(scope, b"origin"), allow, header(scope, b"access-control-request-headers"))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _tenant(self, scope: Scope) -> str:
        """The caller's tenant ('' without keys); 401 without a valid key."""
        if self.keys is None:
            return ""
        return tenant_of(self.keys, header(scope, b"authorization"), header(scope, b"x-api-key"))

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise HttpError(
                503,
                "this gateway is shutting down; send the request to another one",
                code="unavailable",
                retry_after_ms=DEFAULT_RETRY_AFTER_MS,
            )

    def _timeout(self) -> float | None:
        return self.config.timeout_s or None


class _Counted:
    """The ASGI send of one request that keeps the status it answered (for the requests counter).

    A plain call that hands back uvicorn's own awaitable: a wrapper coroutine
    would cost a frame per event of every stream. The answer's start also gets
    the request's CORS headers (once per answer, never per event).
    """

    __slots__ = ("extra", "send", "status")

    def __init__(self, send: Send, extra: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.status = 0
        self.extra = extra

    def __call__(self, message: MutableMapping[str, Any]) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.extra:
                message["headers"] = [*message["headers"], *self.extra]
        return self.send(message)


class _MethodNotAllowed(HttpError):
    """405, with the methods the path takes."""

    def __init__(self, method: str, allowed: str) -> None:
        super().__init__(405, f"{method} is not allowed here; use {allowed}", code="method_not_allowed")
        self.allowed = allowed

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The Allow header (the path's methods, comma-separated)."""
        return [(b"allow", self.allowed.encode())]


def _model(model: inference_pb2.ModelInfo, created: int) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "tokenmesh",
        "max_model_len": model.max_context,
    }
    if model.base:
        card["parent"] = model.base  # a LoRA adapter names its base model, as vLLM's /v1/models does
    return card


# -- the route table ------------------------------------------------------------------

Endpoint = Callable[[GatewayApp, Scope, Receive, Send, dict[str, str]], Awaitable[None]]
"""An endpoint: the app, the ASGI triple and the path's parameters (``{id}`` -> its unquoted value)."""


@dataclass(frozen=True, slots=True)
class Route:
    """One route: a method on a path template (``{name}`` is one path segment), what it does, its endpoint."""

    method: str
    path: str
    """The template; also the route's label in ``tokenmesh_gateway_http_requests_total``."""
    what: str
    """One line for the docs (Markdown)."""
    endpoint: Endpoint = field(repr=False, compare=False)
    errors: ErrorShape = field(default=OPENAI_ERRORS, repr=False, compare=False)
    """How its errors are written (OpenAI's, or Anthropic's on /v1/messages)."""


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/chat/completions",
        "a chat generation, streamed (SSE) or whole; with `Last-Event-ID`: resume a stream after that event",
        lambda app, scope, receive, send, _: app._generate("chat", scope, receive, send),
    ),
    Route(
        "POST",
        "/v1/completions",
        "a completion, streamed (SSE) or whole; with `Last-Event-ID`: resume a stream after that event",
        lambda app, scope, receive, send, _: app._generate("completion", scope, receive, send),
    ),
    Route(
        "GET",
        "/v1/chat/completions/{id}/stream",
        "resume a stream after `Last-Event-ID` (or `?starting_after=SEQ`; from the start without)",
        lambda app, scope, receive, send, p: app._resume_get("chat", p["id"], scope, receive, send),
    ),
    Route(
        "GET",
        "/v1/completions/{id}/stream",
        "resume a stream after `Last-Event-ID` (or `?starting_after=SEQ`; from the start without)",
        lambda app, scope, receive, send, p: app._resume_get("completion", p["id"], scope, receive, send),
    ),
    Route(
        "DELETE",
        "/v1/chat/completions/{id}",
        "cancel the generation, wherever it runs",
        lambda app, scope, _, send, p: app._cancel("chat", p["id"], scope, send),
    ),
    Route(
        "DELETE",
        "/v1/completions/{id}",
        "cancel the generation, wherever it runs",
        lambda app, scope, _, send, p: app._cancel("completion", p["id"], scope, send),
    ),
    Route(
        "POST",
        "/v1/messages",
        "an Anthropic Messages generation, streamed (SSE with named events) or whole; errors in Anthropic's shape",
        lambda app, scope, receive, send, _: app._messages(scope, receive, send),
        ANTHROPIC_ERRORS,
    ),
    Route(
        "POST",
        "/v1/responses",
        "an OpenAI Responses generation, streamed (SSE, `sequence_number` from the mesh's seq) or whole; "
        "`background: true` runs it detached, kept for `--responses-retention-s`",
        lambda app, scope, receive, send, _: app.responses.create(scope, receive, send),
    ),
    Route(
        "GET",
        "/v1/responses/{id}",
        "a background response now (status, output so far); `?stream=true&starting_after=N`: its events after N, "
        "then live, on any gateway",
        lambda app, scope, receive, send, p: app.responses.retrieve(scope, receive, send, p["id"]),
    ),
    Route(
        "POST",
        "/v1/responses/{id}/cancel",
        "cancel a background response (idempotent); answers the Response",
        lambda app, scope, _, send, p: app.responses.cancel(scope, send, p["id"]),
    ),
    Route(
        "DELETE",
        "/v1/responses/{id}",
        "forget a response, cancelling it if it runs",
        lambda app, scope, _, send, p: app.responses.delete(scope, send, p["id"]),
    ),
    Route(
        "GET",
        "/v1/models",
        "the models the mesh serves now",
        lambda app, scope, _, send, __: app._models(scope, send, None),
    ),
    Route(
        "GET",
        "/v1/models/{model}",
        "one model the mesh serves now (404 `model_not_found` if none)",
        lambda app, scope, _, send, p: app._models(scope, send, p["model"]),
    ),
    Route(
        "GET",
        "/health",
        '200 `{"status":"ok"}` while serving, 503 once draining',
        lambda app, _, __, send, ___: app._health(send),
    ),
)
"""Every route the gateway serves; nothing else answers but 404, 405 and (with CORS on) a preflight's 204."""


@dataclass(frozen=True, slots=True)
class RoutePath:
    """One path template and the routes on it, by method."""

    template: str
    methods: dict[str, Route]
    allow: str
    """The ``Allow`` header of a 405 here."""
    errors: ErrorShape
    """How errors on this path are written (its routes'; a 405 too)."""


class RouteTable:
    """The routes by path: an exact path is one dict lookup, a template one regex match (once per request)."""

    exact: dict[str, RoutePath]
    templated: list[tuple[re.Pattern[str], RoutePath]]
    listing: str
    """The paths served, for the 404's message."""

    def __init__(self, routes: Iterable[Route]) -> None:
        by_path: dict[str, dict[str, Route]] = {}
        for route in routes:
            methods = by_path.setdefault(route.path, {})
            if route.method in methods:
                raise ValueError(f"two routes for {route.method} {route.path}")
            methods[route.method] = route
        self.exact, self.templated = {}, []
        for template, methods in by_path.items():
            at = RoutePath(template, methods, ", ".join(methods), next(iter(methods.values())).errors)
            if "{" in template:
                self.templated.append((_compile(template), at))
            else:
                self.exact[template] = at
        self.listing = ", ".join(by_path)

    def find(self, path: str) -> tuple[RoutePath, dict[str, str]] | None:
        """The path's routes and parameters (unquoted), or None when no route has this path."""
        at = self.exact.get(path)
        if at is not None:
            return at, {}
        for pattern, at in self.templated:
            if match := pattern.fullmatch(path):
                return at, {name: urllib.parse.unquote(value) for name, value in match.groupdict().items()}
        return None


def _compile(template: str) -> re.Pattern[str]:
    """``/v1/models/{model}`` -> a pattern with one named group per ``{name}``, each one path segment."""
    parts = re.split(r"\{(\w+)\}", template)
    return re.compile("".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)" for i, part in enumerate(parts)))


TABLE = RouteTable(ROUTES)


def routes_markdown(routes: Iterable[Route] = ROUTES) -> str:
    """The routes as a Markdown table (method, path, what), for docs/gateway.md."""
    rows = ["| method | path | what |", "|---|---|---|"]
    rows += [f"| `{r.method}` | `{r.path}` | {r.what} |" for r in routes]
    return "\n".join(rows) + "\n"
