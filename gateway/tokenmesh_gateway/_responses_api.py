"""The ``/v1/responses`` routes: create (streamed, whole or in the background), retrieve, cancel, delete.

A response that is not a background one runs as a chat completion does
(``Exchanges``: the status after the first chunk, the disconnect watcher,
the drain), only written in the Responses format; its id is
``resp_<request_id>`` (``X-Request-Id`` as on the other routes, so a
dropped foreground stream detaches instead of stopping, as there). A
background one runs with a gateway-chosen request id and is followed by
this gateway's :class:`~tokenmesh_gateway._response_store.ResponseStore`,
which any gateway can adopt it into after this one is gone (see there).
"""

from __future__ import annotations

import time
import urllib.parse

import orjson

from tokenmesh.errors import MeshError, NotFound
from tokenmesh_gateway._errors import HttpError, from_mesh, invalid
from tokenmesh_gateway._front import Front, Incoming
from tokenmesh_gateway._http import Receive, Scope, Send, respond
from tokenmesh_gateway._ids import check_id, flag, seq_of
from tokenmesh_gateway._response_store import Kept, ResponseStore, background_id, created_of
from tokenmesh_gateway._responses import Echo, ResponsesRequest, parse
from tokenmesh_gateway._responses_sse import Head, ResponsesAnswer, response_object

START_WAIT_S = 2.0
"""How long a background create (or an adopting retrieve) waits for the first chunk before it answers ``queued``:
long enough that a request the mesh refuses is a real 4xx/5xx, as on every other route."""

ADOPT_WAIT_S = 3.0
"""How long an adopting retrieve waits for the replay to begin: longer than a router waits (2 s) for its own stream
of that id to end before it refuses a second one (409: the gateway that follows it reads through that router)."""

REPLAY_GAP_S = 0.05
"""An adopted response's replay is caught up once no chunk came for this long (the replay comes at once)."""

CANCEL_WAIT_S = 2.0
"""How long a cancel waits for the generation's cancelled end, so that its answer says ``cancelled``."""

PREFIX = "resp_"


