"""Routing policies side by side on a shared-prefix workload: prefix vs round-robin vs least-loaded.

For each policy, starts the embedded mesh (--workers workers, real Triton +
SmolLM2, fresh KV caches) and sends --requests chat requests, closed loop at
--concurrency: each has one of --prompts distinct system prompts of about
--system-tokens tokens and a short user turn. Prints TTFT p50/p99 (time to
the first chunk with text), output-token throughput, and the ratio of
prefix's TTFT p50 to round-robin's (target <= 0.25). Also prints the weight
propagation time (prober decision -> router applied) p50/p99 seen during the
runs (target p99 <= 50 ms on loopback).

With --sessions N it measures session affinity instead, on one mesh (policy
prefix): N multi-turn chats at once, --turns turns each (every turn sends the
whole history: a distinct system prompt of about --system-tokens tokens, the
user turns and the model's answers so far), in --blocks alternating blocks of
fresh chats with a session key (labels["session"]) and without one (the
prefix rule), each chat waiting --think-s between an answer and its next
turn (a closed loop: a policy whose turns are slow offers less load, which
flatters its own p50), or with --turn-every-s on a fixed schedule that both
arms share (an open loop: the same load offered to each; pick a period the
workers can carry, or the turns queue and it is a closed loop again). Prints
the turns each worker served per block, TTFT p50/p99 of the turns after the
first for each, the router's placement counts and the ratio session / prefix
of their p50 (target <= 1.0).

    .venv/bin/python benchmarks/routing.py --requests 24
    .venv/bin/python benchmarks/routing.py --sessions 8 --turns 4 --blocks 4
    .venv/bin/python benchmarks/routing.py --sessions 4 --turns 4 --blocks 8 --max-tokens 16 \
        --system-tokens 600 --turn-every-s 20
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
from common import percentile, running_mesh

from tokenmesh.mesh import MeshConfig
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc

WORDS = (
    "river mountain lantern orchard harbor meadow compass glacier violet ember canyon willow "
    "quartz falcon prairie lagoon summit cedar marble thunder"
).split()


def system_prompt(k: int, tokens: int) -> str:
    """A distinct system prompt of about `tokens` tokens (one rule is about 13 SmolLM2 tokens)."""
    rng = random.Random(k)
    words = [f"Policy {k}."]
    while len(words) * 13 < tokens:
        words.append(f"Rule {len(words)}: keep the {rng.choice(WORDS)} near the {rng.choice(WORDS)}.")
    return " ".join(words)


def run_policy(policy: str, args: argparse.Namespace, prompts: list[str], order: list[tuple[int, int]]) -> dict:
    env = {"TOKENMESH_ROUTER_POLICY": policy, "TOKENMESH_ROUTER_QUEUE_TIMEOUT_S": "600"}
    with running_mesh(MeshConfig(workers=args.workers, port=0, extra_env=env)) as mesh:
        assert mesh.router is not None
        channel = grpc.insecure_channel(mesh.router.address)
        stub = inference_pb2_grpc.InferenceStub(channel)
        operator = router_pb2_grpc.RouterStub(channel)
        propagation: list[float] = []
        stop = threading.Event()

        def watch_tables() -> None:
            seen = 0
            while not stop.wait(0.02):
                table = operator.GetRoutingTable(router_pb2.GetRoutingTableRequest())
                if table.version != seen:
                    seen = table.version
                    propagation.append(table.propagation_ms)

        watcher = threading.Thread(target=watch_tables)
        watcher.start()

        def one(item: tuple[int, int]) -> tuple[float, int]:
            k, j = item
            request = inference_pb2.GenerateRequest(
                messages=[
                    inference_pb2.ChatMessage(role="system", content=prompts[k]),
                    inference_pb2.ChatMessage(role="user", content=f"Which rule mentions number {j}?"),
                ],
                max_tokens=args.max_tokens,
                ignore_eos=True,
                temperature=0,
            )
            sent, ttft, tokens = time.monotonic(), float("nan"), 0
            for chunk in stub.Generate(request, timeout=900):
                if chunk.text and ttft != ttft:
                    ttft = time.monotonic() - sent
                tokens += chunk.token_count
            return ttft, tokens

        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, order))
        elapsed = time.monotonic() - started
        stop.set()
        watcher.join()
        channel.close()
    ttfts = [r[0] for r in results]
    return {
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tok_s": sum(r[1] for r in results) / elapsed,
        "elapsed": elapsed,
        "propagation": propagation,
    }


class Turn(NamedTuple):
    """One turn of a chat as its caller saw it (``--dump`` writes these)."""

    ttft_s: float
    cached: int
    """Prompt tokens llama.cpp reused from its cache."""
    prompt: int
    engine_ttft_ms: float
    """The engine's own TTFT (the mesh's final chunk timing)."""
    sent_s: float
    """When it was sent, from its block's start."""
    late_s: float
    """How long after its due time it was sent (with --turn-every-s; else 0)."""


