"""The gateway's edge over an in-process mesh: CORS for listed origins, and its metrics and probe ports apart."""

from __future__ import annotations

import asyncio

import httpx

from tests.support.dns_server import free_port_on
from tests.support.gateway_helpers import gateway_over, text_of
from tests.support.mesh import InProcessMesh, wait_until

APP = "https://app.example"
EVIL = "https://evil.example"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
}


def tokens(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


async def test_a_listed_origins_preflight_and_streams_get_cors_headers_others_none(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh, cors_origins=(APP, "http://localhost:5173")) as gateway:
        async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
            ok = await http.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
            assert ok.status_code == 204 and ok.content == b""
            assert ok.headers["access-control-allow-origin"] == APP
            assert ok.headers["access-control-allow-methods"] == "POST"
            assert ok.headers["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
            assert ok.headers["vary"] == "origin"
            # A templated path answers with its own methods.
            resume = await http.options("/v1/completions/r1/stream", headers={"Origin": APP, **PREFLIGHT})
            assert resume.status_code == 204 and resume.headers["access-control-allow-methods"] == "GET"

            refused = await http.options("/v1/chat/completions", headers={"Origin": EVIL, **PREFLIGHT})
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "cors_origin_not_allowed"
            assert "access-control-allow-origin" not in refused.headers

            async def stream(origin: str, i: int) -> httpx.Response:
                return await http.post(
                    "/v1/chat/completions",
                    headers={"Origin": origin},
                    json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 5, "stream": True},
                )

            # Dozens of streams at once, half from the listed origin: each gets exactly its own origin's headers.
            answers = await asyncio.gather(*(stream(APP if i % 2 else EVIL, i) for i in range(32)))
            for i, answer in enumerate(answers):
                assert answer.status_code == 200 and text_of(answer.content) == tokens(5), i
                assert answer.headers["content-type"] == "text/event-stream"
                assert answer.headers["vary"] == "origin"
                if i % 2:
                    assert answer.headers["access-control-allow-origin"] == APP
                    assert "x-request-id" in answer.headers["access-control-expose-headers"]
                else:  # served (a server cannot stop a page's request): the browser keeps it from the page
                    assert "access-control-allow-origin" not in answer.headers
            # Errors carry the headers too, or the page could not read why it failed.
            bad = await http.post("/v1/chat/completions", headers={"Origin": APP}, json={"messages": []})
            assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == APP


async def test_without_cors_origins_no_header_and_a_preflight_is_405(mesh: InProcessMesh) -> None:
    async with gateway_over(mesh) as gateway:
        async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
            preflight = await http.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
            assert preflight.status_code == 405 and preflight.headers["allow"] == "POST"
            answer = await http.post("/v1/completions", headers={"Origin": APP}, json={"prompt": "x", "max_tokens": 2})
            assert answer.status_code == 200
            assert not [name for name in answer.headers if name.startswith("access-control-") or name == "vary"]


async def test_metrics_and_health_have_ports_of_their_own(mesh: InProcessMesh) -> None:
    metrics_port, health_port = free_port_on("127.0.0.1"), free_port_on("127.0.0.1")
    gateway_cm = gateway_over(mesh, metrics_port=metrics_port, health_port=health_port)
    async with gateway_cm as gateway, httpx.AsyncClient() as http:
        public = f"http://{gateway.address}"
        assert (await http.post(f"{public}/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200
        assert (await http.get(f"{public}/metrics")).status_code == 404
        metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        assert 'tokenmesh_gateway_http_requests_total{route="/v1/completions",status="200"} 1.0' in metrics
        assert 'route="other",status="404"' in metrics  # the public /metrics counted as a path no route has

        probe = f"http://127.0.0.1:{health_port}"
        health = await http.get(f"{probe}/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (await http.head(f"{probe}/health")).status_code == 200
        assert (await http.get(f"{probe}/v1/models")).status_code == 404, "the probe port serves /health alone"
        assert (await http.post(f"{probe}/health")).status_code == 405

        # Draining: the probe port says so at once (readiness drops the pod) while open streams finish.
        app = gateway.app
        assert app is not None
        for backend in mesh.backends:
            backend.delay = 0.05
        slow = asyncio.create_task(
            http.post(f"{public}/v1/completions", json={"prompt": "y", "max_tokens": 20}, timeout=30)
        )
        await wait_until(lambda: len(app.front.exchanges.active) == 1)
        shutdown = asyncio.create_task(gateway.shutdown())
        await wait_until(lambda: app.front.draining)
        draining = await http.get(f"{probe}/health")
        assert (draining.status_code, draining.json()) == (503, {"status": "draining"})
        assert (await slow).json()["choices"][0]["text"] == tokens(20)
        await shutdown
    for port in (health_port, metrics_port):  # both released with the gateway
        async with httpx.AsyncClient() as http:
            try:
                await http.get(f"http://127.0.0.1:{port}/", timeout=2)
            except httpx.ConnectError:
                continue
        raise AssertionError(f"port {port} still answers after the shutdown")