class ResponsesApi:
    """The Responses API of one gateway, through its request front.

    Args:
        front: the gateway's request front (its client, settings, exchanges, tenants and spans).

    """

    front: Front
    store: ResponseStore
    """The background responses this gateway follows."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.store = ResponseStore(front.config.responses_retention_s, front.config.responses_max, front.client.cancel)

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/responses``."""
        incoming = await self.front.open(scope, receive)
        parsed = parse(incoming.body, self.front.config.default_model)
        created = int(time.time())
        if parsed.echo.background:
            await self._background(incoming, parsed, created, send)
            return
        request = parsed.request
        incoming.identify(request)  # its X-Request-Id, as on the other routes
        answer = ResponsesAnswer(
            parsed.stream, Head("", created, request.model, parsed.echo), id_prefix=incoming.prefix
        )
        await incoming.generate("chat", request, answer, send)

    async def _background(self, incoming: Incoming, parsed: ResponsesRequest, created: int, send: Send) -> None:
        """Start a generation this gateway follows; answer its Response (``queued`` or later) or stream it."""
        front = self.front
        request = parsed.request
        request_id = background_id(created)
        incoming.identify(request, request_id)
        kept = Kept(request.request_id, Head(request_id, created, request.model, parsed.echo))
        self.store.add(kept)
        span, metadata = front.span(incoming.scope, "chat", request.model or "default")
        try:
            kept.follow(front.client.generate(request, timeout=front.timeout(), metadata=metadata))
            await kept.started(START_WAIT_S)
        finally:
            span.end()
        if kept.error is not None and not kept.chunks:
            self.store.forget(kept)
            raise from_mesh(kept.error)
        if parsed.stream:
            answer = ResponsesAnswer(True, kept.head, id_prefix=incoming.prefix, opening_status="queued")
            await front.exchanges.answer(kept.replay, answer, incoming.receive, send)
            return
        await respond(send, 200, orjson.dumps(response_object(kept.head, kept.outcome())), _id_header(request_id))

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, path_id: str) -> None:
        """``GET /v1/responses/{id}``: the Response now, or (``?stream=true``) its events after ``starting_after``."""
        incoming = self.front.caller(scope, receive)
        request_id = _request_id(path_id)
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        after = -1
        if "starting_after" in query:
            after = seq_of(query["starting_after"][-1], "starting_after")
        stream = flag(query, "stream")
        if stream:
            self.front.refuse_if_draining()
        kept = await self._find(incoming, request_id)
        if stream:
            answer = ResponsesAnswer(True, kept.head, after, id_prefix=incoming.prefix)
            await self.front.exchanges.answer(kept.replay, answer, receive, send)
            return
        await respond(send, 200, orjson.dumps(response_object(kept.head, kept.outcome())), _id_header(request_id))

    async def cancel(self, scope: Scope, receive: Receive, send: Send, path_id: str) -> None:
        """``POST /v1/responses/{id}/cancel``: stop it; its Response (cancelled, or as it ended) however often asked."""
        incoming = self.front.caller(scope, receive)
        request_id = _request_id(path_id)
        kept = await self._find(incoming, request_id)
        if not kept.finished:
            try:
                await self.front.client.cancel(kept.mesh_id)
            except NotFound:
                pass  # it ended meanwhile: its end is on its way to the follow task
            except MeshError as error:
                raise from_mesh(error) from error
            await kept.settled(CANCEL_WAIT_S)
        await respond(send, 200, orjson.dumps(response_object(kept.head, kept.outcome())), _id_header(request_id))

    async def delete(self, scope: Scope, receive: Receive, send: Send, path_id: str) -> None:
        """``DELETE /v1/responses/{id}``: forget it here, cancelling it if it still runs."""
        incoming = self.front.caller(scope, receive)
        request_id = _request_id(path_id)
        mesh_id = incoming.mesh_id(request_id)
        kept = self.store.remove(mesh_id)
        live = False
        if kept is None or not kept.finished:
            try:
                live = (await self.front.client.cancel(mesh_id)).cancelled
            except NotFound:
                pass
            except MeshError as error:
                raise from_mesh(error) from error
        if kept is None and not live:
            raise HttpError(
                404, f"no response {path_id!r} is kept by this gateway or running on the mesh", code="not_found"
            )
        body = {"id": PREFIX + request_id, "object": "response", "deleted": True}
        await respond(send, 200, orjson.dumps(body))

    async def _find(self, incoming: Incoming, request_id: str) -> Kept:
        """The background response kept here, else adopted from the mesh (Resume from its start); 404 saying why."""
        mesh_id = incoming.mesh_id(request_id)
        kept = self.store.get(mesh_id)
        if kept is not None:
            return kept
        created = created_of(request_id)
        if created is None:
            raise HttpError(
                404,
                f"no response {PREFIX + request_id!r}: tokenmesh keeps background responses only "
                "(send background: true to retrieve one later)",
                code="not_found",
            )
        if self.store.expired(created):
            raise HttpError(
                404,
                f"response {PREFIX + request_id!r} has expired: background responses are kept "
                f"{self.store.retention_s:g} s from their creation",
                code="expired",
            )
        self.front.refuse_if_draining()  # a stopping gateway adopts nothing: another one will
        adopted = Kept(mesh_id, Head(request_id, created, self.front.config.default_model, Echo(background=True)))
        adopted.on_lost = lambda: self.store.forget(adopted)
        self.store.add(adopted)
        adopted.follow(self.front.client.resume(mesh_id, 0, timeout=self.front.timeout()))
        await adopted.caught_up(REPLAY_GAP_S, ADOPT_WAIT_S)
        if adopted.error is not None and not adopted.chunks:
            self.store.forget(adopted)
            if isinstance(adopted.error, NotFound):
                raise HttpError(
                    404,
                    f"response {PREFIX + request_id!r} is no longer on the mesh: cancelled or deleted, or the "
                    "gateway following it stopped and no gateway retrieved it within the workers' resume grace",
                    code="not_found",
                )
            raise from_mesh(adopted.error)
        return adopted


def _request_id(path_id: str) -> str:
    """The request id in a Response id (``resp_<request_id>``); 400 for anything else."""
    if not path_id.startswith(PREFIX):
        raise invalid(f"a response id starts with {PREFIX!r}, got {path_id[:140]!r}", "response_id")
    request_id = path_id.removeprefix(PREFIX)
    check_id(request_id, "the response id")
    return request_id


def _id_header(request_id: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-request-id", request_id.encode())]
