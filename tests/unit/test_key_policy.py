"""T3 around the pure core: a key's own spendLimit in the ledger (beside its group's), the
throttle (auth/throttle.py) on an embedded store, and rpm/tpm counted across gateways in
a shared PostgreSQL store (store/rates.py; a throwaway cluster, tests/support/postgres.py),
with the fallback to this gateway's own windows when the database goes away."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from corrallm.auth.keys import Identity
from corrallm.auth.limits import Ask, Hold
from corrallm.auth.limits import LimitRefusal as Refused
from corrallm.auth.throttle import Throttle, asks_of
from corrallm.config import load_config_text
from corrallm.config.schema import KeyLimits, RateLimits, SpendLimit
from corrallm.cost.ledger import Ledger, OverSpend, Visit
from corrallm.store import rates
from corrallm.store.activity import ActivityLog
from corrallm.store.location import store_at
from tests.support.postgres import POSTGRES_TIER, Cluster

CONFIG = """
priorityGroups: {thrifty: {spendLimit: {usd: 0.2, window: 1h}}}
models:
  paid:
    backends: [{proxy: 9001, pricing: {inputPerMillion: 0, outputPerMillion: 1000}}]
"""
KEY_LIMIT = SpendLimit(usd=0.1, window=3600)  # $0.04 a request with max_tokens 40


def visit(key: str | None = "alice", group: str = "thrifty") -> Visit:
    return Visit(key, group, "paid", "/v1/chat/completions", 0)


async def test_T3_a_keys_spendLimit_applies_beside_its_groups(tmp_path: Path):
    config = load_config_text(CONFIG)
    backend = config.models["paid"].backends[0]
    ledger = Ledger(config, ActivityLog(store_at(tmp_path / "x.db")))
    got = []
    for _ in range(3):  # alice: $0.04, $0.08, then $0.12 > her $0.1
        got.append(await ledger.reserve(v := visit(), backend, 40, KEY_LIMIT))
    # bob (no spendLimit of his own) shares the group ($0.08 reserved of its $0.2) but not
    # alice's window.
    bob = [await ledger.reserve(visit("bob"), backend, 40) for _ in range(4)]
    hopeless = await ledger.reserve(visit(), backend, 200, KEY_LIMIT)  # $0.2 > $0.1
    assert (got[:2], bob[:3], ledger.spend["thrifty"].reserved) == (
        [None, None],
        [None, None, None],
        pytest.approx(0.2),  # alice's two and bob's three: nothing of the refused
    )
    assert got[2] == OverSpend("alice", True, pytest.approx(0.04), 0.1, 3600.0)
    # bob's fourth does not fit the group's window.
    assert bob[3] == OverSpend("thrifty", False, pytest.approx(0.04), 0.2, 3600.0)
    assert hopeless == OverSpend("alice", True, pytest.approx(0.2), 0.1, None)
    assert v.holds == ()  # the refused one holds nothing anywhere


async def test_T3_a_refused_key_reservation_gives_the_groups_back(tmp_path: Path):
    config = load_config_text(CONFIG)
    backend = config.models["paid"].backends[0]
    ledger = Ledger(config, ActivityLog(store_at(tmp_path / "x.db")))
    tight = SpendLimit(usd=0.05, window=3600)
    first = visit()
    assert await ledger.reserve(first, backend, 40, tight) is None
    second = visit()
    over = await ledger.reserve(second, backend, 40, tight)
    assert (over is not None and over.key, ledger.spend["thrifty"].reserved) == (
        True,
        pytest.approx(0.04),  # only the first one's: the second's group hold was undone
    )


def left(hold: Hold) -> tuple[int | None, int | None]:
    """The requests and tokens left after `hold`, as its x-ratelimit-* headers say."""
    headers = dict(hold.headers)
    requests = headers.get(b"x-ratelimit-remaining-requests")
    tokens = headers.get(b"x-ratelimit-remaining-tokens")
    return (
        None if requests is None else int(requests),
        None if tokens is None else int(tokens),
    )


async def test_T3_the_throttle_counts_in_memory_on_an_embedded_store(tmp_path: Path):
    throttle = Throttle(store_at(tmp_path / "x.db"))
    asks = [Ask("key:alice", RateLimits(rpm=2, tpm=100))]
    first = await throttle.admit(asks, 30)
    second = await throttle.admit(asks, 30)
    third = await throttle.admit(asks, 30)
    assert isinstance(first, Hold) and isinstance(second, Hold)
    throttle.release(first, 10)
    remaining = [left(p) for p in (first, second)]
    assert remaining == [(1, 70), (0, 40)]
    assert not isinstance(third, Hold) and third[0].rule == "rpm"


def test_T3_T4_a_request_is_counted_for_its_key_and_for_its_user_under_perUser():
    per_user = RateLimits(rpm=2)
    both = Identity("alice", None, b"", limits=KeyLimits(rpm=10, per_user=per_user))
    users_only = Identity("bob", None, b"", limits=KeyLimits(per_user=per_user))
    assert [
        asks_of(both, "carol@example.org"),
        asks_of(both, None),  # no user named: the key's limits only
        asks_of(users_only, "dan"),
        asks_of(users_only, None),
        asks_of(Identity("free", None, b""), "erin"),
    ] == [
        (
            Ask("key:alice", KeyLimits(rpm=10, per_user=per_user)),
            Ask("key:alice/user:carol@example.org", per_user),
        ),
        (Ask("key:alice", KeyLimits(rpm=10, per_user=per_user)),),
        (Ask("key:bob/user:dan", per_user),),
        (),
        (),
    ]


@POSTGRES_TIER
async def test_T3_X5_rates_reserved_from_two_gateways_never_overshoot(postgres_url: str):
    a, b = store_at(postgres_url), store_at(postgres_url)
    await a.open()
    await b.open()
    try:
        now = time.time()
        asks = [("key:alice", 10, None)]
        tries = [
            rates.reserve(s, asks, 5, 60, now, f"gw{i % 2}") for i, s in enumerate([a, b] * 20)
        ]
        got = [c for counted in await asyncio.gather(*tries) for c in counted]
        kept = [c for c in got if c.id is not None]
        assert (len(kept), max(c.requests for c in got)) == (10, 10)
        # tpm: 10 x 5 reserved; settled at 1 token each, 45 tokens are free again.
        writes = rates.RateLog(b)
        for c in kept:
            assert c.id is not None
            writes.settle(c.id, 1, now + 1)
        await writes.flush()
        tpm = [("key:bob", None, 60), ("key:alice", None, 60)]
        fits = await rates.reserve(a, tpm, 50, 60, now + 2, "gw0")
        over = await rates.reserve(a, tpm, 1, 60, now + 2, "gw0")  # bob has 50 of 60 now
        assert [
            sorted((c.subject, c.tokens, c.id is not None) for c in x) for x in (fits, over)
        ] == [
            [("key:alice", 10, True), ("key:bob", 0, True)],
            # 50 + 1 fits bob; alice's 10 + 50 + 1 does not, so neither is counted
            [("key:alice", 60, False), ("key:bob", 50, False)],
        ]
        admitted, spent = await rates.timeline(a, "key:alice", now - 60)
        assert (len(admitted), spent[0][0], sum(n for _, n in spent)) == (11, now + 1, 10)
        await rates.prune(a, now + 62, now + 62)  # every row is out of the window by then
        assert await rates.timeline(a, "key:alice", 0) == ([now + 2], [])  # bar the reserved
    finally:
        await a.close()
        await b.close()


@POSTGRES_TIER
async def test_T3_X5_the_throttle_counts_across_gateways_and_falls_back_without_the_store(
    postgres_cluster: Cluster, postgres_url: str, caplog: pytest.LogCaptureFixture
):
    a, b = store_at(postgres_url), store_at(postgres_url)
    await a.open()
    await b.open()
    here, there = Throttle(a), Throttle(b)
    asks = [Ask("key:alice", RateLimits(rpm=3))]
    try:
        got = [await t.admit(asks, 0) for t in (here, there, here, there)]
        passed = [g for g in got if isinstance(g, Hold)]
        refused = got[3]
        assert [left(p)[0] for p in passed] == [2, 1, 0]
        assert not isinstance(refused, Hold)
        assert refused[0] == Refused("rpm", "key:alice", 3, 3, 0, pytest.approx(60, abs=1))
        # The database goes away: this gateway counts its own (two requests so far).
        name = postgres_url.rsplit("/", 1)[1]
        import psycopg

        with psycopg.connect(postgres_cluster.url(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        caplog.set_level(logging.WARNING, "corrallm.auth")
        own = await here.admit(asks, 0)
        again = await here.admit(asks, 0)
        assert isinstance(own, Hold) and not isinstance(again, Hold)
        assert "shared store failed" in caplog.text and "own requests" in caplog.text
    finally:
        await a.close()
        await b.close()