def chat_turns(
    stub: inference_pb2_grpc.InferenceStub, args: argparse.Namespace, system: str, key: str, chat: int, start: float
) -> list[Turn]:
    """One conversation, turn after turn, each with the whole history."""
    history = [inference_pb2.ChatMessage(role="system", content=system)]
    turns = []
    for turn in range(args.turns):
        due = time.monotonic()
        if args.turn_every_s:
            # Open loop: turn i is due at the chat's phase + i periods whatever the answers took (no sooner than the
            # previous answer's end), so both arms offer the same load and a slow turn does not thin out the others'.
            due = start + args.turn_every_s * (chat / args.sessions + turn)
            time.sleep(max(0.0, due - time.monotonic()))
        elif turn:
            time.sleep(args.think_s)  # the person reads the answer and types the next turn
        history.append(inference_pb2.ChatMessage(role="user", content=f"Turn {turn}: which rules name a river?"))
        request = inference_pb2.GenerateRequest(
            messages=history, max_tokens=args.max_tokens, ignore_eos=True, temperature=0
        )
        if key:
            request.labels["session"] = key
        sent, ttft, answer, usage = time.monotonic(), float("nan"), [], inference_pb2.Usage()
        engine_ttft_ms = float("nan")
        for chunk in stub.Generate(request, timeout=900):
            if chunk.text and ttft != ttft:
                ttft = time.monotonic() - sent
            if chunk.timing.HasField("engine_ttft_ms"):
                engine_ttft_ms = chunk.timing.engine_ttft_ms
            answer.append(chunk.text)
            if chunk.HasField("usage"):
                usage = chunk.usage
        turns.append(
            Turn(
                ttft,
                usage.cached_prompt_tokens,
                usage.prompt_tokens,
                engine_ttft_ms,
                sent - start,
                max(0.0, sent - due),
            )
        )
        history.append(inference_pb2.ChatMessage(role="assistant", content="".join(answer)))
    return turns


