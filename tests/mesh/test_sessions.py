"""Session affinity through a router: a conversation's turns stay on one worker, and move once when it drains."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import httpx
import openai
import pytest

from tests.support.gateway_helpers import gateway_over
from tests.support.mesh import InProcessMesh, assert_exact, expected_text, in_process_mesh, wait_until
from tokenmesh.errors import InvalidArgument, from_rpc_error
from tokenmesh.router import Affinity, WorkerPool
from tokenmesh.v1 import inference_pb2

PER_WORKER = 8
"""Sessions whose first choice is each worker: 24 conversations at once over 3 workers."""
TOKENS = 12
USER_TURN = {"role": "user", "content": "hi"}
CHAT = {"model": "fake", "max_tokens": 2, "messages": [USER_TURN]}


@contextlib.asynccontextmanager
async def three_workers() -> AsyncIterator[InProcessMesh]:
    # Room for every conversation at once (16 slots a worker), and turns long enough (12 x 5 ms) to overlap.
    async with in_process_mesh(backend_settings={"slots": 16, "delay": 0.005}, worker_count=3) as m:
        yield m


def first_choice(pool: WorkerPool, session: str, addresses: list[str]) -> str:
    """The session's worker among addresses on an idle router: the first in its rendezvous order."""
    idle = WorkerPool()
    for address in addresses:
        entry = idle.add(address)
        entry.healthy, entry.limit, entry.models = True, 16, pool.entries[address].models
    picked = idle.pick("fake", Affinity.session(session))
    assert picked is not None
    return picked.address


