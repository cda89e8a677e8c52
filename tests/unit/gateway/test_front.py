"""The request front: tenants, the mesh's ids in a tenant's space, draining, and the resume point of a POST."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmesh.v1 import inference_pb2
from tokenmesh_gateway import HttpError
from tokenmesh_gateway._auth import hash_key
from tokenmesh_gateway._config import GatewayConfig
from tokenmesh_gateway._front import Front, Incoming

KEYS = {hash_key("key-a"): "acme", hash_key("key-b"): "globex"}


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(headers)}


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


def front(keys: dict[str, str] | None = KEYS) -> Front:
    return Front(object(), GatewayConfig(routers=("r:50051",)), keys)  # type: ignore[arg-type]  # no call is made


def incoming(body: dict[str, Any] | None = None, *headers: tuple[bytes, bytes], tenant: str = "acme") -> Incoming:
    return Incoming(front(), scope(*headers), _no_body, tenant, f"{tenant}/" if tenant else "", body or {})


def test_each_tenant_has_its_own_space_of_request_ids() -> None:
    gateway = front()
    acme = gateway.caller(scope((b"authorization", b"Bearer key-a")), _no_body)
    globex = gateway.caller(scope((b"x-api-key", b"key-b")), _no_body)
    assert (acme.tenant, acme.mesh_id("r1")) == ("acme", "acme/r1")
    assert (globex.tenant, globex.mesh_id("r1")) == ("globex", "globex/r1")
    anyone = front(None).caller(scope(), _no_body)
    assert (anyone.tenant, anyone.mesh_id("r1")) == ("", "r1")


@pytest.mark.parametrize("headers", [(), ((b"authorization", b"Bearer nope"),)], ids=["no key", "unknown key"])
def test_a_caller_without_a_listed_key_gets_401(headers: tuple[tuple[bytes, bytes], ...]) -> None:
    with pytest.raises(HttpError) as raised:
        front().caller(scope(*headers), _no_body)
    assert raised.value.status == 401


def test_identify_names_the_request_in_its_tenants_space_with_its_session() -> None:
    request = inference_pb2.GenerateRequest(prompt="hi")
    incoming(None, (b"x-session-id", b"conv-9")).identify(request, "r1")
    assert request.request_id == "acme/r1"
    assert dict(request.labels) == {"tenant": "acme", "session": "conv-9"}
    unnamed = inference_pb2.GenerateRequest(prompt="hi")
    incoming(tenant="").identify(unnamed, "")
    assert unnamed.request_id == "" and not unnamed.labels  # the client names it; no tenant label without keys


def test_identify_without_an_id_takes_the_callers_x_request_id_after_checking_its_session() -> None:
    request = inference_pb2.GenerateRequest(prompt="hi")
    incoming(None, (b"x-request-id", b"r7")).identify(request)
    assert request.request_id == "acme/r7"
    both_bad = incoming(None, (b"x-session-id", b"\x01"), (b"x-request-id", b"no spaces"))
    with pytest.raises(HttpError) as raised:
        both_bad.identify(inference_pb2.GenerateRequest(prompt="hi"))
    assert raised.value.param == "X-Session-ID"


async def test_a_draining_front_refuses_new_generations_with_503_but_still_knows_its_callers() -> None:
    gateway = front()
    gateway.draining = True
    with pytest.raises(HttpError) as raised:
        await gateway.open(scope((b"authorization", b"Bearer key-a")), _no_body)
    assert raised.value.status == 503
    assert gateway.caller(scope((b"authorization", b"Bearer key-a")), _no_body).tenant == "acme"


def test_the_resume_point_of_a_post_is_its_last_event_id_checked_against_its_request_id() -> None:
    assert incoming({"stream": True}).resume_point("r1") is None
    resumed = incoming({"stream": True}, (b"last-event-id", b"r1:41"))
    assert resumed.resume_point("r1") == ("r1", 41)
    assert resumed.resume_point("") == ("r1", 41)  # no X-Request-Id: the event's id names the stream
    with pytest.raises(HttpError, match="names 'r1', the request 'r2'"):
        resumed.resume_point("r2")
    with pytest.raises(HttpError, match="send stream: true"):
        incoming({}, (b"last-event-id", b"r1:41")).resume_point("r1")
    with pytest.raises(HttpError, match="must be <request_id>:<seq>"):
        incoming({"stream": True}, (b"last-event-id", b"41")).resume_point("")
