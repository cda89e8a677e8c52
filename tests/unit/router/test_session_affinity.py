"""Session affinity in the worker pool: an opening turn placed for balance in its key's rendezvous order, later turns
on their previous turn's worker (or, on a router that has not placed the session, the key's first choice), under a
load bound."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenmesh.router import NO_AFFINITY, Affinity, WorkerPool, _pool, affinity_of, prefix_key
from tokenmesh.v1 import inference_pb2

WORKERS = ("10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061")
SESSIONS = [f"conversation-{i}" for i in range(300)]


def pool_with(*addresses: str) -> WorkerPool:
    pool = WorkerPool()
    for address in addresses:
        entry = pool.add(address)
        entry.healthy = True
        entry.limit = 1000
        entry.models = {"m": inference_pb2.ModelInfo(name="m", max_context=100, is_default=True)}
    return pool


def homes(pool: WorkerPool, sessions: list[str] = SESSIONS) -> dict[str, str]:
    """Each session's worker on an idle pool."""
    result = {}
    for session in sessions:
        entry = pool.pick("m", Affinity.session(session))
        assert entry is not None
        result[session] = entry.address
    return result


def first_choice(session: str, addresses: list[str]) -> str:
    """The session's worker in an idle pool of just these workers: its first choice among them."""
    return homes(pool_with(*addresses), [session])[session]


def test_a_session_key_wins_over_the_prompt_prefix_and_no_key_leaves_the_prefix_rule_unchanged() -> None:
    history = [inference_pb2.ChatMessage(role="system", content="You are a careful assistant. " * 20)]
    turn = inference_pb2.GenerateRequest(messages=[*history, inference_pb2.ChatMessage(role="user", content="hi")])
    assert affinity_of(turn) == Affinity(prefix_key(turn), 1 + len(prefix_key(turn)) // 2048, "prefix")
    turn.labels["session"] = "s-1"
    # No assistant message yet: the conversation's opening turn, nothing of it cached, no slack.
    assert affinity_of(turn) == Affinity("s-1", 0, "session", opening=True)
    turn.messages.extend([inference_pb2.ChatMessage(role="assistant", content="hello"), turn.messages[-1]])
    assert affinity_of(turn) == Affinity("s-1", 1, "session")
    long = inference_pb2.GenerateRequest(
        messages=[
            inference_pb2.ChatMessage(role="user", content="x" * 5000),
            inference_pb2.ChatMessage(role="assistant", content="ok"),
            turn.messages[-1],
        ],
        labels={"session": "s-2"},
    )
    assert affinity_of(long) == Affinity("s-2", 3, "session")  # a longer history is worth more load
    completion = inference_pb2.GenerateRequest(prompt="y" * 2048, labels={"session": "s-3"})
    assert affinity_of(completion) == Affinity("s-3", 2, "session")  # a prompt: its history, turn unknown
    assert affinity_of(inference_pb2.GenerateRequest(prompt="short")) is NO_AFFINITY
    assert Affinity.session("") is NO_AFFINITY and Affinity.prefix("") is NO_AFFINITY


def test_opening_turns_spread_for_balance_and_later_turns_follow_them() -> None:
    pool = pool_with(*WORKERS[:2])
    # Four conversations whose key's first choice is the same worker, opened at once.
    crowded = [s for s in SESSIONS if first_choice(s, list(WORKERS[:2])) == WORKERS[0]][:4]
    opened = {}
    for session in crowded:
        entry = pool.pick("m", Affinity.session(session, opening=True))
        assert entry is not None
        entry.in_flight += 1
        opened[session] = entry.address
    assert Counter(opened.values()) == Counter({WORKERS[0]: 2, WORKERS[1]: 2})  # not 4 + 0 as the hash alone
    for entry in pool.entries.values():
        entry.in_flight = 0
    for session in crowded:  # the next turns, the mesh idle: each where its history is
        picked = pool.pick("m", Affinity.session(session, history_chars=3000))
        assert picked is not None and picked.address == opened[session]
    assert pool.placements["session", "last"] == 4


def test_every_turn_of_a_session_goes_to_the_same_worker_on_every_router() -> None:
    first = pool_with(*WORKERS)
    placed = homes(first)
    assert homes(first) == placed  # again and again on one router
    # Another router that found the workers in another order, with no state in common: the same worker each.
    assert homes(pool_with(*reversed(WORKERS))) == placed
    spread = Counter(placed.values())
    assert set(spread) == set(WORKERS) and min(spread.values()) > 70  # 300 sessions spread by the hash alone


def test_a_session_stays_on_a_busier_worker_up_to_the_load_bound_plus_its_slack_and_stays_where_it_moved() -> None:
    pool = pool_with(*WORKERS)
    session = SESSIONS[0]
    home = pool.entries[homes(pool, [session])[session]]
    others = [e for e in pool.entries.values() if e is not home]
    others[0].in_flight, others[1].in_flight = 2, 0
    # 5 in flight: the bound is ceil(1.25 * (5 + 1) / 3) = 3. Three ahead of the least loaded, at the bound: the
    # same key as a prefix yields; a session, whose short history is worth one generation more, stays.
    home.in_flight = 3
    assert pool.pick("m", Affinity(session, 1, "prefix")) is not home
    assert pool.pick("m", Affinity.session(session)) is home
    home.in_flight = 4  # past the bound plus one (ceil(1.25 * 7 / 3) + 1 = 4): its next worker in its own order
    moved = pool.pick("m", Affinity.session(session))
    assert moved is not None and moved.address == first_choice(session, [e.address for e in others])
    # A router that has not placed the session: the key's first choice, which a long history keeps longer.
    other = pool_with(*WORKERS)
    for entry in pool.entries.values():
        other.entries[entry.address].in_flight = entry.in_flight
    assert other.pick("m", Affinity.session(session, history_chars=5000)) is other.entries[home.address]
    assert other.pick("m", Affinity.session(session)) is not other.entries[home.address]
    home.in_flight = 3
    # Back under the bound, the session stays where it moved: its latest turn's history is there, not at home.
    assert pool.pick("m", Affinity.session(session)) is moved
    # What the router's metrics count (tokenmesh_router_placements_total): the idle pick, its worker of its
    # previous turn twice, one move on.
    counted = {c: pool.placements["session", c] for c in ("first", "last", "next")}
    assert counted == {"first": 1, "last": 2, "next": 1}


def test_a_router_remembers_a_bounded_number_of_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "SESSIONS_REMEMBERED", 3)
    pool = pool_with(*WORKERS)
    homes(pool, SESSIONS[:5])
    assert list(pool.sessions) == SESSIONS[2:5]  # the least recently placed forgotten first
    homes(pool, SESSIONS[2:3])
    assert list(pool.sessions) == [SESSIONS[3], SESSIONS[4], SESSIONS[2]]


