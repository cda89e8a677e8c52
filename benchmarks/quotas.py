"""Per-tenant quotas in the production shape: 2 router processes sharing a real Redis, the gateway, real workers.

Starts a redis-server (no persistence, stopped by its PID) and the embedded
mesh as ``tokenmesh up`` starts it (real Triton + SmolLM2 workers, one
router run as 2 processes on one port with SO_REUSEPORT, the prober, the
HTTP gateway), every router process with ``--quota-file`` (one tenant,
``search``: 1,000 tokens per minute, a 60 s window) and
``--quota-redis-url``; the gateway maps one API key to ``search``. Then, in
phases, each a burst of --requests concurrent generations of ``search``
(prompt ``qNN``, --max-tokens each: 3 + 4 + 60 = 67 tokens reserved):

(a) through gRPC, each request on a connection of its own so the kernel
    spreads them over both router processes: tokens served (prompt +
    completion, from the final chunks), admitted, refused (their status,
    ErrorInfo reason, RetryInfo), which process served what (each
    process's routing table), and Redis's count of the window; then,
    once the window has passed, the same burst through the gateway
    (httpx, ``/v1/completions``): 200s, 429s and the ``x-ratelimit-*``
    headers of one admitted and one refused response;
(b) Redis stopped by its PID: the burst again over both processes; as
    docs/quotas.md says, each process fails open with its share (1,000 / 2);
(c) Redis restarted (empty): once both processes count in it again
    (``tokenmesh_router_quota_store_up``), the burst again: one shared
    quota, Redis's count equal to what was served.

    .venv/bin/python benchmarks/quotas.py
    .venv/bin/python benchmarks/quotas.py --requests 32 --max-tokens 60 --workers 2

Everything it starts ends by PID, also on failure (the mesh's children die
with it even when it is SIGKILLed; redis-server is stopped in a ``finally``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import redis
from common import OWN_CONNECTION, RedisServer, free_port, refusal_of, running_mesh, served_by_process
from prometheus_client.parser import text_string_to_metric_families

from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh_gateway import hash_key

TENANT = "search"
QUOTA = 1000
"""Tokens per minute: the issue's figure."""
WINDOW_S = 60.0
API_KEY = "sk-quotas-bench"
PROMPT_RESERVED = 3 + 4
"""What the router reserves for a prompt qNN: one token per byte, plus 4 for a raw prompt's special tokens."""


@dataclasses.dataclass
class Burst:
    """What one burst of concurrent generations got."""

    served: int = 0
    """Tokens (prompt + completion) the admitted generations used, as their final chunks (or usage) count them."""
    admitted: int = 0
    refusals: list[str] = dataclasses.field(default_factory=list)
    """One line per refusal: its status and reason, with its retry hint when it has one."""
    retry_hints_s: list[float] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    """Anything that was neither admitted nor refused by the quota."""
    seconds: float = 0.0
    first_refusal_s: float | None = None
    """Seconds from the burst's start to its first refusal (a refusal waits for nothing)."""
    started: float = dataclasses.field(default_factory=time.monotonic)

    def refused(self, kind: str, hint_s: float | None) -> None:
        """Count one refusal: its kind and retry hint (None: it has none)."""
        self.refusals.append(kind)
        if hint_s is not None:
            self.retry_hints_s.append(hint_s)
        if self.first_refusal_s is None:
            self.first_refusal_s = time.monotonic() - self.started

    def line(self) -> str:
        """The burst's figures on one line."""
        hints = (
            f", {len(self.retry_hints_s)} with a retry hint of {min(self.retry_hints_s):.1f}.."
            f"{max(self.retry_hints_s):.1f} s"
            if self.retry_hints_s
            else ""
        )
        kinds = sorted(set(self.refusals))
        return (
            f"served {self.served} tokens (quota {QUOTA}); admitted {self.admitted}, refused {len(self.refusals)}"
            f" ({', '.join(kinds) or '-'}{hints}); other errors {len(self.errors)} {self.errors[:2]};"
            f" first refusal after {self.first_refusal_s or 0:.2f} s, all done after {self.seconds:.1f} s"
        )


