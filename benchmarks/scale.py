"""Thousands of slow streams through one router process: memory, CPU and timing per open stream.

Starts the embedded mesh (one router process, --workers workers) on the
synthetic Triton model at --rate tokens/s per stream (one token per
response), with enough slots for every stream. Then ramps the open streams
in steps (--levels, default 1000,5000,10000): each step is a client process
(grpc.aio, in its own process so the router's CPU is its own) that opens its
streams at --ramp-per-s, so their tokens arrive spread over the second. With
--api stream (default) the client process runs one ``tokenmesh.client.Client``
per 1,000 streams, each with its one shared ``Inference/GenerateStream`` call
(no retries or resumes: every failure counts); with --api generate, raw stubs,
one ``Inference/Generate`` call per stream. At each level, after --settle-s,
it measures for --window-s:

- router RSS per open stream: (RSS now - RSS before any stream) / open streams;
- router CPU per relayed token: router CPU seconds over the tokens the clients received in the window;
- p50/p99 inter-chunk gap (nominal 1000/rate ms) of the chunks that arrived in the window;
- the CPU of each part of the mesh (router, prober, workers, their Tritons with model stubs).

Every stream is sized to end at one moment after the last window; at the end
it prints the streams completed and errors (any error, seq gap or token
count short of max_tokens counts). Targets (issue 11): 10,000 streams, no
error, <= 20 KB router RSS per open stream, p99 gap at 10k within 10 ms of
the 1k figure.

    .venv/bin/python benchmarks/scale.py
    .venv/bin/python benchmarks/scale.py --levels 500,2000 --workers 2 --window-s 10
    .venv/bin/python benchmarks/scale.py --levels 1000,5000,10000 --api generate
    .venv/bin/python benchmarks/scale.py --levels 1000,5000,10000 --api triton   # the engines alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
import tritonclient.grpc.aio as triton_aio
from common import cpu_seconds, percentile, running_mesh, synthetic_repository, tree_cpu_seconds

from tokenmesh.bench.targets import MeshTarget, read_response, stream_inputs
from tokenmesh.client import Client
from tokenmesh.errors import MeshError, Unavailable
from tokenmesh.mesh import MeshConfig
from tokenmesh.process import dies_with_parent, stop_process
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

STREAMS_PER_CHANNEL = 1000
"""Client side: streams sharing one HTTP/2 connection (as many callers behind one service do)."""

Opener = Callable[[int, inference_pb2.GenerateRequest, float], AsyncIterator[inference_pb2.GenerateChunk]]
"""Opens stream i of a client process: (i, request, timeout) -> its chunks."""


class DirectTriton:
    """The engines alone: every stream straight to a worker's Triton, one multiplexed ``stream_infer`` per 1,000.

    Triton's decoupled streaming carries many requests on one call (responses
    name their request id), so this is the engines' cheapest path: what the
    machine can do with no mesh in between, at the same streams and rate.
    """

    def __init__(self, urls: list[str], model: str, groups: int) -> None:
        self.model = model
        self.clients = [triton_aio.InferenceServerClient(urls[g % len(urls)]) for g in range(groups)]
        self.outgoing: list[asyncio.Queue[dict[str, Any] | None]] = [asyncio.Queue() for _ in range(groups)]
        self.waiting: dict[str, asyncio.Queue[Any]] = {}
        self.readers = [asyncio.create_task(self._read(c, q)) for c, q in zip(self.clients, self.outgoing, strict=True)]

    async def _read(self, client: triton_aio.InferenceServerClient, outgoing: asyncio.Queue[Any]) -> None:
        async def requests() -> AsyncIterator[dict[str, Any]]:
            while (item := await outgoing.get()) is not None:
                yield item

        async for response, error in client.stream_infer(requests()):
            if error is not None:  # not tied to a request: every stream of this call fails
                for queue in self.waiting.values():
                    queue.put_nowait(error)
                return
            self.waiting[response.get_response().id].put_nowait(response)

    async def generate(
        self, i: int, request: inference_pb2.GenerateRequest, timeout: float
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """Stream i's responses as the mesh's chunks (seq, text, tokens, LENGTH at the end)."""
        del timeout  # the stream's end is planned; a stuck one shows as missing tokens
        inputs = stream_inputs(request.prompt, {"max_tokens": request.max_tokens, "ignore_eos": True})
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting[request.request_id] = queue
        self.outgoing[i % len(self.outgoing)].put_nowait(
            {"model_name": self.model, "inputs": inputs, "request_id": request.request_id}
        )
        seq, counted = 0, 0
        try:
            while True:
                response = await queue.get()
                if isinstance(response, Exception):
                    raise Unavailable(f"Triton: {response}")
                text, reported, final = read_response(response)
                tokens = reported if reported is not None else (1 if text else 0)
                count = max(tokens - counted, 0) if final else tokens
                counted += count
                seq += 1
                yield inference_pb2.GenerateChunk(
                    seq=seq,
                    text=text,
                    token_count=count if text else 0,
                    finish_reason=inference_pb2.FINISH_REASON_LENGTH if final else 0,
                )
                if final:
                    return
        finally:
            del self.waiting[request.request_id]

    async def close(self) -> None:
        """End every call and close the clients."""
        for queue in self.outgoing:
            queue.put_nowait(None)
        await asyncio.gather(*self.readers, return_exceptions=True)
        for each in self.clients:
            await each.close()


async def openers(args: argparse.Namespace) -> tuple[Opener, list[Any]]:
    """How the client process opens its streams (--api), and what to close at its end."""
    groups = math.ceil(args.streams / STREAMS_PER_CHANNEL)
    if args.api == "triton":
        target = MeshTarget(args.addr)
        await target.open()
        direct = DirectTriton(await target.triton_endpoints(), target.model, groups)
        await target.close()
        return direct.generate, [direct]
    if args.api == "stream":  # no retry and no resume: a failure is counted, as on the raw Generate path
        clients = [Client(args.addr, retry_deadline_s=0, max_resumes=0) for _ in range(groups)]
        return (lambda i, request, timeout: clients[i % groups].generate(request, timeout=timeout)), clients
    channels = [grpc.aio.insecure_channel(args.addr) for _ in range(groups)]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in channels]
    return (lambda i, request, timeout: stubs[i % groups].Generate(request, timeout=timeout)), channels


async def client(args: argparse.Namespace) -> None:
    """One ramp step: open --streams streams, report when all are open, write what arrived when."""
    open_stream, closing = await openers(args)
    arrivals, tokens, gaps, gap_at = array("d"), array("i"), array("d"), array("d")
    errors: Counter[str] = Counter()
    failed_at: list[float] = []
    completed = 0

    async def one(i: int) -> None:
        nonlocal completed
        wanted = max(1, int((args.end_at - time.time()) * args.rate))
        request = inference_pb2.GenerateRequest(
            prompt=f"stream {i}", max_tokens=wanted, ignore_eos=True, request_id=f"{args.tag}-{i}"
        )
        expected, last, received = 1, 0.0, 0
        try:
            async for chunk in open_stream(i, request, args.end_at - time.time() + 120):
                now = time.monotonic()
                if chunk.seq != expected:
                    errors["SEQ_GAP"] += 1
                    return
                expected += 1
                if chunk.text:
                    if last:
                        gaps.append(now - last)
                        gap_at.append(now)
                    last = now
                    arrivals.append(now)
                    tokens.append(chunk.token_count)
                    received += chunk.token_count
                if chunk.finish_reason:
                    if chunk.finish_reason != inference_pb2.FINISH_REASON_LENGTH or received != wanted:
                        errors[f"ENDED_{inference_pb2.FinishReason.Name(chunk.finish_reason)}_{received}/{wanted}"] += 1
                    else:
                        completed += 1
        except grpc.aio.AioRpcError as exc:
            errors[f"{exc.code().name}: {(exc.details() or '')[:80]}"] += 1
            failed_at.append(time.time())
        except MeshError as exc:  # --api stream: the client's errors
            errors[f"{exc.grpc_code.name}: {exc.message[:80]}"] += 1
            failed_at.append(time.time())

    tasks = []
    for i in range(args.streams):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(1 / args.ramp_per_s)
    print(f"open {args.streams}", flush=True)
    await asyncio.gather(*tasks)
    for each in closing:
        await each.close()
    Path(args.out).write_text(
        json.dumps(
            {
                "arrivals": list(arrivals),
                "tokens": list(tokens),
                "gaps": list(gaps),
                "gap_at": list(gap_at),
                "errors": dict(errors),
                "failed_at": failed_at,
                "end_at": args.end_at,
                "completed": completed,
                "streams": args.streams,
            }
        )
    )


def spawn_client(
    addr: str, streams: int, end_at: float, out: Path, tag: str, args: argparse.Namespace
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        __file__,
        "--client",
        "--addr",
        addr,
        "--streams",
        str(streams),
        "--end-at",
        str(end_at),
        "--out",
        str(out),
        "--tag",
        tag,
        "--rate",
        str(args.rate),
        "--ramp-per-s",
        str(args.ramp_per_s),
        "--api",
        args.api,
    ]
    return subprocess.Popen(dies_with_parent(cmd), stdout=subprocess.PIPE, text=True)  # noqa: S603


def part_cpu_seconds(parts: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each part of the mesh (an engine: Triton and its model stubs)."""
    return {
        name: sum(map(tree_cpu_seconds, pids)) if name == "engines" else cpu_seconds(pids)
        for name, pids in parts.items()
    }


