"""What the router costs per token, and the mesh's throughput against a one-hop relay.

Starts the embedded mesh on the synthetic Triton model (``tokenmesh up
--model synthetic``: 1,000 tokens/s per stream in 5-token responses) and the
baseline from ``relay.py`` (a source streaming the same way, and one Python
grpc.aio relay in front of it). Then, interleaved (relay, mesh, mesh, relay,
...), drives each with --concurrency closed-loop streams of --tokens tokens
through ``Inference/Generate``, and prints per target the output tokens/s and
the CPU per token of the hop in the middle (the router for the mesh, the relay
for the baseline), measured from /proc, and for the mesh the workers' CPU per
token too. Offered load = concurrency x --tokens-per-s. Targets: router <= 8
us/token at 24k tokens/s offered; mesh throughput >= 0.97x the relay's.

--tokens-per-s 100 --responses-per-s 100 measures the low-rate case (one
token per message, each message waking an idle process). --steps shared puts
every stream's engine responses on one step clock (a batched engine's, as
gateway.py's --steps shared); own (default) keeps each stream on its phase.
--telemetry adds a third target: the same mesh with metrics and traces on.
--api picks the caller's path to the mesh: ``stream`` (the client's default:
every stream on one shared ``Inference/GenerateStream`` call per router) or
``generate`` (one ``Inference/Generate`` call per stream); the relay serves
Generate only.

    .venv/bin/python benchmarks/router_cost.py --concurrency 24
    .venv/bin/python benchmarks/router_cost.py --concurrency 1 --tokens-per-s 100 --responses-per-s 100 --tokens 300
    .venv/bin/python benchmarks/router_cost.py --concurrency 16 --tokens-per-s 200 --responses-per-s 200 --api generate
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from common import (
    client_credentials,
    cpu_seconds,
    free_port,
    running_mesh,
    start_relay,
    synthetic_repository,
    tree_cpu_seconds,
)

from tokenmesh.bench.metrics import RequestResult, summarize
from tokenmesh.bench.prompts import synthetic
from tokenmesh.bench.runner import Load, drive
from tokenmesh.bench.targets import MeshTarget
from tokenmesh.certs import make_dev_certs
from tokenmesh.mesh import Mesh, MeshConfig
from tokenmesh.process import stop_process


async def measure(
    addr: str,
    hop_pid: int,
    args: argparse.Namespace,
    workers: list[int],
    credentials: grpc.ChannelCredentials | None = None,
    *,
    batched: bool = True,
) -> tuple[list[RequestResult], float, float]:
    """Results, the hop's CPU seconds and the workers' (not their Tritons') for one closed-loop run."""
    target = MeshTarget(addr, ignore_eos=True, credentials=credentials, batched=batched)
    await target.open()
    try:
        prompts = synthetic(args.requests, 16, args.tokens, seed=1)
        await drive(target, prompts[: args.concurrency], Load(concurrency=args.concurrency))  # warm-up
        before, workers_before = tree_cpu_seconds(hop_pid), cpu_seconds(workers)
        results = await drive(target, prompts, Load(concurrency=args.concurrency))
        return results, tree_cpu_seconds(hop_pid) - before, cpu_seconds(workers) - workers_before
    finally:
        await target.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=24, help="streams at once (x 1,000 tokens/s offered)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per stream")
    parser.add_argument("--requests", type=int, default=72, help="streams per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per target, interleaved")
    parser.add_argument("--router-processes", type=int, default=1, help="router processes (their CPU is summed)")
    parser.add_argument("--tokens-per-s", type=float, default=1000.0, help="per stream (default 1000)")
    parser.add_argument(
        "--responses-per-s",
        type=float,
        default=200.0,
        help="engine responses (messages) per second per stream (default 200: 5 tokens each)",
    )
    parser.add_argument(
        "--api",
        choices=("stream", "generate"),
        default="stream",
        help="the mesh's callers: stream = one GenerateStream call per router for every stream (the client's "
        "default); generate = one Generate call per stream (default stream)",
    )
    parser.add_argument(
        "--steps",
        choices=("own", "shared"),
        default="own",
        help="the synthetic engine's responses: each stream on its own phase (default), or every stream's on one "
        "step clock, as a batched engine's (the relay's source stays on its own phases)",
    )
    parser.add_argument(
        "--links",
        default="",
        help="comma-separated worker-link variants, each a mesh of its own in the same alternation in place of "
        "'mesh': off, auto, or auto:<linger us> (e.g. off,auto,auto:500); empty: one mesh as the environment says",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="also measure a second mesh with mutual TLS on every hop (tokenmesh certs identities), "
        "in the same alternation: the cost of mTLS",
    )
    parser.add_argument(
        "--telemetry",
        action="store_true",
        help="also measure a second mesh with Prometheus metrics on (scraped every 5 s) and "
        "OpenTelemetry traces exported to an OTLP receiver in this process, in the same "
        "alternation: the cost of telemetry",
    )
    args = parser.parse_args()

    chunk_tokens = max(1, round(args.tokens_per_s / args.responses_per_s))
    source_port, relay_port = free_port(), free_port()
    source = start_relay(
        "source",
        "--port",
        str(source_port),
        "--tokens-per-s",
        str(args.tokens_per_s),
        "--chunk-tokens",
        str(chunk_tokens),
    )
    relay = start_relay("relay", "--port", str(relay_port), "--upstream", f"127.0.0.1:{source_port}")
    variants = [v for v in args.links.split(",") if v]
    meshes = [f"link-{v}" for v in variants] or ["mesh"]
    names = ["relay", *meshes, *(["telemetry"] if args.telemetry else []), *(["mtls"] if args.tls else [])]
    credentials: dict[str, grpc.ChannelCredentials] = {}
    runs: dict[str, list[tuple[list[RequestResult], float, float]]] = {name: [] for name in names}
    folder = tempfile.TemporaryDirectory()
    try:
        repository = synthetic_repository(
            Path(folder.name),
            tokens_per_s=args.tokens_per_s,
            responses_per_s=args.responses_per_s,
            shared_steps=int(args.steps == "shared"),
        )
        config = MeshConfig(port=0, model_repository=str(repository), router_processes=args.router_processes)
        with contextlib.ExitStack() as stack:
            hops: dict[str, tuple[str, int, list[int]]] = {"relay": (f"127.0.0.1:{relay_port}", relay.pid, [])}
            for name, variant in zip(meshes, variants or [""], strict=True):
                mode, _, linger = variant.partition(":")
                env = {"TOKENMESH_ROUTER_WORKER_LINK": mode, "TOKENMESH_WORKER_LINK_LINGER_US": linger or "0"}
                mesh = stack.enter_context(
                    running_mesh(dataclasses.replace(config, extra_env=env) if variant else config)
                )
                assert mesh.router is not None
                hops[name] = (mesh.router.address, mesh.router.proc.pid, [w.proc.pid for w in mesh.workers])
            if args.telemetry:
                endpoint = stack.enter_context(otlp_receiver())
                env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
                metered = stack.enter_context(running_mesh(dataclasses.replace(config, metrics=True, extra_env=env)))
                assert metered.router is not None
                hops["telemetry"] = (
                    metered.router.address,
                    metered.router.proc.pid,
                    [w.proc.pid for w in metered.workers],
                )
                stack.enter_context(scraping(metered))
            if args.tls:
                tls_dir = str(make_dev_certs(Path(folder.name) / "certs"))
                secured = stack.enter_context(running_mesh(dataclasses.replace(config, tls_dir=tls_dir)))
                assert secured.router is not None
                hops["mtls"] = (secured.router.address, secured.router.proc.pid, [w.proc.pid for w in secured.workers])
                credentials["mtls"] = client_credentials(tls_dir)
            for round_ in range(args.rounds):
                order = names[round_ % len(names) :] + names[: round_ % len(names)]
                for name in order:
                    addr, pid, workers = hops[name]
                    batched = name != "relay" and args.api == "stream"  # the relay serves Generate only
                    runs[name].append(
                        asyncio.run(measure(addr, pid, args, workers, credentials.get(name), batched=batched))
                    )
                    print(f"  {name}: round {round_ + 1} done", flush=True)
    finally:
        for proc in (relay, source):
            stop_process(proc, 5)
        folder.cleanup()

    print(
        f"\n{args.requests} streams of {args.tokens} tokens per run, concurrency {args.concurrency} "
        f"(offered {args.concurrency * args.tokens_per_s:,.0f} tokens/s in {chunk_tokens}-token messages), "
        f"{args.rounds} runs each; the mesh's callers on "
        f"Inference/{'GenerateStream' if args.api == 'stream' else 'Generate'}; engine steps {args.steps}; "
        + (
            "link-<mode>[:<linger us>] meshes alternated"
            if variants
            else f"worker link {os.environ.get('TOKENMESH_ROUTER_WORKER_LINK', 'default')}, "
            f"linger {os.environ.get('TOKENMESH_WORKER_LINK_LINGER_US', 'default')} us"
        )
    )
    print(
        f"{'target':14} {'tokens/s':>10} {'hop us/token':>13} {'per run':>16} {'workers us/token':>17} "
        f"{'interrupted':>12} {'tokens/chunk':>13}"
    )
    rates, hop_cost = {}, {}
    for name, measured in runs.items():
        results = [r for rs, _, _ in measured for r in rs]
        seconds = sum(summarize(rs)["duration_s"] for rs, _, _ in measured)
        tokens = sum(r.output_tokens for r in results if r.ok)
        per_run = [c / max(1, sum(r.output_tokens for r in rs if r.ok)) * 1e6 for rs, c, _ in measured]
        cpu, worker_cpu = sum(c for _, c, _ in measured), sum(w for _, _, w in measured)
        rates[name] = tokens / seconds
        hop_cost[name] = cpu / tokens
        chunk = summarize(results)["tokens_per_chunk"]
        workers = f"{worker_cpu / tokens * 1e6:17.2f}" if name != "relay" else f"{'':17}"
        print(
            f"{name:14} {rates[name]:10.0f} {cpu / tokens * 1e6:13.2f} "
            f"{min(per_run):7.2f}..{max(per_run):<7.2f} {workers} "
            f"{sum(not r.ok for r in results):>12} {chunk['mean'] if chunk else 0:13.2f}"
        )
    for name in meshes:
        print(f"{name} / relay throughput: {rates[name] / rates['relay']:.3f} (target >= 0.97)")
    print("router us/token target <= 8")
    if args.tls:
        print(
            f"mtls / plaintext throughput: {rates['mtls'] / rates['mesh']:.3f} (target >= 0.9); router CPU per "
            f"token: {hop_cost['mtls'] / hop_cost['mesh'] - 1:+.1%}"
        )
    if args.telemetry:
        print(
            f"telemetry on / off throughput: {rates['telemetry'] / rates['mesh']:.3f} (target >= 0.95); router "
            f"CPU per token: {hop_cost['telemetry'] / hop_cost['mesh'] - 1:+.1%} (target <= +10%); "
            f"{RECEIVED[0]} spans received"
        )


RECEIVED = [0]
"""Spans the in-process OTLP receiver got."""


@contextlib.contextmanager
def otlp_receiver() -> Iterator[str]:
    """An OTLP/gRPC trace receiver on a thread of its own (counts the spans); yields its endpoint."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Count(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - gRPC method name
            RECEIVED[0] += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Count(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)


@contextlib.contextmanager
def scraping(mesh: Mesh, every_s: float = 5.0) -> Iterator[None]:
    """GET every service's /metrics every every_s seconds (as Prometheus would) while the block runs."""
    urls = list(mesh.metrics_urls.values())
    done = threading.Event()

    def scrape() -> None:
        while not done.wait(every_s):
            for url in urls:
                urllib.request.urlopen(url, timeout=5).read()  # noqa: S310 - our own loopback endpoint

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


if __name__ == "__main__":
    main()
