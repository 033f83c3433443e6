"""SPEC §19 X5 (with §9 C4, §6 S6, §10 P1): one set of migrations and one query layer for
both of the store's dialects, run against a real SQLite file and a real PostgreSQL (a
throwaway cluster, tests/support/postgres.py: skipped loudly where PostgreSQL is missing,
required under .ci/run)."""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from corrallm.config import load_config_text
from corrallm.config.schema import short_key_name
from corrallm.cost.ledger import Ledger, Visit
from corrallm.lifecycle.pauses import Pausable, Pauses
from corrallm.store import activity, db, economics, footprints, pauses, queries, spend
from corrallm.store.activity import COLUMNS, Activity, ActivityLog
from corrallm.store.db import Store, StoreUnavailable
from corrallm.store.dialect import POSTGRES, SQLITE
from corrallm.store.location import store_at
from corrallm.store.schema import SCHEMA
from tests.support.activity_rows import req, write
from tests.support.postgres import POSTGRES_TIER, Cluster

H = 3600
T0 = 1_767_225_600  # 2026-01-01T00:00:00Z
LATEST = len(SCHEMA)
TABLES = {
    "api_keys",
    "revoked_keys",
    "key_rates",
    "pauses",
    "activity",
    "queue_depth",
    "usage_key_hour",
    "usage_model_hour",
    "economics",
    "footprints",
    "spend",
}
DIALECTS = ["sqlite", pytest.param("postgresql", marks=POSTGRES_TIER)]


@pytest.fixture(params=DIALECTS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a store lives: an SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return tmp_path / "corrallm.db"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def store(location: Path | str):
    s = store_at(location)
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def both(tmp_path: Path, postgres_url: str):
    """The same schema in both dialects: (SQLite store, PostgreSQL store)."""
    stores = [store_at(tmp_path / "corrallm.db"), store_at(postgres_url)]
    for s in stores:
        await s.open()
    yield stores
    for s in stores:
        await s.close()


def migrations_module(location: Path | str) -> Any:
    if isinstance(location, Path):
        return db
    from corrallm.store import postgres

    return postgres


async def version(store: Store) -> int:
    if store.dialect is SQLITE:
        return int((await store.query("PRAGMA user_version"))[0][0])
    return int((await store.query("SELECT MAX(version) AS v FROM schema_version"))[0]["v"])


async def columns(store: Store) -> dict[str, list[str]]:
    if store.dialect is SQLITE:
        names = await store.query("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {
            r["name"]: [c["name"] for c in await store.query(f"PRAGMA table_info({r['name']})")]
            for r in names
        }
    rows = await store.query(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = 'public' AND table_name <> 'schema_version' "
        "ORDER BY table_name, ordinal_position"
    )
    found: dict[str, list[str]] = {}
    for r in rows:
        found.setdefault(r["table_name"], []).append(r["column_name"])
    return found


# -- the dialect (pure) ------------------------------------------------------------------


def test_X5_the_dialects_differ_only_in_their_fragments():
    sql = "SELECT a FROM t WHERE b = ? AND c LIKE 'x'"
    assert SQLITE.translate(sql) == sql
    assert POSTGRES.translate(sql) == "SELECT a FROM t WHERE b = %s AND c LIKE 'x'"
    assert SQLITE.floor_to("t", 3600) == "CAST(t AS INTEGER) / 3600 * 3600"
    assert POSTGRES.floor_to("t", "?") == "CAST(FLOOR(t) AS BIGINT) / ? * ?"  # CAST rounds
    assert (SQLITE.indexed("activity_t"), POSTGRES.indexed("activity_t")) == (
        "INDEXED BY activity_t",
        "",
    )


# -- migrations, on both -----------------------------------------------------------------


async def test_X5_a_fresh_store_reaches_the_latest_version_with_the_same_tables(store):
    assert await version(store) == LATEST
    found = await columns(store)
    assert set(found) == TABLES
    assert found["activity"] == ["id", *COLUMNS]
    assert found["usage_key_hour"][:3] == ["hour", "key", "grp"]


async def test_X5_a_store_at_an_older_version_migrates_and_backfills(location, monkeypatch):
    module = migrations_module(location)
    latest = module.MIGRATIONS
    monkeypatch.setattr(module, "MIGRATIONS", latest[:2])  # the code of two versions ago
    old = store_at(location)
    await old.open()
    cols = [c for c in COLUMNS if c not in ("request_id", "usr")]
    insert = f"INSERT INTO activity ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    rows = [
        req(T0 + 5, None, "g", dwell_ms=8, prompt_tokens=3, completion_tokens=4, energy_wh=0.5),
        Activity(T0 + 9, "load", "k", "g", "m", None, "load", 200, energy_wh=1.0, cost_usd=0.5),
    ]
    await old.execute_many(insert, [[getattr(r, c) for c in cols] for r in rows])
    assert await version(old) == 2
    await old.close()

    monkeypatch.setattr(module, "MIGRATIONS", latest)
    new = store_at(location)
    await new.open()
    try:
        assert await version(new) == LATEST
        assert await queries.usage_by_key(new, T0, T0 + 2 * H) == [
            {"key": None, "group": "g", **sums(1, 3, 4, 0, 0.5, 0.0, 8.0)},
            # T1: a key was its secret before migration 9, now its short-form name
            {"key": short_key_name("k"), "group": "g", **sums(0, wh=1.0, usd=0.5)},
        ]
        rows = await new.query("SELECT key FROM activity WHERE key IS NOT NULL")
        assert [r["key"] for r in rows] == [short_key_name("k")]
    finally:
        await new.close()


