"""SPEC §22 T2 against real `corrallm serve` processes: keys made, listed, rotated and
revoked through the management API (REST and GraphQL), used by the official `openai` SDK
against a fake backend; kept in the store across a restart; and on a shared PostgreSQL
store (a throwaway cluster, tests/support/postgres.py), a revocation through one gateway
refused by another within a second of its answer (measured, and printed with `-s`)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from corrallm.config.schema import short_key_name
from tests.support.clients import closed_at_end
from tests.support.postgres import POSTGRES_TIER
from tests.support.processes import FakeBackend, Gateway, wait_for

SHORT_SECRET = "short-secret-0002"
SHORT = short_key_name(SHORT_SECRET)
CONFIG = f"""
priorityGroups: {{batch: {{weight: 1}}, interactive: {{weight: 4}}}}
keys:
  alice: {{secret: alice-secret-0001, group: interactive}}
  {SHORT_SECRET}: batch
models:
  m: {{backends: [{{proxy: PORT}}]}}
"""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def start(gateway_factory, fake_backend: FakeBackend, tmp_path: Path):
    """`start(home=…, env=…)`: a gateway on the fake backend (no process of its own)."""

    def start(**kwargs: object) -> Gateway:
        return gateway_factory(CONFIG.replace("PORT", str(fake_backend.port)), **kwargs)

    return start


@pytest.fixture
def gw(start) -> Gateway:
    return start()


def sdk(gw: Gateway, secret: str) -> openai.OpenAI:
    return closed_at_end(openai.OpenAI(base_url=gw.v1, api_key=secret, max_retries=0, timeout=30))


def chat(gw: Gateway, secret: str) -> httpx.Response:
    """One request with the bare HTTP client (for polling: no SDK retries or exceptions)."""
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.post(gw.v1 + "/chat/completions", json=CHAT, headers=headers, timeout=30)


def create(gw: Gateway, **fields: object) -> dict:
    made = gw.api("POST", "keys", {"group": "batch", **fields})
    assert made.status_code == 201, made.text
    return made.json()


def error(answer: httpx.Response) -> tuple[int, str, str]:
    body = answer.json()["error"]
    return answer.status_code, body["code"], body["message"]


def listed(gw: Gateway) -> dict[str, dict]:
    answer = gw.api("GET", "keys")
    assert answer.status_code == 200, answer.text
    return {k["name"]: k for k in answer.json()["keys"]}


def test_T2_a_key_made_through_the_api_serves_the_sdk_and_shows_by_name_never_its_secret(gw):
    made = create(gw, name="bob", models=["m"], limits={"rpm": 100, "perUser": {"rpm": 10}})
    secret = made.pop("secret")
    assert secret.startswith("ck-") and len(secret) >= 35
    assert made == {
        "name": "bob",
        "group": "batch",
        "source": "api",
        "prefix": secret[:7],
        "models": ["m"],
        "limits": {
            "rpm": 100,
            "tpm": None,
            "concurrent": None,
            "perUser": {"rpm": 10, "tpm": None, "concurrent": None},
        },
        "spendLimit": None,
        "expires": None,
        "created": made["created"],
        "trustUserHeader": False,
    }
    assert made["created"].endswith("Z")

    with sdk(gw, secret) as client:
        answer = client.chat.completions.with_raw_response.create(**CHAT)
    assert answer.status_code == 200
    request_id = answer.headers["x-corrallm-request-id"]

    def row() -> dict | None:
        rows = gw.api("GET", "activity?key=bob").json()["rows"]
        return next((r for r in rows if r["request_id"] == request_id), None)

    assert wait_for(row, 10, what="bob's activity row")["group"] == "batch"

    keys = listed(gw)
    assert [(k["name"], k["source"], k["prefix"]) for k in keys.values()] == [
        ("alice", "config", None),
        (SHORT, "config", None),
        ("bob", "api", secret[:7]),
    ]
    assert keys[SHORT]["group"] == "batch" and keys["alice"]["created"] is None
    assert keys["bob"]["last_used"] is not None and keys["alice"]["last_used"] is None
    page = httpx.get(gw.url + "/ui/section/keys", headers={"Authorization": f"Bearer {gw.token}"})
    assert page.status_code == 200 and "rpm 100 (per user: rpm 10)" in page.text
    assert secret[3:] not in page.text and "sha256" not in page.text
    text = gw.api("GET", "keys").text + gw.api("GET", "activity").text
    for hidden in (secret, "digest", "sha256", "alice-secret-0001", SHORT_SECRET):
        assert hidden not in text
    assert secret not in gw.log()


def test_T2_rotation_refuses_the_old_secret_at_once_and_revocation_the_key_without_requireKeys(
    gw,
):
    secret = create(gw, name="bob")["secret"]
    assert chat(gw, secret).status_code == 200
    rotated = gw.api("POST", "keys/bob/rotate")
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["secret"]
    assert new != secret and rotated.json()["prefix"] == new[:7]

    # The old secret is refused as such: never served in the default lane (no requireKeys).
    with sdk(gw, secret) as client, pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(**CHAT)
    assert refused.value.code == "invalid_api_key"
    assert "'bob' was rotated" in refused.value.message
    with sdk(gw, new) as client:
        assert client.chat.completions.create(**CHAT).choices
    assert chat(gw, "ck-never-issued-by-anyone").status_code == 200  # unknown keys: served

    revoked = gw.api("DELETE", "keys/bob")
    assert (revoked.status_code, revoked.json()) == (200, {"name": "bob", "revoked": True})
    status, code, message = error(chat(gw, new))
    assert (status, code) == (401, "invalid_api_key") and "'bob' was revoked" in message
    assert error(chat(gw, secret))[:2] == (401, "invalid_api_key")
    assert "bob" not in listed(gw)
    assert error(gw.api("DELETE", "keys/bob"))[:2] == (404, "key_not_found")


def test_T2_names_in_use_config_keys_unknown_names_and_bad_fields_are_refused(gw):
    create(gw, name="bob")
    for name in ("alice", SHORT, "bob"):
        status, code, message = error(gw.api("POST", "keys", {"name": name, "group": "batch"}))
        assert (status, code) == (409, "key_exists") and f"'{name}'" in message
    for name in ("alice", SHORT):
        for method, path in (("POST", f"keys/{name}/rotate"), ("DELETE", f"keys/{name}")):
            status, code, message = error(gw.api(method, path))
            assert (status, code) == (409, "key_in_config") and f"keys.{name}" in message
    for method, path in (("POST", "keys/nobody/rotate"), ("DELETE", "keys/nobody")):
        assert error(gw.api(method, path))[:2] == (404, "key_not_found")

    bad = {
        "name": "not a name!",
        "group": "bacth",
        "limits": {"rpm": 0},
        "spendLimit": {"usd": -1},
        "expires": "someday",
        "colour": "red",
    }
    status, code, message = error(gw.api("POST", "keys", bad))
    assert (status, code) == (400, "invalid_request")
    for problem in (
        "name: String should match pattern",
        "limits.rpm: Input should be greater than or equal to 1",
        "spendLimit.usd: Input should be greater than or equal to 0",
        "expires: must be a date (2027-01-31) or an RFC 3339 time (2027-01-31T18:00:00Z), "
        "got 'someday'",
        "colour: Extra inputs are not permitted",
        "group: unknown group 'bacth' (did you mean 'batch'?)",
    ):
        assert problem in message
    assert error(gw.api("POST", "keys", {"name": "carol"}))[:2] == (400, "invalid_request")
    assert set(listed(gw)) == {"alice", SHORT, "bob"}


@pytest.mark.serve_process
def test_T2_keys_made_through_the_api_and_their_last_use_survive_a_restart(start, tmp_path):
    home = tmp_path / "home"
    first = start(home=home)
    secret = create(first, name="bob", expires="2999-12-31", trustUserHeader=True)["secret"]
    assert chat(first, secret).status_code == 200
    used = listed(first)["bob"]["last_used"]
    first.signal(signal.SIGTERM)
    # last_used reaches the store every few seconds, and at stop at the latest (uvicorn
    # re-raises the signal it handled once it has stopped the gateway).
    assert first.wait_exit() in (0, -signal.SIGTERM)

    again = start(home=home)
    bob = listed(again)["bob"]  # before any request here: what the store kept
    assert (bob["expires"], bob["trustUserHeader"], bob["source"]) == ("2999-12-31", True, "api")
    assert bob["last_used"] == used
    assert chat(again, secret).status_code == 200


def test_T2_graphql_twins_make_list_rotate_and_revoke_keys_through_the_same_services(gw):
    def graphql(query: str) -> dict:
        headers = {"Authorization": f"Bearer {gw.token}"}
        answer = httpx.post(gw.url + "/api/graphql", json={"query": query}, headers=headers)
        assert answer.status_code == 200, answer.text
        return answer.json()

    made = graphql(
        'mutation { createKey(name: "bob", group: "batch", models: ["m"], '
        'spendLimit: {usd: 5, window: "1d"}) { name source prefix secret '
        "spendLimit { usd window } } }"
    )["data"]["createKey"]
    assert (made["name"], made["source"], made["spendLimit"]) == (
        "bob",
        "api",
        {"usd": 5.0, "window": 86400.0},
    )
    assert chat(gw, made["secret"]).status_code == 200
    page = httpx.get(gw.url + "/ui/section/keys", headers={"Authorization": f"Bearer {gw.token}"})
    assert "per 1.0 d" in page.text and made["secret"] not in page.text
    names = graphql("{ keys { keys { name source lastUsed } } }")["data"]["keys"]["keys"]
    assert [(k["name"], k["source"]) for k in names] == [
        ("alice", "config"),
        (SHORT, "config"),
        ("bob", "api"),
    ]
    new = graphql('mutation { rotateKey(name: "bob") { secret } }')["data"]["rotateKey"]["secret"]
    assert error(chat(gw, made["secret"]))[:2] == (401, "invalid_api_key")
    assert chat(gw, new).status_code == 200
    refused = graphql('mutation { revokeKey(name: "alice") { revoked } }')["errors"][0]
    assert refused["extensions"] == {"code": "key_in_config", "status": 409}
    assert graphql('mutation { revokeKey(name: "bob") { revoked } }')["data"]["revokeKey"] == {
        "revoked": True
    }
    assert error(chat(gw, new))[:2] == (401, "invalid_api_key")
    bad = graphql('mutation { createKey(name: "x y", group: "nope") { name } }')["errors"][0]
    assert bad["extensions"]["code"] == "invalid_request"
    assert "name: String should match" in bad["message"] and "group 'nope'" in bad["message"]


@POSTGRES_TIER
def test_T2_X5_a_key_revoked_on_one_gateway_is_refused_on_another_within_1s(
    start, postgres_url, tmp_path
):
    a = start(home=tmp_path / "home-a", env={"CORRALLM_DB": postgres_url})
    b = start(home=tmp_path / "home-b", env={"CORRALLM_DB": postgres_url})
    secret = create(a, name="bob")["secret"]
    wait_for(lambda: chat(b, secret).status_code == 200, 5, what="B serving A's new key")
    assert listed(b)["bob"]["source"] == "api"

    revoked = a.api("DELETE", "keys/bob")
    answered = time.monotonic()
    assert revoked.status_code == 200, revoked.text
    wait_for(lambda: chat(b, secret).status_code == 401, 1.0, 0.005, "B refusing the key")
    took = time.monotonic() - answered
    print(f"\nrevoked through A, refused by B {took * 1000:.0f} ms after A's answer")
    assert error(chat(b, secret))[1] == "invalid_api_key"
    assert "bob" not in listed(b)
    assert error(b.api("DELETE", "keys/bob"))[:2] == (404, "key_not_found")
