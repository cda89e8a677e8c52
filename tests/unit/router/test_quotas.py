"""Quotas per tenant: the quota file, the sliding window's reservations and refunds, the refusals' details."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
from google.rpc import error_details_pb2

from tokenmesh import cli
from tokenmesh.config import ConfigError
from tokenmesh.errors import ResourceExhausted
from tokenmesh.router._quota_file import Limits, parse_quotas
from tokenmesh.router._quota_window import SLOTS, LocalStore, judge
from tokenmesh.router._quotas import (
    NO_GRANT,
    ROUTERS_SETTLE_S,
    Quotas,
    estimate_prompt_tokens,
    rate_limits,
    refusal,
)
from tokenmesh.v1 import inference_pb2

FILE = """\
# tokens per minute, requests per minute, generations at once
[tenants]
search = { tokens_per_minute = 1000, requests_per_minute = 60, concurrent = 4 }
batch = { tokens_per_minute = 200 }
"*" = { concurrent = 2 }

[tenants.ads]
requests_per_minute = 5
"""


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the file ---------------------------------------------------------------------------------------------


def test_the_file_gives_each_tenant_its_limits_and_star_the_rest() -> None:
    limits = parse_quotas(FILE)
    assert limits == {
        "search": Limits(tokens=1000, requests=60, concurrent=4),
        "batch": Limits(tokens=200),
        "*": Limits(concurrent=2),
        "ads": Limits(requests=5),
    }
    assert Limits(tokens=1000, requests=5, concurrent=3).share(2) == Limits(tokens=500, requests=2, concurrent=1)


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("[tenants]\nsearch = { tokens_per_minute = -5 }\n", 2, "tokens_per_minute must be a whole number >= 0"),
        ("[tenants]\nok = {}\nsearch = { tokens = 5 }\n", 3, "unknown limit 'tokens'"),
        ("[tenants]\nsearch = { concurrent = true }\n", 2, "concurrent must be a whole number"),
        ("[tenants]\nsearch = { concurrent = 1.5 }\n", 2, "got 1.5"),
        ("[tenants]\nsearch = 5\n", 2, "expected a table"),
        ("[tenants]\n\n[tenants.ads]\nrequests_per_minute = 'x'\n", 3, "requests_per_minute must be"),
        ("[tenant]\nsearch = {}\n", 1, "unknown table 'tenant'"),
        ("[tenants]\nsearch = { tokens_per_minute = 5 \n", 2, "not valid TOML"),
    ],
)
def test_a_wrong_line_is_one_line_naming_file_and_line(text: str, line: int, says: str) -> None:
    with pytest.raises(ConfigError) as wrong:
        parse_quotas(text, "q.toml")
    message = str(wrong.value)
    assert message.startswith(f"quota_file q.toml:{line}: ") and says in message
    assert "\n" not in message


# -- the window --------------------------------------------------------------------------------------------


def test_reservations_fill_the_quota_then_refuse_with_when_it_fits_again() -> None:
    clock = Clock()
    store = LocalStore(60.0, clock)
    limits = Limits(tokens=1000)
    granted = [store.reserve("t", limits, 300) for _ in range(3)]
    assert [v.refused for v in granted] == ["", "", ""]
    assert granted[-1].used_tokens == 900
    clock.now += 10
    refused = store.reserve("t", limits, 300)
    assert refused.refused == "tokens" and refused.used_tokens == 900
    # The three reservations' slot leaves the window a whole window (plus one slot) after it.
    slot_s = 60.0 / SLOTS
    assert refused.retry_s == pytest.approx((granted[0].slot + SLOTS + 1) * slot_s - clock.now)
    assert 50 <= refused.retry_s <= 60
    clock.now += refused.retry_s
    assert store.reserve("t", limits, 300).refused == ""


def test_a_refund_gives_back_what_was_not_used_and_more_use_counts_more() -> None:
    store = LocalStore(60.0, Clock())
    limits = Limits(tokens=1000)
    first = store.reserve("t", limits, 600)
    assert store.reserve("t", limits, 600).refused == "tokens"
    store.release("t", first.slot, 600 - 100)  # used 100 of 600
    second = store.reserve("t", limits, 600)
    assert second.refused == "" and second.used_tokens == 700
    store.release("t", second.slot, -200)  # used 800: 200 more than reserved, counted
    assert store.reserve("t", limits, 1).used_tokens == 901


def test_concurrent_and_requests_limits_and_a_request_larger_than_the_quota() -> None:
    clock = Clock()
    store = LocalStore(60.0, clock)
    running = [store.reserve("t", Limits(concurrent=2), 10) for _ in range(2)]
    refused = store.reserve("t", Limits(concurrent=2), 10)
    assert refused.refused == "concurrent" and refused.retry_s is not None
    store.release("t", running[0].slot, 10)
    assert store.reserve("t", Limits(concurrent=2), 10).refused == ""

    assert [store.reserve("r", Limits(requests=2), 1).refused for _ in range(3)] == ["", "", "requests"]
    too_large = store.reserve("x", Limits(tokens=100), 101)
    assert too_large.refused == "too_large" and too_large.retry_s is None
    assert "x" not in store.tenants  # a tenant with nothing counted is not kept


def test_the_window_slides_any_window_s_stretch_holds_at_most_the_quota() -> None:
    clock = Clock()
    store = LocalStore(10.0, clock)
    limits = Limits(tokens=100)
    granted: list[tuple[float, int]] = []
    for _ in range(400):  # a reservation of 10 tried every 0.13 s for 52 s
        if store.reserve("t", limits, 10).refused == "":
            granted.append((clock.now, 10))
        clock.now += 0.13
    for start, _ in granted:
        assert sum(n for t, n in granted if start <= t < start + 10.0) <= 100
    assert len(granted) >= 40  # and the quota is used: about 100 per 11 s


def test_judge_reports_the_figures_after_the_reservation() -> None:
    verdict = judge(Limits(tokens=1000, requests=10), 100, 0, {100: 300}, {100: 2}, 6.0, 603.0)
    assert verdict.refused == "" and (verdict.used_tokens, verdict.used_requests) == (400, 3)
    figures = rate_limits(Limits(tokens=1000, requests=10), verdict)
    assert (figures.limit_tokens, figures.remaining_tokens) == (1000, 600)
    assert (figures.limit_requests, figures.remaining_requests) == (10, 7)
    assert figures.reset_tokens_s == pytest.approx((100 + SLOTS + 1) * 6.0 - 603.0)


def test_the_prompt_estimate_is_its_bytes_and_the_templates_tokens_capped_at_the_context() -> None:
    raw = inference_pb2.GenerateRequest(prompt="héllo")
    assert estimate_prompt_tokens(raw, 512) == 6 + 4
    chat = inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage(role="user", content="hi")])
    assert estimate_prompt_tokens(chat, 512) == 48 + 8 + 2
    assert estimate_prompt_tokens(inference_pb2.GenerateRequest(prompt="x" * 5000), 512) == 512


def test_a_refusal_carries_reason_retry_and_figures() -> None:
    verdict = judge(Limits(tokens=1000), 300, 0, {100: 900}, {}, 6.0, 603.0)
    error = refusal("search", Limits(tokens=1000), verdict, 300, 44)
    status = error.status()
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    status.details[0].Unpack(info)
    assert info.reason == "QUOTA_TOKENS_PER_MINUTE" and info.domain == "tokenmesh"
    assert info.metadata["tenant"] == "search" and info.metadata["remaining_tokens"] == "100"
    assert info.metadata["limit_tokens"] == "1000" and info.metadata["reserve_tokens"] == "300"
    assert status.details[-1].Unpack(retry) and retry.retry_delay.ToNanoseconds() > 0
    never = refusal("search", Limits(tokens=100), judge(Limits(tokens=100), 300, 0, {}, {}, 6.0, 0.0), 300, 44)
    assert never.retry_delay is None and never.field_violations[0].field == "max_tokens"
    assert "lower max_tokens" in never.message


# -- the router's quotas ------------------------------------------------------------------------------------


async def test_concurrent_reservations_never_overshoot_and_settle_refunds(tmp_path: Path) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text('[tenants]\nsearch = { tokens_per_minute = 1000 }\n"*" = { concurrent = 1 }\n')
    quotas = Quotas(str(path), 60.0)
    request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=50)  # reserves 2 + 4 + 50

    async def one() -> object:
        try:
            return await quotas.reserve(request, "search", lambda: 512)
        except Exception as exc:  # noqa: BLE001 - counted below
            return exc

    results = await asyncio.gather(*(one() for _ in range(32)))
    grants = [r for r in results if not isinstance(r, Exception)]
    assert len(grants) == 1000 // 56 and sum(g.reserved for g in grants) <= 1000  # type: ignore[attr-defined]
    assert {type(r).__name__ for r in results if isinstance(r, Exception)} == {"ResourceExhausted"}
    last = grants[-1]
    piece = inference_pb2.GenerateChunk(seq=1, token_count=1)
    last.saw(piece)  # type: ignore[attr-defined]
    assert piece.rate_limits.limit_tokens == 1000 and piece.rate_limits.remaining_tokens == 1000 - 17 * 56
    last.saw(  # type: ignore[attr-defined]
        inference_pb2.GenerateChunk(
            seq=2, finish_reason=inference_pb2.FINISH_REASON_STOP, usage=inference_pb2.Usage(prompt_tokens=3)
        )
    )
    last.settle()  # type: ignore[attr-defined]
    last.settle()  # type: ignore[attr-defined]  # once only
    assert sum(quotas.local.tenants["search"].tokens.values()) == 16 * 56 + 3
    assert await quotas.reserve(request, "unlisted", lambda: 512) is not NO_GRANT  # "*": concurrent 1
    assert await quotas.reserve(request, "nobody", lambda: 512) is not NO_GRANT


async def test_without_a_file_nothing_is_limited() -> None:
    quotas = Quotas("", 60.0)
    request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=50)
    assert await quotas.reserve(request, "search", lambda: 512) is NO_GRANT


def test_a_changed_file_is_reloaded_and_a_wrong_one_keeps_the_limits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text("[tenants]\nsearch = { tokens_per_minute = 1000 }\n")
    quotas = Quotas(str(path), 60.0)
    assert not quotas.reload()  # unchanged
    path.write_text("[tenants]\nsearch = { tokens_per_minute = 2000 }\nads = { concurrent = 1 }\n")
    assert quotas.reload() and quotas.limits_for("search") == Limits(tokens=2000)
    caplog.set_level(logging.ERROR)
    path.write_text("[tenants]\nsearch = { tokens_per_minute = 2000 }\nads = { concurent = 1 }\n")
    os.utime(path, ns=(1, 1))
    assert not quotas.reload()
    assert quotas.limits_for("ads") == Limits(concurrent=1)  # kept
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "quotas.toml:3: tenant 'ads': unknown limit 'concurent'" in record.getMessage()


def test_a_router_whose_quota_file_is_wrong_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text("[tenants]\nsearch = { tokens_per_minute = 1000 }\nads = { tokens_per_minute = -1 }\n")
    assert cli.main(["router", "--workers", "127.0.0.1:50061", "--quota-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"quota_file {path}:3: tenant 'ads': tokens_per_minute must be a whole number >= 0, got -1" in err


def test_a_lower_router_count_is_taken_only_once_it_held() -> None:
    quotas = Quotas("", 60.0)
    quotas._count_routers(3)
    assert quotas.routers == 3
    quotas._count_routers(1)  # a Redis that restarted empty: only this router renewed yet
    assert quotas.routers == 3
    assert quotas._fewer_since is not None
    quotas._fewer_since -= ROUTERS_SETTLE_S
    quotas._count_routers(2)
    assert quotas.routers == 2


async def test_each_process_of_a_router_grants_its_share_without_redis(tmp_path: Path) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text("[tenants]\nsearch = { tokens_per_minute = 1000 }\n")
    quotas = Quotas(str(path), 60.0, processes=2)
    request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=94)  # reserves 100
    granted = 0
    for _ in range(10):
        try:
            await quotas.reserve(request, "search", lambda: 512)
        except ResourceExhausted:
            continue
        granted += 1
    assert granted == 5  # 500 of the 1,000: the other process grants the rest
