"""The gateway's routes, as one raw ASGI application over :class:`tokenmesh.client.Client`.

:data:`ROUTES` is the one list of what the gateway serves: each route's method,
path template, what it does and its endpoint. It drives dispatch (once per
request; a stream's chunks never pass through it), the 404 for a path no route
has, the 405 with ``Allow`` for a method a path does not take (with ``--cors-origins``, a
browser's ``OPTIONS`` preflight gets the same methods in a 204 instead), the route label
of the requests counter (the template, never the caller's path) and the docs
(:func:`routes_markdown`).

Every generation route goes through the one request front
(:mod:`tokenmesh_gateway._front`): OpenAI's and Anthropic's POSTs as a
:class:`~tokenmesh_gateway._front.Dialect` each (:mod:`tokenmesh_gateway._dialects`),
Responses through :class:`~tokenmesh_gateway._responses_api.ResponsesApi`.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from tokenmesh.client import Client
from tokenmesh.errors import MeshError
from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway._anthropic_sse import ANTHROPIC_ERRORS
from tokenmesh_gateway._config import GatewayConfig
from tokenmesh_gateway._cors import Cors
from tokenmesh_gateway._dialects import CHAT, COMPLETION, MESSAGES, OpenAI
from tokenmesh_gateway._errors import OPENAI_ERRORS, ErrorShape, HttpError, from_mesh
from tokenmesh_gateway._front import Front, post
from tokenmesh_gateway._http import Receive, Scope, Send, header, respond, respond_error
from tokenmesh_gateway._ids import check_id as _check_id
from tokenmesh_gateway._ids import flag as _flag
from tokenmesh_gateway._ids import last_event as _last_event
from tokenmesh_gateway._ids import seq_of as _seq
from tokenmesh_gateway._openai import Kind
from tokenmesh_gateway._responses_api import ResponsesApi
from tokenmesh_gateway._sse import response_id

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

    front: Front
    """What every generation route does the same way (tenants, draining, ids, spans, the exchanges)."""
    responses: ResponsesApi
    """The /v1/responses routes and the background responses this gateway follows."""
    cors: Cors | None
    """Which browser pages of other origins may call (None: no CORS, ``--cors-origins`` empty)."""
    created: int
    """Unix time the gateway started (the models' ``created``)."""

    def __init__(self, client: Client, config: GatewayConfig, keys: dict[str, str] | None = None) -> None:
        self.front = Front(client, config, keys)
        self.responses = ResponsesApi(self.front)
        self.cors = Cors(config.cors_origins) if config.cors_origins else None
        self.created = int(time.time())
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

    # -- generations (every one through the request front) -----------------------

    async def _resume_get(self, dialect: OpenAI, request_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = self.front.caller(scope, receive)
        self.front.refuse_if_draining()
        _check_id(request_id, "the path's request id")
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        after = 0
        last_event = header(scope, b"last-event-id")
        if last_event is not None:
            _, after = _last_event(last_event.decode("latin-1"), request_id)  # its id must be the path's
        elif "starting_after" in query:
            after = _seq(query["starting_after"][-1], "starting_after")
        include = _flag(query, "include_usage")
        answer = dialect.resumed_answer(incoming, include, include and _flag(query, "continuous_usage_stats"), "")
        await incoming.replay(dialect.kind, request_id, after, answer, send)

    async def _cancel(self, kind: Kind, request_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = self.front.caller(scope, receive)
        _check_id(request_id, "the path's request id")
        try:
            response = await self.front.client.cancel(incoming.mesh_id(request_id))
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
        self.front.tenant(scope)
        try:
            listed = await self.front.client.list_models()
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
        if self.front.draining:
            await respond(send, 503, b'{"status":"draining"}')
        else:
            await respond(send, 200, b'{"status":"ok"}')

    @staticmethod
    async def _preflight(cors: Cors, scope: Scope, allow: str, send: Send) -> None:
        """A browser asks whether its page may call: 204 with the path's methods (403 for an unlisted origin)."""
        headers = cors.preflight(header(scope, b"origin"), allow, header(scope, b"access-control-request-headers"))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
        lambda app, scope, receive, send, _: post(app.front, CHAT, scope, receive, send),
    ),
    Route(
        "POST",
        "/v1/completions",
        "a completion, streamed (SSE) or whole; with `Last-Event-ID`: resume a stream after that event",
        lambda app, scope, receive, send, _: post(app.front, COMPLETION, scope, receive, send),
    ),
    Route(
        "GET",
        "/v1/chat/completions/{id}/stream",
        "resume a stream after `Last-Event-ID` (or `?starting_after=SEQ`; from the start without)",
        lambda app, scope, receive, send, p: app._resume_get(CHAT, p["id"], scope, receive, send),
    ),
    Route(
        "GET",
        "/v1/completions/{id}/stream",
        "resume a stream after `Last-Event-ID` (or `?starting_after=SEQ`; from the start without)",
        lambda app, scope, receive, send, p: app._resume_get(COMPLETION, p["id"], scope, receive, send),
    ),
    Route(
        "DELETE",
        "/v1/chat/completions/{id}",
        "cancel the generation, wherever it runs",
        lambda app, scope, receive, send, p: app._cancel("chat", p["id"], scope, receive, send),
    ),
    Route(
        "DELETE",
        "/v1/completions/{id}",
        "cancel the generation, wherever it runs",
        lambda app, scope, receive, send, p: app._cancel("completion", p["id"], scope, receive, send),
    ),
    Route(
        "POST",
        "/v1/messages",
        "an Anthropic Messages generation, streamed (SSE with named events) or whole; errors in Anthropic's shape",
        lambda app, scope, receive, send, _: post(app.front, MESSAGES, scope, receive, send),
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
        lambda app, scope, receive, send, p: app.responses.cancel(scope, receive, send, p["id"]),
    ),
    Route(
        "DELETE",
        "/v1/responses/{id}",
        "forget a response, cancelling it if it runs",
        lambda app, scope, receive, send, p: app.responses.delete(scope, receive, send, p["id"]),
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