def orchestrate(args: argparse.Namespace) -> None:
    steps = [b - a for a, b in zip([0, *args.levels], args.levels, strict=False)]
    # Planned time: ramps, settles, windows; every stream ends after the last window (+ slack).
    planned = sum(s / args.ramp_per_s for s in steps) + len(steps) * (args.settle_s + args.window_s) + 30
    slots = math.ceil(args.levels[-1] / args.workers) + 64
    with tempfile.TemporaryDirectory() as folder:
        repository = synthetic_repository(
            Path(folder),
            ttft_ms=5,
            tokens_per_s=args.rate,
            responses_per_s=args.rate,
            n_parallel=slots,
            n_ctx=slots * 4096,
        )
        config = MeshConfig(
            workers=args.workers,
            port=0,
            model_repository=str(repository),
            log_dir=args.log_dir,
            extra_env={
                "TOKENMESH_ROUTER_MAX_QUEUE": str(args.levels[-1]),
                # A slow stream is not a stalled one: 3 gaps without a token.
                "TOKENMESH_ROUTER_STALL_TIMEOUT_S": str(max(5.0, 3 / args.rate)),
            },
        )
        with running_mesh(config) as mesh:
            assert mesh.router is not None
            router = psutil.Process(mesh.router.proc.pid)
            assert mesh.prober is not None
            parts = {
                "router": [mesh.router.proc.pid],
                "prober": [mesh.prober.proc.pid],
                "workers": [w.proc.pid for w in mesh.workers],
                "engines": [int(w.info["triton_pid"]) for w in mesh.workers],
            }  # each Triton with its stub
            time.sleep(2)
            base_rss = router.memory_info().rss
            end_at = time.time() + planned
            clients: list[subprocess.Popen[str]] = []
            outputs: list[Path] = []
            windows: list[dict[str, Any]] = []
            try:
                for level, step in zip(args.levels, steps, strict=True):
                    out = Path(folder) / f"client-{level}.json"
                    outputs.append(out)
                    ramp_start = time.monotonic()
                    clients.append(spawn_client(mesh.router.address, step, end_at, out, f"l{level}", args))
                    line = clients[-1].stdout.readline() if clients[-1].stdout else ""
                    ramp_s = time.monotonic() - ramp_start
                    if not line.startswith("open"):
                        raise SystemExit(f"the client for level {level} failed: {line!r}")
                    time.sleep(args.settle_s)
                    mesh0, t0 = part_cpu_seconds(parts), time.monotonic()
                    time.sleep(args.window_s)
                    mesh1, t1 = part_cpu_seconds(parts), time.monotonic()
                    late = time.time() > end_at - 5  # the streams were planned to end by now: the window ran short
                    windows.append(
                        {
                            "level": level,
                            "start": t0,
                            "end": t1,
                            "rss": router.memory_info().rss,
                            "cpu": {name: mesh1[name] - mesh0[name] for name in parts},
                        }
                    )
                    print(f"  {level} open: {step} opened in {ramp_s:.1f} s, measured {t1 - t0:.0f} s", flush=True)
                    if late:
                        print(
                            "  the ramp ran past the planned end of the streams (the machine is saturated, or raise "
                            "--ramp-per-s): this level's window is cut short; no further level",
                            flush=True,
                        )
                        break
                for proc in clients:
                    proc.wait(timeout=planned + 180)
            finally:
                for proc in clients:
                    stop_process(proc, 5)
        results = [json.loads(p.read_text()) for p in outputs if p.exists()]
    report(args, windows, results, base_rss)


