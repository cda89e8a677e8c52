"""``tokenmesh bench``: drive the mesh (or Triton directly) and report what callers feel."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmesh.bench import metrics, prompts
from tokenmesh.bench.metrics import RequestResult
from tokenmesh.bench.prompts import Prompt

if TYPE_CHECKING:
    from tokenmesh.bench.runner import Load
    from tokenmesh.bench.targets import MeshTarget, Target


class BenchError(Exception):
    """Bad arguments or an unusable target: one line, exit code 2."""


def add_arguments(
    parser: argparse.ArgumentParser, default_addr: str
) -> None:  # long: an argparse table, a flag per call
    """The bench command's flags."""
    where = parser.add_argument_group("target")
    where.add_argument(
        "--target",
        choices=("mesh", "triton", "openai"),
        default="mesh",
        help="mesh: the routers through tokenmesh.client (default); triton: a Triton model directly; "
        "openai: any OpenAI-compatible endpoint (--url), streamed over HTTP through the --api route",
    )
    where.add_argument(
        "--api",
        choices=("auto", "chat", "completions", "responses", "messages"),
        default="auto",
        help="with --target openai: the route each request streams through, measured the same way for each: "
        "chat (/chat/completions), completions (/completions), responses (OpenAI's Responses API, /responses), "
        "messages (Anthropic's Messages API, /messages); auto (default): chat for prompts with messages, "
        "completions for the others",
    )
    where.add_argument("--addr", default=default_addr, help=f"router host:port (default {default_addr})")
    where.add_argument(
        "--no-batched",
        action="store_true",
        help="mesh: one Inference/Generate call per request, not a stream on each router's shared "
        "GenerateStream call (the client's default)",
    )
    where.add_argument(
        "--triton-url",
        default="",
        help="Triton gRPC host:port, comma-separated for several (each request to the one with "
        "the fewest outstanding: the ideal balancer); with --compare, "
        "default: every worker's Triton, from the router's routing table",
    )
    where.add_argument(
        "--url",
        default="",
        help="with --target openai: the API's base URL, e.g. http://127.0.0.1:8000/v1 (tokenmesh's gateway, vLLM, ...)",
    )
    where.add_argument(
        "--api-key",
        default="",
        help="with --target openai: sent as 'Authorization: Bearer KEY' (default: none; env OPENAI_API_KEY)",
    )
    where.add_argument("--model", default="", help="model name (default: the mesh's default model)")
    where.add_argument(
        "--compare",
        action="store_true",
        help="run the mesh and direct Triton on the same prompts, interleaved, and print mesh/direct",
    )
    where.add_argument(
        "--blocks",
        type=int,
        default=4,
        help="with --compare: alternate the two targets over this many blocks of prompts (default 4)",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="closed loop: requests in flight (default 8); with --request-rate: the most in flight",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s (default: closed loop)",
    )
    load.add_argument("--requests", type=int, default=64, help="measured requests (default 64)")
    load.add_argument(
        "--duration",
        type=float,
        default=None,
        help="send for this many seconds instead of --requests (prompts are cycled)",
    )
    load.add_argument("--warmup", type=int, default=4, help="requests run and discarded first, per target (default 4)")
    load.add_argument("--seed", type=int, default=0, help="seed for prompts, arrivals and sampling (default 0)")
    load.add_argument(
        "--allow-eos",
        action="store_true",
        help="let the model stop before max_tokens (default: generate exactly max_tokens)",
    )

    workload = parser.add_argument_group("prompts")
    workload.add_argument(
        "--prompts",
        default="",
        help='JSONL file, one {"prompt": ...} or {"messages": [...]} per line, optional '
        '"max_tokens" (default: synthetic prompts)',
    )
    workload.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length (default 128)")
    workload.add_argument(
        "--output-tokens",
        type=int,
        default=128,
        help="tokens to generate per request (default 128; the JSONL default too)",
    )
    workload.add_argument(
        "--prefix-groups",
        type=int,
        default=0,
        help="synthetic: prompts share one of this many prefixes (default 0: none)",
    )
    workload.add_argument("--prefix-tokens", type=int, default=0, help="synthetic: length of the shared prefix")

    out = parser.add_argument_group("report")
    out.add_argument("--slo", default="", help="goodput bounds in ms, e.g. ttft=500,tpot=50 (names: ttft, tpot, e2e)")
    out.add_argument("--json", default="", metavar="FILE", help="write every figure (and the ratios) as JSON")
    out.add_argument(
        "--plot", default="", metavar="FILE.png", help="plot the TTFT and ITL distributions and throughput over time"
    )
    out.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="live progress bar on stderr (auto: when stderr is a terminal)",
    )