async def test_X5_a_store_newer_than_the_code_is_refused(location):
    s = store_at(location)
    await s.open()
    if s.dialect is SQLITE:
        await s.execute(f"PRAGMA user_version = {LATEST + 1}")
    else:
        await s.execute("INSERT INTO schema_version VALUES (?, ?)", (LATEST + 1, time.time()))
    await s.close()
    again = store_at(location)
    with pytest.raises(RuntimeError, match=f"schema version {LATEST + 1}, newer than this"):
        await again.open()
    await again.close()


@POSTGRES_TIER
async def test_X5_gateways_starting_at_once_migrate_once(postgres_url):
    stores = [store_at(postgres_url) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        applied = await stores[0].query(
            "SELECT version, COUNT(*) AS n FROM schema_version GROUP BY version ORDER BY version"
        )
        assert [(r["version"], r["n"]) for r in applied] == [(v, 1) for v in range(1, LATEST + 1)]
    finally:
        await asyncio.gather(*(s.close() for s in stores))


@POSTGRES_TIER  # (psycopg only: no server)
async def test_X5_db_picks_the_store_and_an_unreachable_one_names_the_cause_and_the_fix():
    from tests.support.processes import free_port

    assert type(store_at("postgresql://u@h:5/d")).__name__ == "PostgresStore"
    assert type(store_at("postgres://u@h/d")).__name__ == "PostgresStore"
    assert type(store_at(Path("postgresql.db"))) is Store
    assert store_at("postgresql://u:secret@h:5/d?sslmode=require").path == "postgresql://u@h:5/d"
    port = free_port()  # nobody listens there
    s = store_at(f"postgresql://corrallm:secret@127.0.0.1:{port}/corrallm")
    with pytest.raises(StoreUnavailable) as failed:
        await s.open()
    message = str(failed.value)
    assert f"postgresql://corrallm@127.0.0.1:{port}/corrallm" in message
    assert "secret" not in message
    assert f"check that PostgreSQL is running at 127.0.0.1:{port}" in failed.value.fix


# -- one query layer: the same answers from both -----------------------------------------


def sums(requests=0, prompt=0, completion=0, nbytes=0, wh=0.0, usd=0.0, dwell=None):
    return {
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "bytes": nbytes,
        "energy_wh": wh,
        "cost_usd": usd,
        "dwell_ms_avg": dwell,
    }


async def test_X5_C4_usage_sums_per_key_and_model_read_the_same_on_both(store):
    await write(
        store,
        req(T0 + 10, prompt_tokens=100, completion_tokens=20, energy_wh=0.5, cost_usd=0.25,
            dwell_ms=10),
        req(T0 + 1800, prompt_tokens=50, completion_tokens=5, energy_wh=0.25, cost_usd=0.125,
            dwell_ms=30),
        Activity(T0 + 20, "load", "alice", "team", "m", "m#0", "load", 200, energy_wh=2.0,
                 cost_usd=1.0, dwell_ms=999),
        req(T0 + H + 5, key=None, grp="open", model="m2", prompt_tokens=7, energy_wh=0.125),
        req(T0 + H + 6, key="bob", model="m2", bytes=4096, cost_usd=0.5, dwell_ms=4),
    )  # fmt: skip
    assert await queries.usage_by_key(store, T0, T0 + H + 60) == [
        {"key": None, "group": "open", **sums(1, prompt=7, wh=0.125, dwell=0.0)},
        {"key": "alice", "group": "team", **sums(2, 150, 25, 0, 2.75, 1.375, 20.0)},
        {"key": "bob", "group": "team", **sums(1, nbytes=4096, usd=0.5, dwell=4.0)},
    ]
    assert await queries.usage_rollup(store, T0, T0 + H + 60) == [
        {"group": "open", "model": "m2", **sums(1, prompt=7, wh=0.125, dwell=0.0)},
        {"group": "team", "model": "m", **sums(2, 150, 25, 0, 2.75, 1.375, 20.0)},
        {"group": "team", "model": "m2", **sums(1, nbytes=4096, usd=0.5, dwell=4.0)},
    ]


@POSTGRES_TIER
async def test_X5_C3_C4_every_query_answers_the_same_on_sqlite_and_postgresql(both):
    rng = random.Random(5)
    rows = [
        Activity(
            T0 + rng.uniform(0, 6 * H),
            rng.choice(["request"] * 9 + ["load"]),
            rng.choice(["a", "b", None]),
            rng.choice(["g1", "g2"]),
            rng.choice(["m1", "m2", "m3"]),
            rng.choice([None, "m1#0"]),
            "/v1/chat/completions",
            rng.choice([200, 200, 429]),
            dwell_ms=rng.randrange(100) / 2,
            ttfb_ms=rng.choice([None, 12.5]),
            prompt_tokens=rng.randrange(50),
            completion_tokens=rng.randrange(50),
            bytes=rng.randrange(3) * 3_000_000_000,  # past 32 bits
            energy_wh=rng.randrange(8) / 4,
            cost_usd=rng.randrange(8) / 8,  # binary fractions: sums exact in any order
            degraded=rng.random() < 0.2,
            spilled=rng.random() < 0.2,
            error=rng.choice([None, "upstream 502"]),
            request_id=rng.choice([None, "0a1b2c3d00000002"]),
            usr=rng.choice([None, None, "ada", "bob"]),  # T4
        )
        for _ in range(300)
    ]
    rows += [req(T0 + 2 * H), req(T0 + 3 * H - 0.001), req(T0 + 4 * H - 0.5)]  # hour edges
    samples = [(T0 + 5 * i + 0.7, [("m1#0", i % 4, i % 3), ("m2#0", 1, i % 2)]) for i in range(99)]
    for s in both:
        for batch in (rows[:100], rows[100:]):  # two flushes: rollups upserted twice
            await write(s, *batch)
        for t, sample in samples:
            await queries.record_queue_depth(s, t, sample)

    async def answers(s: Store) -> list[Any]:
        out: list[Any] = []
        ranges = [(T0, T0 + 6 * H), (T0 + 2 * H, T0 + 3 * H), (T0 + 2 * H - 0.001, T0 + 3 * H)]
        ranges += [(T0 + 1234.5, T0 + 5 * H + 17.25), (T0 - H, T0 + 7 * H)]
        for since, until in ranges:
            out += [
                await queries.usage_by_key(s, since, until),
                await queries.usage_rollup(s, since, until),
                await queries.queue_depth(s, since, until, 60),
                await queries.activity(s, since, until, limit=50),
                await queries.activity(s, since, until, key="a", model="m2"),
                await queries.activity(s, since, until, group="g2", limit=7),
                await queries.activity(s, since, until, user="ada", limit=9),
                await queries.usage_by_user(s, since, until),
            ]
            for bucket in (300, 1800, H, 86400):
                out.append(await queries.usage_series(s, since, until, bucket))
                out.append(await queries.usage_series(s, since, until, bucket, by_group=True))
        out.append(await spend.recent_costs(s, "g1", T0))
        out.append(await queries.prune(s, T0 + 3 * H + 100))
        out.append(await queries.usage_by_key(s, 0, T0 + 7 * H))
        return out

    lite, pg = [await answers(s) for s in both]
    assert len(lite) == len(pg) and lite[-1] and any(lite[3])
    for got, want in zip(pg, lite, strict=True):
        assert got == want


async def test_X5_C3_a_failed_batch_writes_nothing_on_either(store):
    good = req(T0, "k", "g")
    bad = req(T0, "k", None)  # type: ignore[arg-type]  # grp is NOT NULL
    with pytest.raises(StoreUnavailable) as failed:
        await write(store, good, good, bad)
    cause = failed.value.__cause__
    assert isinstance(cause, sqlite3.IntegrityError) or "null" in str(cause).lower()
    assert await store.query("SELECT id FROM activity") == []
    assert await store.query("SELECT hour FROM usage_key_hour") == []
    await activity.write(store, [tuple(getattr(good, c) for c in COLUMNS)] * 2)
    assert [r["requests"] for r in await store.query("SELECT requests FROM usage_key_hour")] == [2]


async def test_X5_transact_runs_its_steps_in_one_transaction_and_returns_the_last_rows(store):
    got = await store.transact(
        [
            ("INSERT INTO pauses (kind, name, until, paused_at) VALUES (?, ?, ?, ?)",
             ("model", "m", None, 1.0)),
            ("SELECT kind, name FROM pauses WHERE name = ?", ("m",)),
        ]
    )  # fmt: skip
    assert [(r["kind"], r[1]) for r in got] == [("model", "m")]
    with pytest.raises(StoreUnavailable):
        await store.transact(
            [
                ("DELETE FROM pauses", ()),
                ("INSERT INTO pauses (kind, name, paused_at) VALUES (?, ?, ?)", ("bad", "x", 1)),
            ]
        )
    assert len(await pauses.read(store)) == 1  # the delete went back with the failed insert


async def test_X5_economics_footprints_and_pauses_round_trip_on_both(store):
    row = ("m#0", 100.0, 3, 2, 12.5, 2, 3.0, 2.0, 1.0, 0.25)
    changed = (*row[:2], 4, *row[3:])
    await economics.write(store, [row])
    await economics.write(store, [changed])  # upserted
    assert await economics.read(store) == [dict(zip(economics.COLUMNS, changed, strict=True))]
    await footprints.save(store, "m#0", "abc", {"gpu": 6 << 30, "ram": 512 << 20}, now=T0)
    await footprints.save(store, "m#0", "abc", {"gpu": 7 << 30}, now=T0 + 1)
    assert await footprints.read(store) == {("m#0", "abc"): {"gpu": 7 << 30}}
    await pauses.save(store, "model", "m", None, T0)
    await pauses.save(store, "model", "m", T0 + 60, T0 + 1)  # replaced
    await pauses.save(store, "extension", "x", None, T0)
    assert sorted(await pauses.read(store)) == [("extension", "x", None), ("model", "m", T0 + 60)]
    await pauses.delete(store, "model", "m")
    assert await pauses.read(store) == [("extension", "x", None)]


# -- what only a shared store does ---------------------------------------------------------


async def test_X5_P1_a_pause_written_anywhere_is_noticed_by_every_follower(location):
    writer, follower = store_at(location), store_at(location)
    await writer.open()
    await follower.open()
    changes = pauses.follow(follower)
    try:
        if writer.dialect is SQLITE:  # nobody else writes an embedded store
            with pytest.raises(StopAsyncIteration):
                await anext(changes)
            return
        await asyncio.wait_for(anext(changes), 5)  # listening
        for write_one in (
            pauses.save(writer, "model", "m", None, T0),
            pauses.delete(writer, "model", "m"),
        ):
            t0 = time.perf_counter()
            await write_one
            await asyncio.wait_for(anext(changes), 1.0)
            print(f"notified in {(time.perf_counter() - t0) * 1000:.1f} ms")
    finally:
        await changes.aclose()
        await writer.close()
        await follower.close()


class Recorder:
    """A supervisor as Pauses drives it: what it was asked to do, in order."""

    def __init__(self, sid: str) -> None:
        self.id, self.calls = sid, []

    async def pause(self) -> None:
        self.calls.append("pause")

    def unpause(self) -> None:
        self.calls.append("unpause")

    async def ensure_ready(self) -> None:
        self.calls.append("reload")


def gateway_pauses(store: Store, *names: str) -> tuple[Pauses, dict[str, Recorder]]:
    sups = {n: Recorder(f"{n}#0") for n in names}
    targets: dict[Any, Pausable] = {
        ("model", n): Pausable("model", n, [sup], pinned=n == "pinned")  # type: ignore[list-item]
        for n, sup in sups.items()
    }
    return Pauses(store, targets), sups


async def test_X5_P1_restore_forgets_unknown_pauses_only_on_an_embedded_store(location):
    s = store_at(location)
    await s.open()
    try:
        await pauses.save(s, "model", "elsewhere", None, T0)  # not configured here
        await pauses.save(s, "model", "m", None, T0)
        here, sups = gateway_pauses(s, "m")
        await here.restore()
        assert here.paused("model", "m") and sups["m"].calls == ["pause"]
        kept = {name for _, name, _ in await pauses.read(s)}
        # Shared: "elsewhere" may be another gateway's model; embedded: nobody's any more.
        assert kept == ({"m", "elsewhere"} if s.dialect.shared else {"m"})
    finally:
        await s.close()


@POSTGRES_TIER
async def test_X5_P1_pauses_another_gateway_writes_are_applied_as_local_ones_would_be(
    postgres_url,
):
    a_store, b_store = store_at(postgres_url), store_at(postgres_url)
    await a_store.open()
    await b_store.open()
    try:
        a, _ = gateway_pauses(a_store, "m", "pinned")
        b, sups = gateway_pauses(b_store, "m", "pinned")
        await a.pause("model", "m", None)
        await a.pause("model", "pinned", T0 + 10**9)
        await b.sync()
        assert b.paused("model", "m") and b.paused("model", "pinned")
        assert b.until[("model", "pinned")] == T0 + 10**9
        await b.sync()  # nothing new: nothing done twice
        assert sups["m"].calls == sups["pinned"].calls == ["pause"]
        await a.unpause("model", "m")
        await a.unpause("model", "pinned")
        await b.sync()
        assert not b.paused("model", "m") and not b.paused("model", "pinned")
        assert sups["m"].calls == ["pause", "unpause"]
        assert sups["pinned"].calls == ["pause", "unpause", "reload"]  # pinned: loaded again
    finally:
        await a_store.close()
        await b_store.close()


@POSTGRES_TIER
async def test_X5_P1_a_follower_whose_connection_drops_reconnects_and_reads_again(
    postgres_url, monkeypatch
):
    from corrallm.store import postgres

    monkeypatch.setattr(postgres, "RECONNECT_SECONDS", (0.05, 0.2))
    writer, follower = store_at(postgres_url), store_at(postgres_url)
    await writer.open()
    await follower.open()
    changes = pauses.follow(follower)
    try:
        await asyncio.wait_for(anext(changes), 5)
        await writer.query(
            "SELECT pg_terminate_backend(pid) AS gone FROM pg_stat_activity "
            "WHERE application_name = 'corrallm-listen'"
        )
        await asyncio.wait_for(anext(changes), 5)  # listening again: read what was missed
        await pauses.save(writer, "model", "m", None, T0)
        await asyncio.wait_for(anext(changes), 1.0)
    finally:
        await changes.aclose()
        await writer.close()
        await follower.close()


@POSTGRES_TIER
async def test_X5_S6_reservations_from_two_gateways_never_overshoot(postgres_url):
    a, b = store_at(postgres_url), store_at(postgres_url)
    await a.open()
    await b.open()
    try:
        now = time.time()
        # A gateway that died holding a reservation: expired, it no longer counts.
        dead = await spend.reserve(a, "lane", 0.9, 1.0, 3600, now - 2000, "dead")
        assert dead.id is not None
        tries = [
            spend.reserve(s, "lane", 0.1, 1.0, 3600, now, f"gw{i % 2}")
            for i, s in enumerate([a, b] * 20)
        ]
        got = await asyncio.gather(*tries)
        kept = [g for g in got if g.id is not None]
        assert len(kept) == 10  # 10 x $0.1 fit in $1, from either gateway, never an 11th
        assert max(g.spent + g.reserved for g in got) == pytest.approx(1.0)
        writes = spend.SpendLog(b, "gw1")
        for g in kept[:4]:
            writes.settle(g.id, 0.05, now + 1)  # each cost half its estimate
        writes.add("lane", 0.25, now + 1)  # a load
        await writes.flush()
        assert await spend.spent(a, "lane", now - 3600) == pytest.approx(0.45)
        spending = await spend.spending(a, "lane", now - 3600)
        assert spending == [(now + 1, pytest.approx(x)) for x in (0.05, 0.05, 0.05, 0.05, 0.25)]
        # $0.45 spent and 6 x $0.1 still reserved: full.
        assert (await spend.reserve(a, "lane", 0.15, 1.0, 3600, now + 2, "gw0")).id is None
        for g in kept[4:]:
            writes.settle(g.id, 0.05, now + 2)
        await writes.flush()
        # $0.75 spent, nothing reserved: $0.2 fits, then nothing more.
        assert (await spend.reserve(b, "lane", 0.2, 1.0, 3600, now + 3, "gw1")).id is not None
        assert (await spend.reserve(a, "lane", 0.1, 1.0, 3600, now + 3, "gw0")).id is None
        # Out of the window, spending no longer counts.
        later = await spend.reserve(a, "lane", 0.7, 1.0, 3600, now + 3602, "gw0")
        assert later.id is not None and later.spent == 0
    finally:
        await a.close()
        await b.close()


@POSTGRES_TIER
async def test_X5_S6_the_ledger_reserves_in_the_shared_store_and_fails_open_without_it(
    postgres_cluster: Cluster, postgres_url: str, caplog: pytest.LogCaptureFixture
):
    config = load_config_text(
        """
priorityGroups: {thrifty: {spendLimit: {usd: 0.1, window: 1h}}}
models:
  paid:
    backends: [{proxy: 9001, pricing: {inputPerMillion: 0, outputPerMillion: 1000}}]
"""
    )
    backend = config.models["paid"].backends[0]
    s = store_at(postgres_url)
    await s.open()
    ledger = Ledger(config, ActivityLog(s))
    try:

        def visit() -> Visit:
            return Visit(None, "thrifty", "paid", "/v1/chat/completions", 0)

        first, second, third = visit(), visit(), visit()
        assert await ledger.reserve(first, backend, 40) is None  # $0.04
        (hold,) = first.holds
        assert hold.reservation is not None and hold.usd == pytest.approx(0.04)
        assert await ledger.reserve(second, backend, 40) is None  # $0.08
        over = await ledger.reserve(third, backend, 40)  # $0.12 > $0.1
        assert over is not None and over.wait is not None and 3500 < over.wait <= 3600
        assert third.holds == ()
        # The database goes away: reservations fall back to this gateway's own window.
        name = postgres_url.rsplit("/", 1)[1]
        import psycopg

        with psycopg.connect(postgres_cluster.url(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        caplog.set_level(logging.WARNING, "corrallm.cost")
        fallback = visit()
        assert await ledger.reserve(fallback, backend, 40) is None
        (hold,) = fallback.holds
        assert hold.reservation is None and hold.usd == pytest.approx(0.04)
        assert "shared store failed" in caplog.text and "own spending" in caplog.text
    finally:
        await s.close()