def report(
    args: argparse.Namespace, windows: list[dict[str, Any]], results: list[dict[str, Any]], base_rss: int
) -> None:
    arrivals = [a for r in results for a in r["arrivals"]]
    tokens = [t for r in results for t in r["tokens"]]
    api = {
        "stream": "GenerateStream (tokenmesh.client)",
        "generate": "Generate (raw stubs)",
        "triton": "no mesh: straight to the Tritons",
    }[args.api]
    print(f"\n{args.workers} workers, {args.rate:g} tokens/s per stream, one router process; callers on {api}")
    print(
        f"{'open':>7} {'RSS/stream':>11} {'router us/token':>16} {'tokens/s':>9} {'gap p50 ms':>11} "
        f"{'gap p99 ms':>11}   CPU, % of one core: router prober workers engines"
    )
    per_chunk = list(zip(arrivals, tokens, strict=True))
    gaps_at = [(a, g) for r in results for a, g in zip(r["gap_at"], r["gaps"], strict=True)]  # dated by its end
    figures = []
    for w in windows:
        got = sum(t for a, t in per_chunk if w["start"] <= a < w["end"])
        gaps = [g * 1000 for a, g in gaps_at if w["start"] <= a < w["end"] and g < 60]
        seconds = w["end"] - w["start"]
        row = {
            "open": w["level"],
            "rss_per_stream_kb": (w["rss"] - base_rss) / w["level"] / 1024,
            "router_us_per_token": w["cpu"]["router"] / max(got, 1) * 1e6,
            "tokens_per_s": got / seconds,
            "gap_p50_ms": percentile(gaps, 50) if gaps else float("nan"),
            "gap_p99_ms": percentile(gaps, 99) if gaps else float("nan"),
            "cpu_percent": {name: 100 * c / seconds for name, c in w["cpu"].items()},
        }
        figures.append(row)
        print(
            f"{row['open']:>7} {row['rss_per_stream_kb']:>8.1f} KB {row['router_us_per_token']:>16.1f} "
            f"{row['tokens_per_s']:>9.0f} {row['gap_p50_ms']:>11.1f} {row['gap_p99_ms']:>11.1f}   "
            + " ".join(f"{row['cpu_percent'][name]:.0f}" for name in ("router", "prober", "workers", "engines"))
        )
    errors: Counter[str] = Counter()
    for r in results:
        for message, count in r["errors"].items():  # one line per kind, not per generation
            errors[re.sub(r"generation \S+ ", "generation <id> ", message)] += count
    completed = sum(r["completed"] for r in results)
    for r in results:
        if r["failed_at"]:
            print(
                f"  client of {r['streams']} streams: {len(r['failed_at'])} failed, "
                f"{min(r['failed_at']) - r['end_at']:+.1f}..{max(r['failed_at']) - r['end_at']:+.1f} s "
                "from the planned end"
            )
    print(f"streams completed: {completed}/{sum(r['streams'] for r in results)}; errors: {dict(errors) or 'none'}")
    if len(figures) > 1:
        print(
            f"p99 gap at {figures[-1]['open']} - at {figures[0]['open']}: "
            f"{figures[-1]['gap_p99_ms'] - figures[0]['gap_p99_ms']:+.1f} ms (target <= 10)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"levels": figures, "errors": dict(errors), "completed": completed}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1000, 5000, 10000],
        help="open streams at each step, ascending (default 1000,5000,10000)",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers, each with its own Triton (default 2)")
    parser.add_argument("--rate", type=float, default=1.0, help="tokens/s per stream (default 1)")
    parser.add_argument("--ramp-per-s", type=float, default=500.0, help="streams opened per second (default 500)")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait after each ramp (default 5)")
    parser.add_argument("--window-s", type=float, default=15.0, help="measurement window per level (default 15)")
    parser.add_argument("--json", default="", help="write the figures here")
    parser.add_argument("--log-dir", default="", help="keep the services' logs here (default: a temporary folder)")
    parser.add_argument(
        "--api",
        choices=("stream", "generate", "triton"),
        default="stream",
        help="the callers: stream = tokenmesh.client, one GenerateStream call per 1,000 streams (the client's "
        "default); generate = one Generate call per stream on raw stubs; triton = no mesh, straight to the workers' "
        "Tritons, one multiplexed stream_infer call per 1,000 streams: what the engines do alone (default stream)",
    )
    client_side = parser.add_argument_group("client process (internal)")
    client_side.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    client_side.add_argument("--addr", help=argparse.SUPPRESS)
    client_side.add_argument("--streams", type=int, help=argparse.SUPPRESS)
    client_side.add_argument("--end-at", type=float, help=argparse.SUPPRESS)
    client_side.add_argument("--out", help=argparse.SUPPRESS)
    client_side.add_argument("--tag", default="s", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client(args))
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