def run_sessions(args: argparse.Namespace) -> None:
    """Session key vs prefix rule on multi-turn chats, alternating blocks on one mesh (see the module's doc)."""
    # A cold prefill queued behind others on a loaded CPU can take longer than the 30 s TTFT limit, and a CPU
    # engine computing one holds every other stream on its worker longer than the 5 s stall limit (llama.cpp
    # decodes them in the same step): a failover then would measure the limits, not the placement.
    env = {
        "TOKENMESH_ROUTER_POLICY": "prefix",
        "TOKENMESH_ROUTER_QUEUE_TIMEOUT_S": "600",
        "TOKENMESH_ROUTER_TTFT_TIMEOUT_S": "600",
        "TOKENMESH_ROUTER_STALL_TIMEOUT_S": "600",
    }
    first: dict[str, list[float]] = {"session": [], "prefix": []}
    later: dict[str, list[float]] = {"session": [], "prefix": []}
    # Of the later turns' prompt tokens, how many the engine reused from its cache (llama.cpp's own figure).
    reused: dict[str, list[int]] = {"session": [0, 0], "prefix": [0, 0]}
    # Each block's later turns' TTFTs and its time, for the spread over block pairs.
    blocks: dict[str, list[tuple[list[float], float]]] = {"session": [], "prefix": []}
    # Every turn as (block, mode, chat, turn number, turn), for --dump and the lateness of --turn-every-s.
    turns: list[tuple[int, str, int, int, Turn]] = []
    with running_mesh(MeshConfig(workers=args.workers, port=0, extra_env=env, metrics=True)) as mesh:
        assert mesh.router is not None
        channel = grpc.insecure_channel(mesh.router.address)
        stub = inference_pb2_grpc.InferenceStub(channel)
        operator = router_pb2_grpc.RouterStub(channel)
        for block in range(args.blocks):
            served = {
                w.address: w.served_total for w in operator.GetRoutingTable(router_pb2.GetRoutingTableRequest()).workers
            }
            mode = ("session", "prefix")[block % 2]
            # Fresh system prompts every block: no cache holds any of its chats when it starts.
            systems = [system_prompt(1000 * (block + 1) + k, args.system_tokens) for k in range(args.sessions)]
            keys = [f"bench-{block}-{k}" if mode == "session" else "" for k in range(args.sessions)]
            started = time.monotonic()
            with ThreadPoolExecutor(args.sessions) as pool:
                chats = zip(systems, keys, range(args.sessions), [started] * args.sessions, strict=True)
                runs = list(pool.map(lambda chat: chat_turns(stub, args, *chat), chats))
            turns += [(block, mode, chat, i, t) for chat, r in enumerate(runs) for i, t in enumerate(r)]
            first[mode] += [r[0].ttft_s for r in runs]
            later[mode] += [t.ttft_s for r in runs for t in r[1:]]
            blocks[mode].append(([t.ttft_s for r in runs for t in r[1:]], time.monotonic() - started))
            for r in runs:
                for t in r[1:]:
                    reused[mode][0] += t.cached
                    reused[mode][1] += t.prompt
            table = operator.GetRoutingTable(router_pb2.GetRoutingTableRequest()).workers
            split = "/".join(str(w.served_total - served.get(w.address, 0)) for w in table)
            print(
                f"  block {block} ({mode}): done in {time.monotonic() - started:.1f} s, turns per worker {split}",
                flush=True,
            )
        channel.close()
        with urllib.request.urlopen(mesh.metrics_urls["router"], timeout=10) as answer:
            placed = [
                line
                for line in answer.read().decode().splitlines()
                if line.startswith(("tokenmesh_router_placements_total", "tokenmesh_router_migrations_total"))
            ]
    print(
        f"\n{args.sessions} chats at once x {args.turns} turns, system prompts of ~{args.system_tokens} tokens, "
        f"{args.max_tokens} output tokens a turn, "
        + (f"a turn due every {args.turn_every_s:g} s" if args.turn_every_s else f"{args.think_s:g} s between turns")
        + f", {args.workers} workers, {args.blocks} alternating blocks"
    )
    print(
        f"{'placement':10} {'turn 1 p50 s':>13} {'later p50 s':>12} {'later p99 s':>12} {'later turns':>12}"
        f" {'cached':>7}"
    )
    for mode in ("session", "prefix"):
        cached, prompt = reused[mode]
        print(
            f"{mode:10} {percentile(first[mode], 50):13.3f} {percentile(later[mode], 50):12.3f} "
            f"{percentile(later[mode], 99):12.3f} {len(later[mode]):12d} {cached / max(prompt, 1):7.1%}"
        )
    print("router placements and migrations over all blocks:", "; ".join(placed))
    if args.turn_every_s:
        for mode in ("session", "prefix"):
            mine = [t.late_s for _, m, _, i, t in turns if m == mode and i]
            late = [x for x in mine if x > 0.05]
            print(
                f"{mode}: {len(late)} of {len(mine)} later turns sent over 50 ms after due, "
                f"p50 {percentile(late, 50) if late else 0:.2f} s late"
            )
    pairs = list(zip(blocks["session"], blocks["prefix"], strict=False))
    p50s = sorted(percentile(s[0], 50) / percentile(p[0], 50) for s, p in pairs)
    means = sorted(sum(s[0]) / len(s[0]) / (sum(p[0]) / len(p[0])) for s, p in pairs)
    times = sorted(s[1] / p[1] for s, p in pairs)
    ratio = percentile(later["session"], 50) / percentile(later["prefix"], 50)
    mean = sum(later["session"]) / len(later["session"]) / (sum(later["prefix"]) / len(later["prefix"]))
    print(f"session / prefix TTFT p50 of later turns: {ratio:.3f} (target <= 1.0); block pairs {_spread(p50s)}")
    print(f"session / prefix TTFT mean of later turns: {mean:.3f}; block pairs {_spread(means)}")
    print(f"session / prefix block time (all turns of its chats): block pairs {_spread(times)}")
    if args.dump:
        with open(args.dump, "w") as out:
            records = [{"block": b, "mode": m, "chat": c, "turn": i, **t._asdict()} for b, m, c, i, t in turns]
            json.dump(records, out, indent=1)
        print(f"every turn written to {args.dump}")


