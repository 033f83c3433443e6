"""SPEC §22 T2: keys made at runtime, in the store (both dialects: an SQLite file and a
throwaway PostgreSQL, tests/support/postgres.py) and in the owner that puts them in force
(auth/runtime.py): digests only, refused secrets, conflicts, restarts, last_used batched
off the request path, and on a shared store a change seen by another gateway's owner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corrallm.auth.callers import Callers
from corrallm.auth.keys import KeyRing, hash_text
from corrallm.auth.keys import RevokedSecret as Refused
from corrallm.auth.runtime import KeyExists, KeyInConfig, KeyNotFound, RuntimeKeys
from corrallm.config import Config
from corrallm.config.loading import load_config_text
from corrallm.config.schema import KeyPolicy, short_key_name
from corrallm.proxy.pipeline import key_refused
from corrallm.store import keys as table
from corrallm.store.activity import Activity, ActivityLog
from corrallm.store.db import Store
from corrallm.store.location import store_at
from tests.support.postgres import POSTGRES_TIER

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
DIALECTS = ["sqlite", pytest.param("postgresql", marks=POSTGRES_TIER)]
CONFIG = """
priorityGroups: {batch: {weight: 1}, interactive: {weight: 4}}
keys:
  alice: {secret: alice-secret-0001, group: interactive}
  short-secret-0002: batch
models:
  m: {backends: [{proxy: "http://127.0.0.1:9"}]}
