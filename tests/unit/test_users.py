"""SPEC §22 T4, in process: which callers may name the user behind their key, what a
header value becomes, the config's `auth.userHeader`, and the per-user usage read from a
real store. `tests/integration/test_users.py` proves the same through a running gateway."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from corrallm.auth.callers import USER_CHARS, user_named
from corrallm.config import ConfigError, load_config_text, summary
from corrallm.gateway import Gateway
from corrallm.observe.ring import Record, footprint
from corrallm.proxy.pipeline import Pipeline
from corrallm.store import queries
from corrallm.store.db import Store
from tests.support.activity_rows import load, req, write

H = 3600
T0 = 1_767_225_600  # 2026-01-01T00:00:00Z

CONFIG = """
auth: {userHeader: X-OpenWebUI-User-Email}
keys:
  webui: {secret: webui-secret-1, trustUserHeader: true}
  script: {secret: script-secret-2}
"""


def scope(**headers: str) -> dict[str, object]:
    raw = [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": raw}


def user(pipeline: Pipeline, **headers: str) -> str | None:
    request = scope(**headers)
    return pipeline.user_of(request, pipeline.identify(request))


@pytest.fixture
def pipeline(tmp_path: Path) -> Pipeline:
    return Pipeline(Gateway(load_config_text(CONFIG), tmp_path))


def test_T4_only_a_key_that_trusts_the_user_header_names_a_user(pipeline: Pipeline) -> None:
    email = "ada@example.com"
    named = {
        "trusted": user(
            pipeline, authorization="Bearer webui-secret-1", x_openwebui_user_email=email
        ),
        "other key": user(
            pipeline, authorization="Bearer script-secret-2", x_openwebui_user_email=email
        ),
        "unknown key": user(pipeline, x_api_key="nobody", x_openwebui_user_email=email),
        "no key": user(pipeline, x_openwebui_user_email=email),
        "trusted, no header": user(pipeline, authorization="Bearer webui-secret-1"),
        "trusted, blank": user(
            pipeline, authorization="Bearer webui-secret-1", x_openwebui_user_email="  "
        ),
    }
    assert named == {
        "trusted": email,
        "other key": None,
        "unknown key": None,
        "no key": None,
        "trusted, no header": None,
        "trusted, blank": None,
    }


def test_T4_the_header_read_follows_a_config_reload(pipeline: Pipeline) -> None:
    headers = {"authorization": "Bearer webui-secret-1", "x_openwebui_user_email": "ada@x.org"}
    assert user(pipeline, **headers) == "ada@x.org"
    renamed = CONFIG.replace("X-OpenWebUI-User-Email", "X-Forwarded-User")
    pipeline.gw.reconfigure(load_config_text(renamed))
    assert user(pipeline, **headers) is None
    assert user(pipeline, **headers, x_forwarded_user="bob") == "bob"
    pipeline.gw.reconfigure(load_config_text(CONFIG.replace("auth:", "#")))
    assert user(pipeline, **headers, x_forwarded_user="bob") is None


def test_T4_a_header_value_is_trimmed_and_cut_to_128_characters() -> None:
    long = "".join(str(i % 10) for i in range(300))
    assert user_named(long.encode()) == long[:USER_CHARS]
    assert USER_CHARS == 128
    assert user_named(b"  ada@example.com \t") == "ada@example.com"
    assert user_named("zoë@example.com".encode()) == "zoë@example.com"  # UTF-8
    assert user_named(b"zo\xeb") == "zoë"  # not UTF-8: Latin-1, as HTTP/1.1 allows
    assert user_named("é".encode() * 200) == "é" * 128  # characters, not bytes
    assert user_named(b"") is None


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ("Authorization", "carries the caller's credentials"),
        ("x-api-key", "carries the caller's credentials"),
        ("X User", "is not an HTTP header name"),
        ("X-User:", "is not an HTTP header name"),
    ],
)
def test_T4_auth_user_header_must_name_a_plain_header(header: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(f'auth: {{userHeader: "{header}"}}\n')
    (problem,) = caught.value.problems
    assert problem.startswith("auth.userHeader:") and why in problem


def test_T4_check_says_where_users_come_from_and_what_is_half_configured() -> None:
    assert "users: named by webui in the header X-OpenWebUI-User-Email" in summary(
        load_config_text(CONFIG)
    )
    no_trust = summary(load_config_text("auth: {userHeader: X-User}\n"))
    assert "no key has trustUserHeader" in no_trust
    no_header = summary(load_config_text(CONFIG.replace("auth:", "#")))
    assert "webui trust the user header but auth.userHeader is not set" in no_header


@pytest.fixture
async def store(tmp_path: Path):
    s = Store(tmp_path / "corrallm.db")
    await s.open()
    yield s
    await s.close()


async def test_T4_usage_by_user_sums_per_user_and_key_and_leaves_out_rows_without_one(
    store: Store,
) -> None:
    await write(
        store,
        req(T0 + 10, key="webui", usr="ada", prompt_tokens=10, completion_tokens=4, dwell_ms=6),
        req(T0 + H + 5, key="webui", usr="ada", prompt_tokens=1, cost_usd=0.5, dwell_ms=2),
        req(T0 + 20, key="webui", usr="bob", completion_tokens=7, energy_wh=0.25),
        req(T0 + 30, key="other", usr="ada", bytes=4096),
        req(T0 + 40, key="webui", prompt_tokens=99),  # no user named: left out
        req(T0 + 50, key=None, prompt_tokens=99),
        load(T0 + 60, key="webui", usr=None, energy_wh=8.0),  # a load names no user
        req(T0 + 2 * H + 1, key="webui", usr="ada", prompt_tokens=1000),  # out of range
    )
    rows = await queries.usage_by_user(store, T0, T0 + 2 * H)
    assert [(r["user"], r["key"]) for r in rows] == [
        ("ada", "other"),
        ("ada", "webui"),
        ("bob", "webui"),
    ]
    ada = rows[1]
    assert {k: ada[k] for k in ("requests", "prompt_tokens", "completion_tokens")} == {
        "requests": 2,
        "prompt_tokens": 11,
        "completion_tokens": 4,
    }
    assert (ada["cost_usd"], ada["dwell_ms_avg"]) == (0.5, 4.0)
    assert (rows[0]["bytes"], rows[2]["energy_wh"]) == (4096, 0.25)
    (late,) = await queries.usage_by_user(store, T0 + 2 * H, T0 + 3 * H)
    assert (late["user"], late["key"], late["requests"], late["prompt_tokens"]) == (
        "ada",
        "webui",
        1,
        1000,
    )


async def test_T4_activity_rows_show_and_filter_by_their_user(store: Store) -> None:
    await write(store, req(T0, key="webui", usr="ada"), req(T0 + 1, key="webui"))
    rows = await queries.activity(store, T0, T0 + H)
    assert [(r["key"], r["user"]) for r in rows] == [("webui", None), ("webui", "ada")]
    assert "usr" not in rows[0]
    (only,) = await queries.activity(store, T0, T0 + H, user="ada")
    assert only["user"] == "ada"


def test_T4_a_captures_user_counts_toward_its_size() -> None:
    base = Record(
        "r1", T0, "m", "m#0", "webui", "default", "/v1/chat/completions", 200, None, "{}", "{}",
        "utf-8", "utf-8", {}, {}, False, False, 2, 2,
    )  # fmt: skip
    assert footprint(replace(base, user="u" * 128)) - footprint(base) >= 128