def _check(args: argparse.Namespace) -> dict[str, float]:
    rules = [
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.request_rate is None or args.request_rate > 0, f"--request-rate must be > 0, got {args.request_rate}"),
        (args.requests >= 1, f"--requests must be >= 1, got {args.requests}"),
        (args.duration is None or args.duration > 0, f"--duration must be > 0, got {args.duration}"),
        (args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}"),
        (args.blocks >= 1, f"--blocks must be >= 1, got {args.blocks}"),
        (args.input_tokens >= 1, f"--input-tokens must be >= 1, got {args.input_tokens}"),
        (args.output_tokens >= 1, f"--output-tokens must be >= 1, got {args.output_tokens}"),
        (not (args.compare and args.target == "triton"), "--compare drives both targets; drop --target triton"),
        (not (args.compare and args.duration), "--compare needs --requests (same prompts for both), not --duration"),
        (args.target != "triton" or bool(args.triton_url), "--target triton needs --triton-url HOST:PORT"),
        (args.target != "triton" or bool(args.model), "--target triton needs --model NAME"),
        (args.target != "openai" or bool(args.url), "--target openai needs --url http://HOST:PORT/v1"),
        (not (args.compare and args.target == "openai"), "--compare drives the mesh and Triton; drop --target openai"),
        (
            args.api == "auto" or args.target == "openai",
            "--api picks a route of --target openai; add it, or drop --api",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise BenchError(message)
    try:
        return metrics.parse_slo(args.slo)
    except ValueError as exc:
        raise BenchError(str(exc)) from None


def _prompt_set(args: argparse.Namespace) -> list[Prompt]:
    try:
        if args.prompts:
            return prompts.read_jsonl(args.prompts, args.output_tokens)
        count = args.requests if not args.duration else max(args.requests, 256)
        return prompts.synthetic(
            count + args.warmup,
            args.input_tokens,
            args.output_tokens,
            args.prefix_groups,
            args.prefix_tokens,
            args.seed,
        )
    except prompts.PromptError as exc:
        raise BenchError(str(exc)) from None


async def _measure(
    target: Target, measured: Sequence[Prompt], load: Load, progress: str, total: int | None
) -> list[RequestResult]:
    from tokenmesh.bench.runner import Progress, drive

    bar = Progress(target.name, total, None if progress == "auto" else progress == "on")
    try:
        return await drive(target, measured, load, bar.update)
    finally:
        bar.close()


async def run(args: argparse.Namespace) -> int:
    """The bench command; BenchError for anything the caller must change."""
    # Imported here: the client libraries are not needed to build the CLI's parser.
    from tokenmesh.bench.runner import Load
    from tokenmesh.bench.targets import MeshTarget, TargetError

    slo = _check(args)
    workload = _prompt_set(args)
    if args.api == "completions" and any(p.messages for p in workload):
        raise BenchError("--api completions takes raw prompts; these prompts have messages (use --api chat)")
    warmup, measured = workload[: args.warmup], workload[args.warmup :] or workload
    if not args.duration:
        measured = [measured[i % len(measured)] for i in range(args.requests)]
    load = Load(concurrency=args.concurrency, request_rate=args.request_rate, duration_s=args.duration, seed=args.seed)
    mesh = MeshTarget(args.addr, args.model, ignore_eos=not args.allow_eos, seed=args.seed, batched=not args.no_batched)
    targets: list[Target] = []
    try:
        await _open_targets(args, mesh, targets)
        measurement = await _measure_targets(args, targets, warmup, measured, load)
    except TargetError as exc:
        raise BenchError(str(exc)) from None
    finally:
        for target in targets:
            await target.close()
        if mesh not in targets:
            await mesh.close()
    _report(args, slo, measurement)
    return 0


async def _open_targets(args: argparse.Namespace, mesh: MeshTarget, targets: list[Target]) -> None:
    """Open the targets the arguments name, adding each to targets (which the caller closes, also on failure)."""
    from tokenmesh.bench.targets import OpenAITarget, TritonTarget

    if args.target == "mesh":
        await mesh.open()
        targets.append(mesh)
    if args.target == "openai":
        endpoint = OpenAITarget(
            args.url,
            args.model,
            api=args.api,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY", ""),
            ignore_eos=not args.allow_eos,
            seed=args.seed,
        )
        targets.append(endpoint)
        await endpoint.open()
    if args.target == "triton" or args.compare:
        urls = [u.strip() for u in args.triton_url.split(",") if u.strip()] or await mesh.triton_endpoints()
        triton = TritonTarget(urls, args.model or mesh.model, ignore_eos=not args.allow_eos, seed=args.seed)
        await triton.open()
        targets.append(triton)


@dataclass
class _Measurement:
    """What the bench measured, by target name."""

    runs: dict[str, list[RequestResult]]
    """Every measured request's result."""
    blocks: dict[str, list[list[RequestResult]]]
    """The results block by block (--compare)."""
    busy: dict[str, float]
    """Seconds each target was measured: with --compare, its own blocks only."""


async def _measure_targets(
    args: argparse.Namespace, targets: list[Target], warmup: Sequence[Prompt], measured: Sequence[Prompt], load: Load
) -> _Measurement:
    """Warm each target up, then measure it (with --compare, in blocks that alternate which target goes first)."""
    from tokenmesh.bench.runner import Load, drive

    done = _Measurement({t.name: [] for t in targets}, {t.name: [] for t in targets}, {t.name: 0.0 for t in targets})
    for target in targets:
        if warmup:
            await drive(target, [p.tagged(target.name) for p in warmup], Load(concurrency=args.concurrency))
    if not args.compare:
        target = targets[0]
        done.runs[target.name] = await _measure(
            target, measured, load, args.progress, None if args.duration else len(measured)
        )
        done.busy[target.name] = metrics.span(done.runs[target.name])
        return done
    # Blocks alternate which target goes first (ABBA...), so neither gains from running second;
    # each target's copy of a prompt is tagged so neither finds the other's KV cache warm.
    size = -(-len(measured) // args.blocks)
    for block in range(args.blocks):
        part = measured[block * size : (block + 1) * size]
        for target in targets if block % 2 == 0 else targets[::-1]:
            tagged = [p.tagged(target.name) for p in part]
            block_results = await _measure(target, tagged, load, args.progress, len(part))
            done.runs[target.name] += block_results
            done.blocks[target.name].append(block_results)
            done.busy[target.name] += metrics.span(block_results)
    return done


def _report(args: argparse.Namespace, slo: dict[str, float], measurement: _Measurement) -> None:
    """Print each target's table (and, with --compare, the ratios); write the JSON and the plot when asked."""
    from tokenmesh.bench import report

    summaries = {
        name: metrics.summarize(results, slo, measurement.busy[name]) for name, results in measurement.runs.items()
    }
    for name, summary in summaries.items():
        print(report.table(name, summary))
    document: dict[str, Any] = {
        "summaries": summaries,
        "arguments": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | None)},
    }
    if args.compare:
        ratios = report.ratios(
            summaries["mesh"], summaries["triton"], measurement.blocks["mesh"], measurement.blocks["triton"]
        )
        print(report.ratio_table(ratios))
        document["mesh_over_direct"] = ratios
    if args.json:
        report.write_json(args.json, document)
    if args.plot:
        report.plot(args.plot, measurement.runs)
    sys.stdout.flush()