"""


@pytest.fixture(params=DIALECTS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    if request.param == "sqlite":
        return tmp_path / "corrallm.db"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def store(location: Path | str) -> AsyncIterator[Store]:
    s = store_at(location)
    await s.open()
    yield s
    await s.close()


@pytest.fixture
def config() -> Config:
    return load_config_text(CONFIG)


def owner(store: Store, config: Config) -> tuple[RuntimeKeys, Callers]:
    ring = KeyRing()
    ring.reconfigure(config.keys)
    clock = iter(T0 + i for i in range(1000))
    return RuntimeKeys(store, ring, wall_clock=lambda: next(clock)), Callers(config, ring)


def stored_key(name: str, secret: str) -> table.StoredKey:
    return table.StoredKey(name, hash_text(secret), secret[:7], "batch", "{}", T0)


async def test_T2_the_store_keeps_digests_refuses_taken_names_and_refuses_old_secrets(store):
    assert await table.create(store, stored_key("bob", "ck-bob-1"))
    assert not await table.create(store, stored_key("bob", "ck-bob-2"))  # name taken
    rotated = await table.rotate(store, "bob", hash_text("ck-bob-3"), "ck-bob", T0 + 1)
    assert rotated == table.StoredKey(
        "bob", hash_text("ck-bob-3"), "ck-bob", "batch", "{}", T0, None
    )
    assert await table.rotate(store, "nobody", hash_text("x"), "x", T0) is None
    assert await table.create(store, stored_key("carol", "ck-carol-1"))
    assert await table.delete(store, "carol", T0 + 2) == hash_text("ck-carol-1")
    assert await table.delete(store, "carol", T0 + 3) is None
    keys, revoked = await table.read(store)
    assert ([k.name for k in keys], sorted((r.name, r.reason, r.digest) for r in revoked)) == (
        ["bob"],
        [("bob", "rotated", hash_text("ck-bob-1")), ("carol", "revoked", hash_text("ck-carol-1"))],
    )


async def test_T2_last_used_never_moves_back_and_config_keys_read_the_activity(store):
    assert await table.create(store, stored_key("bob", "ck-bob-1"))
    await table.record_used(store, {"bob": T0 + 50})
    await table.record_used(store, {"bob": T0 + 20})  # an older batch of another gateway
    assert (await table.read(store))[0][0].last_used == T0 + 50
    log = ActivityLog(store)
    for t in (T0 + 5, T0 + 9, T0 + 7):
        log.record(Activity(t, "request", "alice", "interactive", "m", None, "/v1/x", 200))
    await log.flush()
    assert await table.last_requests(store, ["alice", "nobody"]) == {"alice": T0 + 9}


async def test_T2_a_created_key_is_in_force_at_once_and_survives_a_restart(store, config):
    keys, callers = owner(store, config)
    await keys.restore()
    policy = KeyPolicy(group="batch", models=["m*"], trust_user_header=True)
    record, secret = await keys.create("bob", policy)
    assert secret.startswith("ck-") and len(secret) >= 35 and record.prefix == secret[:7]
    caller = callers(secret)
    assert (caller.name, caller.group_name, caller.known, caller.identity.source) == (
        "bob",
        "batch",
        True,
        "api",
    )
    rows, _ = await table.read(store)
    assert secret not in repr(rows) and rows[0].digest == hash_text(secret)

    again, callers_again = owner(store, config)  # a restart: a new owner on the same store
    await again.restore()
    assert callers_again(secret).name == "bob"
    assert again.records["bob"].policy == policy


async def test_T2_names_in_use_config_keys_and_unknown_names_are_refused(store, config):
    keys, _ = owner(store, config)
    await keys.restore()
    await keys.create("bob", KeyPolicy(group="batch"))
    refusals = []
    for attempt in (
        keys.create("alice", KeyPolicy(group="batch")),
        keys.create(short_key_name("short-secret-0002"), KeyPolicy(group="batch")),
        keys.create("bob", KeyPolicy(group="batch")),
        keys.rotate("alice"),
        keys.revoke(short_key_name("short-secret-0002")),
        keys.rotate("nobody"),
        keys.revoke("nobody"),
    ):
        with pytest.raises((KeyExists, KeyInConfig, KeyNotFound)) as caught:
            await attempt
        refusals.append(type(caught.value).__name__)
    assert refusals == [
        "KeyExists",
        "KeyExists",
        "KeyExists",
        "KeyInConfig",
        "KeyInConfig",
        "KeyNotFound",
        "KeyNotFound",
    ]


async def test_T2_rotated_and_revoked_secrets_are_refused_as_such_even_after_a_restart(
    store, config
):
    keys, callers = owner(store, config)
    await keys.restore()
    _, first = await keys.create("bob", KeyPolicy(group="batch"))
    _, second = await keys.rotate("bob")
    assert callers(second).name == "bob"
    refused = callers(first)
    assert (refused.identity, refused.known, refused.refused.name, refused.refused.reason) == (
        None,
        False,
        "bob",
        "rotated",
    )
    await keys.revoke("bob")
    assert callers(second).refused.reason == "revoked" and "bob" not in keys.records
    assert callers("ck-never-issued").refused is None  # unknown, not refused

    again, callers_again = owner(store, config)
    await again.restore()
    assert [callers_again(s).refused.reason for s in (first, second)] == ["rotated", "revoked"]


async def test_T2_a_runtime_key_whose_group_this_config_lacks_is_served_in_the_default_lane(
    store, config
):
    keys, callers = owner(store, config)
    await keys.restore()
    _, secret = await keys.create("bob", KeyPolicy(group="batch"))
    without_batch = CONFIG.replace("batch: {weight: 1}, ", "").replace(": batch", ": default")
    callers.reconfigure(load_config_text(without_batch))
    caller = callers(secret)
    assert (caller.name, caller.group_name, caller.known) == ("bob", "default", True)


def test_T2_a_refused_secret_gets_401_invalid_api_key_naming_the_key_and_why() -> None:
    rotated = key_refused(Refused("bob", "rotated", T0))
    revoked = key_refused(Refused("bob", "revoked", T0))
    assert (rotated.status, rotated.code, revoked.status, revoked.code) == (
        401,
        "invalid_api_key",
        401,
        "invalid_api_key",
    )
    assert "'bob' was rotated at 2026-01-01 00:00 UTC" in rotated.message
    assert "new secret" in rotated.message
    assert "'bob' was revoked at 2026-01-01 00:00 UTC" in revoked.message


async def test_T2_last_used_is_kept_in_memory_and_written_in_batches(store, config):
    keys, _ = owner(store, config)
    await keys.restore()
    await keys.create("bob", KeyPolicy(group="batch"))
    keys.used("bob", T0 + 100)
    keys.used("alice", T0 + 101)  # a config key: in memory only
    keys.used(None, T0 + 102)
    keys.used("unknown", T0 + 103)
    assert keys.last_used == {"bob": T0 + 100, "alice": T0 + 101}
    assert (await table.read(store))[0][0].last_used is None  # nothing written yet
    await keys.flush()
    assert (await table.read(store))[0][0].last_used == T0 + 100


async def test_T2_config_keys_last_used_is_seeded_from_the_activity(store, config):
    log = ActivityLog(store)
    log.record(Activity(T0 + 3, "request", "alice", "interactive", "m", None, "/v1/x", 200))
    await log.flush()
    keys, _ = owner(store, config)
    await keys.restore()
    assert keys.last_used == {"alice": T0 + 3}


@POSTGRES_TIER
async def test_T2_X5_a_key_revoked_through_one_owner_is_refused_by_another_within_1s(
    postgres_url, config
):
    stores = [store_at(postgres_url), store_at(postgres_url)]
    for s in stores:
        await s.open()
    (a, _), (b, callers_b) = owner(stores[0], config), owner(stores[1], config)
    follower = asyncio.create_task(b.follow())
    try:
        await a.restore()
        await b.restore()
        _, secret = await a.create("bob", KeyPolicy(group="batch"))
        await until(lambda: callers_b(secret).name == "bob")
        await a.revoke("bob")
        began = time.monotonic()
        await until(lambda: callers_b(secret).refused is not None)
        assert time.monotonic() - began < 1.0
    finally:
        follower.cancel()
        for s in stores:
            await s.close()


async def until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