def test_a_full_worker_passes_the_session_to_its_next_choice() -> None:
    pool = pool_with(*WORKERS)
    session = SESSIONS[1]
    home = pool.entries[homes(pool, [session])[session]]
    home.limit = home.in_flight = 4  # no free slot, whatever the bound says
    for e in pool.entries.values():
        if e is not home:
            e.in_flight = 4  # so the bound does not decide
            e.limit = 1000
    moved = pool.pick("m", Affinity.session(session))
    assert moved is not None and moved.address == first_choice(session, [a for a in WORKERS if a != home.address])


def test_a_drained_or_dead_worker_moves_only_its_own_sessions_which_stay_where_they_moved() -> None:
    before = homes(pool_with(*WORKERS))
    for leave, back in (
        (lambda p, e: p.let_go(e, "discovery lost it"), lambda p, e: p.add(e.address)),  # drained by discovery
        (lambda p, e: setattr(e, "healthy", False), lambda p, e: setattr(e, "healthy", True)),  # its health: down
        (
            lambda p, e: p.suspend(e, 60, "stream failed"),
            lambda p, e: setattr(e, "suspended_until", 0.0),
        ),  # it failed a stream
    ):
        pool = pool_with(*WORKERS)
        assert homes(pool) == before
        victim = pool.entries[WORKERS[0]]
        leave(pool, victim)
        during = homes(pool)
        for session, address in before.items():
            if address == victim.address:
                rest = [a for a in WORKERS if a != victim.address]
                assert during[session] == first_choice(session, rest)  # its next choice
            else:
                assert during[session] == address  # untouched
        assert victim.address not in during.values()
        back(pool, victim)
        assert homes(pool) == during  # the moved ones stay with their history; nothing else moved
        assert homes(pool_with(*WORKERS)) == before  # a router that never saw them: the hash's first choices