def balanced_sessions(mesh: InProcessMesh, leaving: str = "") -> list[tuple[str, str]]:
    """(session key, its worker's address), PER_WORKER per worker, interleaved: worker by worker in turn.

    Chosen so that the load bound never moves a turn: the test is of the affinity, the bound is the unit tests'.
    The sessions of the worker ``leaving`` are also split evenly over their next choices, where they move.
    """
    addresses = [w.host.address for w in mesh.workers]
    rest = [a for a in addresses if a != leaving]
    buckets: dict[tuple[str, str], list[str]] = defaultdict(list)  # (home, next if home is leaving) -> keys
    wanted = {(a, ""): PER_WORKER for a in rest} | {(leaving, a): PER_WORKER // len(rest) for a in rest if leaving}
    n = 0
    while any(len(buckets[b]) < size for b, size in wanted.items()):
        key = f"conversation-{n}"
        n += 1
        home = first_choice(mesh.router.pool, key, addresses)
        bucket = (home, first_choice(mesh.router.pool, key, rest) if home == leaving else "")
        if len(buckets[bucket]) < wanted[bucket]:
            buckets[bucket].append(key)
    by_worker = {
        a: [k for keys in zip(*(buckets[b] for b in wanted if b[0] == a), strict=True) for k in keys] for a in addresses
    }
    return [(by_worker[a][i], a) for i in range(PER_WORKER) for a in addresses]


async def converse(
    mesh: InProcessMesh, session: str, turns: int, after_turn: dict[int, asyncio.Event], reached: Counter[int]
) -> None:
    """A multi-turn chat: each turn sends the whole history plus a new user message, under the session key.

    After each turn it counts the turn in ``reached`` and waits for the turn's gate in ``after_turn``, if any.
    """
    history: list[inference_pb2.ChatMessage] = [
        inference_pb2.ChatMessage(role="system", content=f"You talk with {session}.")
    ]
    for turn in range(turns):
        history.append(inference_pb2.ChatMessage(role="user", content=f"{session} turn {turn}"))
        request = inference_pb2.GenerateRequest(messages=history, max_tokens=TOKENS, labels={"session": session})
        chunks = [c async for c in mesh.inference.Generate(request)]
        assert_exact(chunks, TOKENS)  # nothing lost or repeated, seq 1..N, whichever worker(s) served it
        history.append(inference_pb2.ChatMessage(role="assistant", content=expected_text(TOKENS)))
        reached[turn] += 1
        gate = after_turn.get(turn)
        if gate is not None:
            await gate.wait()


async def arriving(
    mesh: InProcessMesh,
    sessions: list[tuple[str, str]],
    turns: int,
    gates: Callable[[str], dict[int, asyncio.Event]],
    reached: Counter[int] | None = None,
) -> list[asyncio.Task[None]]:
    """The conversations, started one after another (2 ms apart, worker by worker) as callers arrive.

    All at once, a burst of one worker's sessions in the first milliseconds could pass the load bound (with 24
    sessions over 3 workers about one run in ten), which would move a turn as it should.
    """
    tasks = []
    for session, _ in sessions:
        tasks.append(
            asyncio.create_task(
                converse(mesh, session, turns, gates(session), Counter() if reached is None else reached)
            )
        )
        await asyncio.sleep(0.002)
    return tasks


async def release(gates: dict[str, asyncio.Event]) -> None:
    """Open the gates one after another (2 ms apart, worker by worker), so that no worker gets a burst."""
    for gate in gates.values():
        gate.set()
        await asyncio.sleep(0.002)


def workers_of_turns(mesh: InProcessMesh) -> dict[tuple[str, int], set[str]]:
    """(session, turn) -> the workers that ran it (two when it moved mid-stream)."""
    ran: dict[tuple[str, int], set[str]] = defaultdict(set)
    for worker, backend in zip(mesh.workers, mesh.backends, strict=True):
        for generation in backend.started:
            user = next(content for role, content in reversed(generation.params.messages) if role == "user")
            session, _, turn = user.rpartition(" turn ")
            ran[session, int(turn)].add(worker.host.address)
    return ran


async def test_dozens_of_concurrent_conversations_each_keep_their_turns_on_their_worker() -> None:
    async with three_workers() as mesh:
        sessions = balanced_sessions(mesh)
        await asyncio.gather(*await arriving(mesh, sessions, 4, lambda _: {}))
        ran = workers_of_turns(mesh)
        assert len(ran) == len(sessions) * 4  # every turn ran once
        for session, home in sessions:
            assert [ran[session, turn] for turn in range(4)] == [{home}] * 4, session
        assert [len(b.started) for b in mesh.backends] == [PER_WORKER * 4] * 3  # each ran its own sessions' turns
        # The first turn by the key's first choice, each later one by its previous turn's worker (the same).
        placed = {("session", "first"): len(sessions), ("session", "last"): len(sessions) * 3}
        assert dict(mesh.router.pool.placements) == placed


async def test_a_draining_workers_conversations_continue_on_their_next_worker_with_no_broken_stream() -> None:
    async with three_workers() as mesh:
        victim = mesh.workers[0].host.address
        rest = [w.host.address for w in mesh.workers[1:]]
        sessions = balanced_sessions(mesh, leaving=victim)
        # Each conversation waits after turns 1 and 2 (0-based): the drain begins while turn 2 runs everywhere, and
        # turn 3 starts once this router has seen the worker leave (a turn that starts before can still run there).
        during = {s: asyncio.Event() for s, _ in sessions}
        after_it = {s: asyncio.Event() for s, _ in sessions}
        reached: Counter[int] = Counter()
        tasks = await arriving(mesh, sessions, 5, lambda s: {1: during[s], 2: after_it[s]}, reached)
        await wait_until(lambda: reached[1] == len(sessions))
        await release(during)
        await asyncio.sleep(0.01)  # turn 2 under way everywhere, also on the victim
        drained = asyncio.create_task(mesh.workers[0].shutdown())
        pool = mesh.router.pool
        await wait_until(lambda: pool.effective_weight(pool.entries[victim]) == 0)
        await wait_until(lambda: reached[2] == len(sessions))
        await release(after_it)
        await asyncio.gather(*tasks)  # each turn asserted exact in converse: no stream broke
        await drained
        ran = workers_of_turns(mesh)
        # The drain began mid-run: some of the victim's sessions had their turn 2 running there.
        assert any(victim in ran[s, 2] for s, home in sessions if home == victim)
        for session, home in sessions:
            if home != victim:
                assert [ran[session, t] for t in range(5)] == [{home}] * 5, session  # untouched
                continue
            assert ran[session, 0] == ran[session, 1] == {victim}
            after = first_choice(mesh.router.pool, session, rest)
            assert ran[session, 3] == ran[session, 4] == {after}, session  # its next worker in its own order
            assert ran[session, 2] <= {victim, after}  # under way when the drain began: finished there or moved


async def test_a_session_key_over_the_label_limit_is_refused_naming_the_label(mesh: InProcessMesh) -> None:
    request = inference_pb2.GenerateRequest(prompt="hello", max_tokens=2, labels={"session": "s" * 257})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.inference.Generate(request).read()
    error = from_rpc_error(caught.value)
    assert type(error) is InvalidArgument and [v.field for v in error.field_violations] == ["labels['session']"]
    assert "256" in error.message
    assert not any(b.started for b in mesh.backends)  # nothing ran


async def test_the_gateways_session_keys_reach_the_router_and_keep_a_chat_on_one_worker() -> None:
    async with three_workers() as mesh, gateway_over(mesh) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        history: list[Any] = [{"role": "system", "content": "You are brief."}]
        for turn in range(4):  # OpenAI's prompt_cache_key: each turn sends the history so far
            history.append({"role": "user", "content": f"chat turn {turn}"})
            done = await client.chat.completions.create(
                model="fake", messages=history, max_tokens=3, prompt_cache_key="chat-7", user="alice"
            )
            history.append({"role": "assistant", "content": done.choices[0].message.content})
        await client.responses.create(model="fake", input="r turn 0", max_output_tokens=3, prompt_cache_key="resp-1")
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            header = {"X-Session-ID": "from-header"}
            body = {"model": "fake", "max_tokens": 3, "metadata": {"user_id": "bob"}}
            answered = await http.post("/messages", json={**body, "messages": [USER_TURN]}, headers=header)
            assert answered.status_code == 200
            too_long = await http.post("/chat/completions", json=CHAT, headers={"X-Session-ID": "s" * 257})
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Session-ID"
            long_key = await http.post("/chat/completions", json={**CHAT, "prompt_cache_key": "p" * 257})
            assert long_key.json()["error"]["param"] == "prompt_cache_key"
    sent = {
        (g.params.messages[-1][1], worker.host.address): g.params.labels.get("session")
        for worker, backend in zip(mesh.workers, mesh.backends, strict=True)
        for g in backend.started
    }
    chat_workers = {address for (text, address) in sent if text.startswith("chat turn")}
    assert chat_workers == {first_choice(mesh.router.pool, "chat-7", [w.host.address for w in mesh.workers])}
    assert sorted(sent.values()) == ["chat-7"] * 4 + ["from-header", "resp-1"]  # nothing else ran (the 400s)