async def grpc_burst(address: str, requests: int, max_tokens: int) -> Burst:
    """Concurrent generations of the tenant, each on its own connection (spread over the router processes)."""
    burst = Burst()

    async def one(i: int) -> None:
        request = inference_pb2.GenerateRequest(prompt=f"q{i:02d}", max_tokens=max_tokens, labels={"tenant": TENANT})
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            try:
                chunks = [c async for c in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=300)]
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    burst.errors.append(f"{exc.code().name}: {exc.details()}")
                    return
                burst.refused(*refusal_of(exc))
                return
        burst.admitted += 1
        burst.served += chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens

    await asyncio.gather(*(one(i) for i in range(requests)))
    burst.seconds = time.monotonic() - burst.started
    return burst


async def gateway_burst(url: str, requests: int, max_tokens: int) -> tuple[Burst, dict[int, httpx.Headers]]:
    """The same burst through the gateway's /v1/completions; also the headers of one response per status."""
    burst, headers = Burst(), dict[int, httpx.Headers]()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def one(i: int) -> None:
            body = {"model": "smollm2", "prompt": f"q{i:02d}", "max_tokens": max_tokens}
            response = await http.post("/completions", json=body, headers=auth)
            headers.setdefault(response.status_code, response.headers)
            if response.status_code == 200:
                usage = response.json()["usage"]
                burst.admitted += 1
                burst.served += usage["prompt_tokens"] + usage["completion_tokens"]
            elif response.status_code == 429:
                hint_ms = response.headers.get("retry-after-ms")
                burst.refused(f"429 {response.json()['error']['code']}", int(hint_ms) / 1000 if hint_ms else None)
            else:
                burst.errors.append(f"{response.status_code}: {response.text[:120]}")

        burst.started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(requests)))
        burst.seconds = time.monotonic() - burst.started
    return burst, headers


def router_samples(mesh: Mesh, name: str) -> dict[int, float]:
    """A router metric's value (summed over its labels) per process; process i serves metrics on port + i."""
    base = mesh.metrics_urls["router"]
    port = int(base.rsplit(":", 1)[1].split("/", 1)[0])
    values: dict[int, float] = {}
    for index in range(mesh.config.router_processes):
        text = httpx.get(base.replace(f":{port}/", f":{port + index}/"), timeout=5).text
        values[index] = sum(
            s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
        )
    return values


def redis_count(server: RedisServer) -> int:
    """The tokens Redis counts for the tenant in its window (every slot, refunds applied)."""
    with redis.Redis(port=server.port) as client:
        return sum(int(v) for v in client.hgetall(f"tm:quota:{{{TENANT}}}:tokens").values())


def delta(before: dict[int, int], after: dict[int, int]) -> str:
    """Generations per process between two counts, e.g. ``process 0: 8, process 1: 6``."""
    return ", ".join(f"process {i}: {after[i] - before.get(i, 0)}" for i in sorted(after))


def ratelimit_headers(headers: httpx.Headers | None) -> str:
    """A response's x-ratelimit-* and retry-after headers, one line."""
    if headers is None:
        return "(no such response)"
    return ", ".join(f"{k}: {v}" for k, v in headers.items() if k.startswith(("x-ratelimit-", "retry-after")))


