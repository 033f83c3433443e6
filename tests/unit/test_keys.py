"""SPEC §22 T1: keys as identities held by digest; the caller a key is served as."""

from __future__ import annotations

import hashlib
from datetime import UTC, date, datetime

from typer.testing import CliRunner

from corrallm.auth.callers import Callers
from corrallm.auth.keys import UNKNOWN, Identity, KeyRing, digest_of, expiry, hash_text
from corrallm.cli import app
from corrallm.config.loading import load_config_text
from corrallm.config.schema import short_key_name

CONFIG = """
priorityGroups: {interactive: {weight: 4}, batch: {}}
keys:
  sk-short-one: batch
  alice:
    secret: sk-alice-secret
    group: interactive
    models: ["qwen*", chat]
    expires: 2027-01-31
  bob: {secretHash: "BOB"}
""".replace("BOB", hash_text("sk-bob-secret"))


def ring() -> tuple[KeyRing, Callers]:
    config = load_config_text(CONFIG)
    keys = KeyRing()
    keys.reconfigure(config.keys)
    return keys, Callers(config, keys)


def test_T1_keys_are_found_by_their_secrets_digest_and_hold_no_secret():
    keys, _ = ring()
    assert keys.resolve("sk-alice-secret").name == "alice"  # type: ignore[union-attr]
    assert keys.resolve("sk-bob-secret").name == "bob"  # type: ignore[union-attr]
    assert keys.resolve("sk-short-one").name == short_key_name("sk-short-one")  # type: ignore[union-attr]
    assert keys.resolve("sk-alice-secreT") is None and keys.resolve("") is None
    assert (
        short_key_name("sk-short-one") == "key-" + hashlib.sha256(b"sk-short-one").hexdigest()[:8]
    )
    held = repr([(i, i.digest) for i in keys.all()])
    assert "sk-alice-secret" not in held and "sk-short-one" not in held
    assert keys.find(digest_of("sk-bob-secret")).name == "bob"  # type: ignore[union-attr]


def test_T1_a_caller_is_its_keys_name_unknown_or_none():
    _, callers = ring()
    alice = callers("sk-alice-secret")
    assert (alice.name, alice.group_name, alice.known) == ("alice", "interactive", True)
    assert callers("sk-alice-secret") is alice  # cached per digest
    stranger = callers("sk-not-configured")
    assert (stranger.name, stranger.group_name, stranger.known) == (UNKNOWN, "default", False)
    nobody = callers(None)
    assert (nobody.name, nobody.known) == (None, False)
    bob = callers("sk-bob-secret")
    assert (bob.name, bob.group_name) == ("bob", "default")  # no group: the default lane
    lane = callers(None, signed="batch")  # X3: a lane a peer signed stands for the key
    assert (lane.name, lane.group_name, lane.known) == (None, "batch", True)
    assert callers(None, signed="nope").known is False  # not configured here (T5)


def test_T1_a_date_is_valid_through_its_whole_day_utc():
    end = expiry(date(2027, 1, 31))
    assert end == datetime(2027, 2, 1, tzinfo=UTC).timestamp()
    alice = Identity("alice", None, b"", expires=end)
    assert not alice.expired(end - 1) and alice.expired(end)
    assert expiry(datetime(2027, 1, 31, 12)) == datetime(2027, 1, 31, 12, tzinfo=UTC).timestamp()


def test_T3_the_allowlist_matches_names_and_aliases_by_glob_case_sensitively():
    keys, _ = ring()
    alice = keys.named("alice")
    assert alice is not None
    assert alice.allows(["qwen-7b"]) and alice.allows(["other", "chat"])
    assert not alice.allows(["chat-2"]) and not alice.allows(["Qwen-7b"])
    assert Identity("open", None, b"").allows(["anything"])


def test_T1_keys_hash_prints_the_digest_of_a_secret_read_from_stdin():
    runner = CliRunner()
    done = runner.invoke(app, ["keys", "hash"], input="sk-alice-secret\n")
    assert done.exit_code == 0, done.output
    assert done.output.strip() == hash_text("sk-alice-secret")
    assert done.output.strip().startswith("sha256:") and "sk-alice" not in done.output
    empty = runner.invoke(app, ["keys", "hash"], input="")
    assert empty.exit_code == 1 and "no secret on stdin" in empty.output
