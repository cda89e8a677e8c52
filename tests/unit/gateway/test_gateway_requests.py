"""OpenAI request bodies into mesh requests, and each bad input's precise 4xx; the gateway's settings."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.dns_server import free_port_on
from tests.support.gateway_helpers import gateway_over
from tests.support.mesh import InProcessMesh
from tokenmesh.config import ConfigError
from tokenmesh_gateway import GatewayConfig, HttpError, hash_key, load_keys
from tokenmesh_gateway._app import ROUTES, TABLE, routes_markdown
from tokenmesh_gateway._openai import parse

USER = [{"role": "user", "content": "hi"}]


def test_chat_fields_become_the_mesh_request() -> None:
    parsed = parse(
        {
            "model": "m",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "\n",
            "ignore_eos": True,
            "user": "u1",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c", "name": "bot"},
            ],
            # neutral values SDKs send, and fields nobody here knows (ignored, as vLLM does)
            "n": 1,
            "logprobs": False,
            "tools": [],
            "tool_choice": "none",
            "presence_penalty": 0.0,
            "response_format": {"type": "text"},
            "logit_bias": {},
            "store": False,
            "metadata": {"k": "v"},
            "some_vendor_field": 1,
        },
        "chat",
    )
    request = parsed.request
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("system", "s"),
        ("user", "ab"),
        ("assistant", "c"),
    ]
    assert (request.model, request.max_tokens, request.temperature, request.top_p, request.seed) == ("m", 7, 0, 0.5, 3)
    assert list(request.stop) == ["\n"] and request.ignore_eos
    assert dict(request.labels) == {"user": "u1", "session": "u1"}  # user is the session key without a better one
    assert (parsed.stream, parsed.include_usage, parsed.continuous_usage) == (True, True, True)


def test_completion_fields_and_defaults() -> None:
    parsed = parse(
        {"prompt": ["once"], "max_completion_tokens": 5, "max_tokens": 99, "stop": ["a", "b"]},
        "completion",
        default_model="smollm2",
    )
    request = parsed.request
    assert (request.prompt, request.max_tokens, list(request.stop), request.model) == ("once", 5, ["a", "b"], "smollm2")
    assert not request.HasField("temperature") and not request.HasField("seed") and not parsed.stream
    bare = parse({"prompt": "x"}, "completion").request
    assert not bare.HasField("max_tokens") and bare.model == "" and not bare.stop


BAD_FIELDS: list[tuple[str, dict[str, Any], str, str]] = [
    # (kind, body, param, words in the message)
    ("chat", {"messages": USER, "n": 2}, "n", "not supported"),
    ("chat", {"messages": USER, "logprobs": "yes"}, "logprobs", "true or false"),
    ("chat", {"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("chat", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ("chat", {"messages": USER, "tool_choice": "auto"}, "tool_choice", "not supported"),
    ("chat", {"messages": USER, "functions": [{"name": "f"}]}, "functions", "not supported"),
    ("chat", {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type", "text, json_object"),
    ("chat", {"messages": USER, "logit_bias": {"the": -100}}, "logit_bias", "token ids"),
    ("chat", {"messages": USER, "frequency_penalty": "high"}, "frequency_penalty", "number"),
    ("chat", {"messages": USER, "guided_regex": "a+"}, "guided_regex", "not supported"),
    ("completion", {"prompt": "x", "best_of": 2}, "best_of", "not supported"),
    ("completion", {"prompt": "x", "echo": True}, "echo", "not supported"),
    ("completion", {"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ("completion", {"prompt": "x", "logprobs": -1}, "logprobs", "0..20"),
    ("completion", {"prompt": "x", "logprobs": 2, "top_logprobs": 2}, "top_logprobs", "belongs to"),
    ("completion", {"prompt": ["a", "b"]}, "prompt", "list of one string"),
    ("completion", {"prompt": [1, 2, 3]}, "prompt", "token ids"),
    ("completion", {"prompt": ""}, "prompt", "empty"),
    ("completion", {"prompt": 5}, "prompt", "must be a string"),
    ("completion", {"messages": USER}, "messages", "/v1/chat/completions"),
    ("chat", {"prompt": "x"}, "prompt", "/v1/completions"),
    ("chat", {"messages": []}, "messages", "empty"),
    ("chat", {"messages": "hi"}, "messages", "must be a list"),
    ("chat", {}, "messages", "must be a list"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
    ("chat", {"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role", "tool"),
    ("chat", {"messages": ["hi"]}, "messages[0]", "must be an object"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0].content", "got null"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
        "text only",
    ),
    ("chat", {"messages": USER, "max_tokens": "10"}, "max_tokens", "must be an integer"),
    ("chat", {"messages": USER, "max_tokens": 0}, "max_tokens", "at least 1"),
    ("chat", {"messages": USER, "max_tokens": 10.5}, "max_tokens", "must be an integer"),
    ("chat", {"messages": USER, "max_completion_tokens": 2**40}, "max_completion_tokens", "at most"),
    ("chat", {"messages": USER, "temperature": "hot"}, "temperature", "must be a number"),
    ("chat", {"messages": USER, "temperature": True}, "temperature", "must be a number"),
    ("chat", {"messages": USER, "seed": -1}, "seed", "seed must be"),
    ("chat", {"messages": USER, "stop": 5}, "stop", "stop must be"),
    ("chat", {"messages": USER, "stop": ["a", 1]}, "stop", "stop must be"),
    ("chat", {"messages": USER, "stream": "yes"}, "stream", "true or false"),
    ("chat", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ("chat", {"messages": USER, "stream": True, "stream_options": []}, "stream_options", "must be an object"),
    (
        "chat",
        {"messages": USER, "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "true or false",
    ),
    ("chat", {"messages": USER, "model": 3}, "model", "must be a string"),
    ("chat", {"messages": USER, "user": ["u"]}, "user", "must be a string"),
]


@pytest.mark.parametrize(
    ("kind", "body", "param", "words"), BAD_FIELDS, ids=[f"{k}-{p}-{i}" for i, (k, _, p, _w) in enumerate(BAD_FIELDS)]
)
def test_each_bad_field_is_a_400_naming_it(kind: str, body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(HttpError) as refused:
        parse(body, kind)  # type: ignore[arg-type]
    assert refused.value.status == 400 and refused.value.param == param
    assert words in refused.value.message, refused.value.message
    assert refused.value.document()["type"] == "invalid_request_error"


async def test_bad_requests_over_http_are_precise_4xx_with_the_openai_error(mesh: InProcessMesh) -> None:
    cases: list[tuple[str, str, bytes | None, dict[str, str], int, str | None, str]] = [
        # (method, path, body, headers, status, param, code)
        ("POST", "/v1/chat/completions", b'{"messages": [', {}, 400, None, "invalid_argument"),
        ("POST", "/v1/chat/completions", b"\xff\xfe{}", {}, 400, None, "invalid_argument"),
        ("POST", "/v1/chat/completions", b"[]", {}, 400, None, "invalid_argument"),
        ("POST", "/v1/chat/completions", b"", {}, 400, None, "invalid_argument"),
        (
            "POST",
            "/v1/chat/completions",
            orjson.dumps({"messages": [{"role": "robot", "content": "x"}]}),
            {},
            400,
            "messages[0].role",
            "invalid_argument",
        ),
        ("POST", "/v1/chat/completions", orjson.dumps({"messages": []}), {}, 400, "messages", "invalid_argument"),
        ("POST", "/v1/chat/completions", b'{"messages": "' + b"x" * 5000 + b'"}', {}, 413, None, "request_too_large"),
        (
            "POST",
            "/v1/completions",
            orjson.dumps({"prompt": "x", "max_tokens": 100_000}),
            {},
            400,
            "max_tokens",
            "invalid_argument",
        ),
        (
            "POST",
            "/v1/completions",
            orjson.dumps({"prompt": "x", "model": "nope"}),
            {},
            404,
            "model",
            "model_not_found",
        ),
        (
            "POST",
            "/v1/completions",
            orjson.dumps({"prompt": "x"}),
            {"X-Request-Id": "a/b"},
            400,
            "request_id",
            "invalid_argument",
        ),
        (
            "POST",
            "/v1/completions",
            orjson.dumps({"prompt": "x", "stream": True}),
            {"Last-Event-ID": "nocolon"},
            400,
            "Last-Event-ID",
            "invalid_argument",
        ),
        (
            "POST",
            "/v1/completions",
            orjson.dumps({"prompt": "x"}),
            {"Last-Event-ID": "a:1"},
            400,
            "stream",
            "invalid_argument",
        ),
        (
            "POST",
            "/v1/completions",
            orjson.dumps({"prompt": "x", "stream": True}),
            {"Last-Event-ID": "a:1", "X-Request-Id": "b"},
            400,
            "Last-Event-ID",
            "invalid_argument",
        ),
        ("GET", "/v1/completions/x/stream?starting_after=-1", None, {}, 400, "starting_after", "invalid_argument"),
        ("GET", "/v1/completions/x/stream", None, {"Last-Event-ID": "y:3"}, 400, "Last-Event-ID", "invalid_argument"),
        ("GET", "/v1/nothing", None, {}, 404, None, "not_found"),
        ("GET", "/", None, {}, 404, None, "not_found"),
        ("GET", "/v1/chat/completions", None, {}, 405, None, "method_not_allowed"),
        ("PUT", "/v1/completions", b"{}", {}, 405, None, "method_not_allowed"),
        ("POST", "/v1/models", b"{}", {}, 405, None, "method_not_allowed"),
        ("POST", "/health", b"", {}, 405, None, "method_not_allowed"),
        ("DELETE", "/v1/chat/completions/not-live", None, {}, 404, None, "not_found"),
    ]
    async with gateway_over(mesh, max_body_bytes=4096) as gateway:
        async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
            for method, path, body, headers, status, param, code in cases:
                response = await http.request(method, path, content=body, headers=headers)
                where = f"{method} {path} {body!r:.60} {headers}"
                assert response.status_code == status, (where, response.text)
                assert response.headers["content-type"] == "application/json", where
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, where
                assert (error["param"], error["code"]) == (param, code), (where, error)
                assert error["message"], where
                if status == 405:
                    assert response.headers["allow"] in ("GET", "POST", "DELETE")
            # Still serving after all of that.
            response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == "tok0 tok1 "


# -- the route table ---------------------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[3] / "docs" / "gateway.md"


def _dead_router() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _concrete(template: str) -> str:
    return re.sub(r"\{\w+\}", "x1", template)


def _labels(metrics: str) -> set[tuple[str, str]]:
    return set(re.findall(r'tokenmesh_gateway_http_requests_total\{route="([^"]*)",status="([^"]*)"\}', metrics))


async def test_a_method_a_route_does_not_take_is_405_with_allow_naming_its_method() -> None:
    expected = {  # every kind of route, written out: the table must say the same
        "/v1/chat/completions": "POST",
        "/v1/completions": "POST",
        "/v1/chat/completions/x1/stream": "GET",
        "/v1/completions/x1/stream": "GET",
        "/v1/chat/completions/x1": "DELETE",
        "/v1/completions/x1": "DELETE",
        "/v1/messages": "POST",
        "/v1/responses": "POST",
        "/v1/responses/x1": "GET, DELETE",
        "/v1/responses/x1/cancel": "POST",
        "/v1/models": "GET",
        "/v1/models/x1": "GET",
        "/health": "GET",
    }
    methods: dict[str, list[str]] = {}
    for route in ROUTES:
        methods.setdefault(_concrete(route.path), []).append(route.method)
    assert {path: ", ".join(taken) for path, taken in methods.items()} == expected
    async with gateway_over(None, routers=(_dead_router(),), retry_deadline_s=0.2) as gateway:
        async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
            for path, allowed in expected.items():
                for method in {"GET", "POST", "DELETE", "PUT", "PATCH"} - set(allowed.split(", ")):
                    response = await http.request(method, path, content=b"{}" if method != "GET" else None)
                    where = f"{method} {path}"
                    assert response.status_code == 405, (where, response.text)
                    assert response.headers["allow"] == allowed, where
                    body = response.json()
                    if path == "/v1/messages":  # Anthropic's error shape on Anthropic's route
                        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", where
                    else:
                        assert body["error"]["code"] == "method_not_allowed", where
                    assert f"use {allowed}" in body["error"]["message"], where


async def test_a_path_no_route_has_is_404_naming_the_paths_served() -> None:
    metrics_port = free_port_on("127.0.0.1")
    async with gateway_over(None, routers=(_dead_router(),), metrics_port=metrics_port) as gateway:
        async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
            for method, path in (
                ("GET", "/v1/models/"),
                ("DELETE", "/v1/chat/completions/a/b"),
                ("POST", "/v2/chat"),
                ("GET", "/v1/completions/x/stream/more"),
                ("GET", "/healthz"),
                ("GET", "/metrics"),  # on --metrics-port only, never on the public port
                ("PUT", "/"),
            ):
                response = await http.request(method, path)
                assert response.status_code == 404, (method, path, response.text)
                assert "allow" not in response.headers
                error = response.json()["error"]
                assert error["code"] == "not_found"
                assert f"no route {path};" in error["message"] and "/v1/chat/completions" in error["message"]
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    assert {label for label, status in _labels(metrics) if status == "404"} == {"other"}


async def test_the_requests_counter_labels_each_request_with_its_route_template_never_the_path(
    mesh: InProcessMesh,
) -> None:
    async with gateway_over(mesh, metrics_port=free_port_on("127.0.0.1")) as gateway:
        assert gateway.metrics_endpoint is not None
        async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
            for route in ROUTES:
                wrong = "PATCH"
                assert (await http.request(wrong, _concrete(route.path))).status_code == 405
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/v1/models/some-model")).status_code == 404  # the route's own 404
            assert (await http.get("/nowhere")).status_code == 404
            metrics = (await http.get(f"http://127.0.0.1:{gateway.metrics_endpoint.port}/metrics")).text
    labels = _labels(metrics)
    assert {label for label, status in labels if status == "405"} == {r.path for r in ROUTES}
    assert ("/health", "200") in labels and ("/v1/models/{model}", "404") in labels and ("other", "404") in labels
    assert not any("x1" in label or "some-model" in label for label, _ in labels)


def test_the_route_table_renders_as_the_docs_table() -> None:
    table = routes_markdown()
    for route in ROUTES:
        assert f"| `{route.method}` | `{route.path}` | {route.what} |" in table
    assert len(table.splitlines()) == len(ROUTES) + 2
    found = TABLE.find("/v1/chat/completions/a%20b/stream")
    assert found is not None and found[0].template == "/v1/chat/completions/{id}/stream"
    assert found[1] == {"id": "a b"}  # a parameter is unquoted
    assert table in DOCS.read_text(), "docs/gateway.md's route table differs from ROUTES: paste routes_markdown()"


def test_gateway_settings_are_checked(tmp_path: Path) -> None:
    assert GatewayConfig(routers=("r:50051",)).port == 8000
    for settings, words in (
        ({}, "at least one router"),
        ({"routers": ("r",)}, "host:port"),
        ({"routers": ("r:1",), "port": 70000}, "port must be"),
        ({"routers": ("r:1",), "metrics_port": 8000}, "metrics_port must differ from port"),
        ({"routers": ("r:1",), "health_port": 8000}, "health_port must differ from port"),
        ({"routers": ("r:1",), "health_port": 9090, "metrics_port": 9090}, "health_port and metrics_port must differ"),
        ({"routers": ("r:1",), "metrics_port": -1}, "metrics_port must be 0..65535"),
        ({"routers": ("r:1",), "cors_origins": ("https://app.example/",)}, "no trailing"),
        ({"routers": ("r:1",), "cors_origins": ("app.example",)}, "scheme://host"),
        ({"routers": ("r:1",), "cors_origins": ("*",)}, "scheme://host"),
        ({"routers": ("r:1",), "max_body_bytes": 10}, "max_body_bytes"),
        ({"routers": ("r:1",), "keepalive_s": 0}, "keepalive_s"),
        ({"routers": ("r:1",), "timeout_s": -1}, "timeout_s"),
        ({"routers": ("r:1",), "drain_tail_s": -1}, "drain_tail_s must be >= 0"),
        ({"routers": ("r:1",), "stop_grace_s": -0.5}, "stop_grace_s must be >= 0"),
        ({"routers": ("r:1",), "api_keys_file": str(tmp_path / "missing")}, "cannot read"),
    ):
        with pytest.raises(ConfigError, match=words):
            GatewayConfig(**settings)  # type: ignore[arg-type]


def test_the_keys_file_holds_hashes_and_tenants(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{hash_key('k1')} search\n\n# comment\n{hash_key('k2').upper()}   ads # trailing\n")
    assert load_keys(str(keys)) == {hash_key("k1"): "search", hash_key("k2"): "ads"}
    for text, words in (
        (f"{hash_key('k1')}\n", ":1: expected"),
        ("nothex tenant\n", ":1: expected"),
        (f"{hash_key('k1')} a\n{hash_key('k1')} b\n", ":2: this key hash is listed twice"),
        ("# nothing\n", "lists no key"),
    ):
        keys.write_text(text)
        with pytest.raises(ConfigError, match=words):
            load_keys(str(keys))


def test_the_gateway_command_checks_its_config() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "tokenmesh", "gateway", "--routers", "a:1,b:2", "--port", "0", "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "routers = 'a:1,b:2'" in ok.stdout and "keepalive_s = 15.0" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tokenmesh", "gateway", "--check-config"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "at least one router" in bad.stderr


def test_the_gateway_grace_periods_are_settings_with_flags_and_env() -> None:
    defaults = GatewayConfig(routers=("r:1",))
    assert (defaults.drain_grace_s, defaults.drain_tail_s, defaults.stop_grace_s) == (30.0, 2.0, 2.0)
    env = {**os.environ, "TOKENMESH_GATEWAY_STOP_GRACE_S": "0.5"}
    done = subprocess.run(
        [sys.executable, "-m", "tokenmesh", "gateway", "--routers", "a:1", "--drain-tail-s", "0.25", "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "drain_tail_s = 0.25" in done.stdout and "stop_grace_s = 0.5" in done.stdout
    helped = subprocess.run(
        [sys.executable, "-m", "tokenmesh", "gateway", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "TOKENMESH_GATEWAY_DRAIN_TAIL_S" in helped.stdout and "TOKENMESH_GATEWAY_STOP_GRACE_S" in helped.stdout


async def test_headers_over_the_limit_get_431_and_the_gateway_serves_on() -> None:
    import asyncio

    from tests.support.gateway_helpers import gateway_over
    from tests.support.mesh import in_process_mesh

    async with in_process_mesh() as mesh, gateway_over(mesh, max_header_bytes=4096) as gateway:
        host, port = gateway.address.rsplit(":", 1)

        async def ask(extra: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)  # the gateway closes the connection either way
            writer.close()
            return answer

        big = await ask(b"X-Big: " + b"a" * 2_000_000 + b"\r\n")
        assert big.startswith(b"HTTP/1.1 431 ") and b"request_header_fields_too_large" in big
        many = await ask(b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60) for i in range(100)))
        assert many.startswith(b"HTTP/1.1 431 ")
        ok = await ask(b"Connection: close\r\nX-Small: " + b"a" * 1000 + b"\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ")