async def settled_count(server: RedisServer, served: int, timeout_s: float = 5.0) -> int:
    """Redis's count once the routers' refunds have reached it (or what it holds after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while (count := redis_count(server)) != served and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return count


async def phase_a(mesh: Mesh, server: RedisServer, args: argparse.Namespace) -> None:
    """The burst through gRPC over both processes, then (a window later) through the gateway."""
    assert mesh.router is not None and mesh.gateway is not None
    address = mesh.router.address
    before = await served_by_process(address)
    started = time.monotonic()
    burst = await grpc_burst(address, args.requests, args.max_tokens)
    print(f"(a) gRPC, {args.requests} at once over 2 router processes: {burst.line()}")
    print(f"    generations served by {delta(before, await served_by_process(address))}")
    print(f"    Redis counts {await settled_count(server, burst.served)} tokens in the window")
    wait_s = started + WINDOW_S * 1.1 + 1 - time.monotonic()  # a reservation counts a window plus one slot
    print(f"    (waiting {wait_s:.0f} s for the window to pass)", flush=True)
    await asyncio.sleep(max(0.0, wait_s))
    before = await served_by_process(address)
    url = str(mesh.gateway.info["url"])
    burst, headers = await gateway_burst(url, args.requests, args.max_tokens)
    print(f"(a) gateway, {args.requests} at once (one API key of {TENANT}): {burst.line()}")
    print(f"    generations served by {delta(before, await served_by_process(address))} (the gateway keeps one")
    print("    connection per router address: one process)")
    print(f"    200: {ratelimit_headers(headers.get(200))}")
    print(f"    429: {ratelimit_headers(headers.get(429))}")


async def phase_b(mesh: Mesh, server: RedisServer, args: argparse.Namespace) -> None:
    """Redis stopped by its PID: each process fails open with its share of the quota."""
    assert mesh.router is not None
    address = mesh.router.address
    pid = server.process.pid if server.process is not None else None
    server.stop()
    before = await served_by_process(address)
    burst = await grpc_burst(address, args.requests, args.max_tokens)
    print(f"(b) Redis (pid {pid}) stopped; gRPC, {args.requests} at once: {burst.line()}")
    print(f"    generations served by {delta(before, await served_by_process(address))} (each process's share:")
    need = PROMPT_RESERVED + args.max_tokens
    print(f"    {QUOTA} / 2 = {QUOTA // 2} tokens, {QUOTA // 2 // need} reservations of {need})")
    up = router_samples(mesh, "tokenmesh_router_quota_store_up")
    print(f"    tokenmesh_router_quota_store_up by process: {up}")


async def phase_c(mesh: Mesh, server: RedisServer, args: argparse.Namespace) -> None:
    """Redis restarted (empty): once both processes count in it again, one shared quota again."""
    assert mesh.router is not None
    address = mesh.router.address
    server.start()
    restarted = time.monotonic()
    while set(router_samples(mesh, "tokenmesh_router_quota_store_up").values()) != {1.0}:
        if time.monotonic() - restarted > 30:
            raise SystemExit("the router processes did not count in the restarted Redis within 30 s")
        await asyncio.sleep(0.2)
    print(f"(c) Redis restarted (pid {server.process.pid if server.process else None}), empty; both router processes")
    print(f"    count in it again after {time.monotonic() - restarted:.1f} s")
    before = await served_by_process(address)
    burst = await grpc_burst(address, args.requests, args.max_tokens)
    print(f"(c) gRPC, {args.requests} at once: {burst.line()}")
    print(f"    generations served by {delta(before, await served_by_process(address))}")
    print(f"    Redis counts {await settled_count(server, burst.served)} tokens in the window")


def mesh_config(args: argparse.Namespace, folder: Path, server: RedisServer) -> MeshConfig:
    """The mesh as `tokenmesh up` starts it, with 2 router processes counting the quota file's quotas in Redis."""
    quotas = folder / "quotas.toml"
    quotas.write_text(f"[tenants]\n{TENANT} = {{ tokens_per_minute = {QUOTA} }}\n")
    keys = folder / "keys"
    keys.write_text(f"{hash_key(API_KEY)} {TENANT}\n")
    env = {
        "TOKENMESH_ROUTER_QUOTA_FILE": str(quotas),
        "TOKENMESH_ROUTER_QUOTA_REDIS_URL": server.url,
        "TOKENMESH_ROUTER_QUOTA_WINDOW_S": str(WINDOW_S),
        "TOKENMESH_ROUTER_METRICS_TENANTS": TENANT,
        "TOKENMESH_GATEWAY_API_KEYS_FILE": str(keys),
    }
    return MeshConfig(workers=args.workers, port=0, router_processes=2, gateway_port=0, metrics=True, extra_env=env)


async def phases(mesh: Mesh, server: RedisServer, args: argparse.Namespace) -> None:
    """(a), (b) and (c), one after the other."""
    await phase_a(mesh, server, args)
    await phase_b(mesh, server, args)
    await phase_c(mesh, server, args)


def main() -> None:
    """Parse the flags, start Redis and the mesh, run the phases; stop both by PID, also on failure."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[1].split("\n    .venv", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=32, help="concurrent generations per burst (default 32)")
    parser.add_argument(
        "--max-tokens", type=int, default=60, help="max_tokens of each (default 60: 67 tokens reserved each)"
    )
    parser.add_argument("--workers", type=int, default=2, help="SmolLM2 workers, each with its Triton (default 2)")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (make test-deps installs Debian's)")
    server = RedisServer(free_port())
    with tempfile.TemporaryDirectory(prefix="tokenmesh-quotas-") as tmp:
        server.start()
        try:
            with running_mesh(mesh_config(args, Path(tmp), server)) as mesh:
                print(f"mesh: {args.workers} SmolLM2 workers, router {mesh.router.address if mesh.router else '?'}")
                print(f"(2 processes), Redis {server.url}; {TENANT}: {QUOTA} tokens per {WINDOW_S:.0f} s")
                asyncio.run(phases(mesh, server, args))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