def _spread(values: list[float]) -> str:
    """Median [min..max] of sorted values."""
    return f"median {values[len(values) // 2]:.3f} [{values[0]:.3f}..{values[-1]:.3f}]" if values else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=24)
    # 1 by default: on a CPU worker a warm request that lands behind another's
    # cold 1,500-token prefill waits about as long as a cold one, which hides
    # the cache effect this run measures (measured: p50 ratio 1.0 at 2).
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--policies", default="prefix,round-robin,least-loaded")
    parser.add_argument("--sessions", type=int, default=0, help="multi-turn chats at once: session key vs prefix")
    parser.add_argument("--turns", type=int, default=4, help="with --sessions: turns per chat")
    parser.add_argument("--blocks", type=int, default=4, help="with --sessions: alternating blocks (session first)")
    parser.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="with --sessions: seconds a chat waits after an answer before its next turn (a person reading and "
        "typing); 0 = closed loop, where a chat stuck in a long prefill leaves the others a less loaded machine",
    )
    parser.add_argument(
        "--turn-every-s",
        type=float,
        default=0.0,
        help="with --sessions: open loop instead: each chat's turns are due this many seconds apart (chats phased "
        "evenly over the period), sent when due or when the previous answer ends if later; prints how late",
    )
    parser.add_argument("--dump", help="with --sessions: write every turn (block, chat, TTFT, engine TTFT) as JSON")
    args = parser.parse_args()
    if args.sessions:
        run_sessions(args)
        return

    prompts = [system_prompt(k, args.system_tokens) for k in range(args.prompts)]
    order = [(i % args.prompts, i) for i in range(args.requests)]
    random.Random(7).shuffle(order)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, args, prompts, order)
        r = results[policy]
        print(f"  {policy}: done in {r['elapsed']:.1f} s", flush=True)

    print(
        f"\n{args.requests} chat requests, {args.prompts} system prompts of ~{args.system_tokens} tokens, "
        f"{args.max_tokens} output tokens, concurrency {args.concurrency}, {args.workers} workers"
    )
    print(f"{'policy':14} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens/s':>9}")
    for policy, r in results.items():
        print(f"{policy:14} {r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f} {r['tok_s']:9.1f}")
    if "prefix" in results and "round-robin" in results:
        ratio = results["prefix"]["ttft_p50"] / results["round-robin"]["ttft_p50"]
        print(f"prefix / round-robin TTFT p50: {ratio:.3f} (target <= 0.25)")
    propagation = [p for r in results.values() for p in r["propagation"]]
    print(
        f"weight propagation (decision -> applied), {len(propagation)} tables: "
        f"p50 {percentile(propagation, 50):.2f} ms, p99 {percentile(propagation, 99):.2f} ms (target <= 50 ms)"
    )


if __name__ == "__main__":
    main()
