"""SPEC §22 T3 against real processes: `corrallm serve` with named keys and fake backends,
driven by the official `openai` and `anthropic` SDKs. A key's `models` allowlist on every
surface and in /v1/models, its rpm, tpm and concurrency limits (429 `rate_limited` with
Retry-After, the x-ratelimit-* headers on every answer), its own `spendLimit` beside its
group's, the honest refusal of an estimate that no wait could fit, and (on a PostgreSQL
store shared by two gateways) rpm counted across them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.support.clients import closed_at_end
from tests.support.postgres import POSTGRES_TIER
from tests.support.processes import FakeBackend, Gateway, running_fake_backend, wait_for

HI = [{"role": "user", "content": "hi"}]
KEYS = """
keys:
  picky: {secret: sk-picky, models: ["qwen*", chat]}
  limited: {secret: sk-limited, limits: {rpm: 3, tpm: 100000}}
  tokens: {secret: sk-tokens, limits: {tpm: 500}}
  busy: {secret: sk-busy, limits: {concurrent: 1}}
  payer: {secret: sk-payer, group: thrifty, spendLimit: {usd: 0.1, window: 1h}}
  lane: {secret: sk-lane, group: thrifty}
"""


def config(fast: FakeBackend, slow: FakeBackend, paid: FakeBackend) -> str:
    return f"""
commandCosts: {{chat: {{}}, paid-api: {{paid: true}}}}
priorityGroups:
  thrifty: {{spendLimit: {{usd: 0.3, window: 1h}}}}
{KEYS}
models:
  qwen-small: {{backends: [{{proxy: "{fast.url}", maxConcurrent: 8}}]}}
  other:
    aliases: [chat]
    backends: [{{proxy: "{fast.url}", maxConcurrent: 8}}]
  forbidden: {{backends: [{{proxy: "{fast.url}", maxConcurrent: 8}}]}}
  slow: {{backends: [{{proxy: "{slow.url}", maxConcurrent: 4}}]}}
  paid:
    backends:
      - proxy: "{paid.url}"
        type: paid-api
        maxConcurrent: 8
        pricing: {{inputPerMillion: 0, outputPerMillion: 1000}}
"""


@pytest.fixture
def gw(gateway_factory, tmp_path: Path) -> Iterator[Gateway]:
    with (
        running_fake_backend(tmp_path, "--tokens", "200") as fast,
        running_fake_backend(tmp_path, "--tokens", "40", "--token-delay", "0.1") as slow,
        running_fake_backend(tmp_path, "--tokens", "40") as paid,
    ):
        yield gateway_factory(config(fast, slow, paid))


def client(gw: Gateway, key: str) -> openai.OpenAI:
    return closed_at_end(openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=30))


def rate_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("x-ratelimit-")}


def test_T3_the_allowlist_is_enforced_on_every_surface_and_in_the_models_list(gw):
    picky = client(gw, "sk-picky")
    assert picky.chat.completions.create(model="qwen-small", messages=HI).choices
    assert picky.chat.completions.create(model="chat", messages=HI).model  # an alias of other
    with pytest.raises(openai.PermissionDeniedError) as chat:
        picky.chat.completions.create(model="forbidden", messages=HI)
    with pytest.raises(openai.PermissionDeniedError) as responses:
        picky.responses.create(model="forbidden", input="hi")
    claude = closed_at_end(anthropic.Anthropic(base_url=gw.url, api_key="sk-picky", max_retries=0))
    with pytest.raises(anthropic.PermissionDeniedError) as messages:
        claude.messages.create(model="forbidden", max_tokens=10, messages=HI)  # type: ignore[arg-type]
    with pytest.raises(anthropic.PermissionDeniedError):
        claude.messages.count_tokens(model="forbidden", messages=HI)  # type: ignore[arg-type]
    assert (chat.value.code, responses.value.code) == ("model_not_allowed", "model_not_allowed")
    assert "'picky' may not use the model 'forbidden'" in chat.value.message
    assert messages.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    # /v1/models lists what the key may use, by name; a model it may not use is a 404.
    assert sorted(m.id for m in picky.models.list()) == ["other", "qwen-small"]
    with pytest.raises(openai.NotFoundError):
        picky.models.retrieve("forbidden")
    assert picky.models.retrieve("chat").id == "other"
    everyone = {m.id for m in client(gw, "sk-limited").models.list()}
    assert {"forbidden", "other", "qwen-small", "slow", "paid"} <= everyone


def test_T3_an_allowlist_changed_by_a_reload_is_in_force_at_once(gw):
    """A key's verdict per model is decided once per config: a reload that widens (or
    narrows) its allowlist applies from the next request."""
    picky = client(gw, "sk-picky")
    with pytest.raises(openai.PermissionDeniedError):
        picky.chat.completions.create(model="forbidden", messages=HI)
    assert picky.chat.completions.create(model="qwen-small", messages=HI).choices
    assert gw.config_path is not None
    text = gw.config_path.read_text()
    gw.config_path.write_text(text.replace('models: ["qwen*", chat]', "models: [forbid*]"))
    assert gw.api("POST", "config/reload").status_code == 200
    assert picky.chat.completions.create(model="forbidden", messages=HI).choices
    with pytest.raises(openai.PermissionDeniedError):
        picky.chat.completions.create(model="qwen-small", messages=HI)


def test_T3_rpm_refuses_with_retry_after_and_every_answer_carries_the_counts(gw):
    limited = client(gw, "sk-limited").with_options(max_retries=0)
    stream = limited.chat.completions.with_raw_response.create(
        model="qwen-small", messages=HI, max_tokens=10, stream=True
    )
    streamed = rate_headers(stream.http_response)
    assert sum(1 for _ in stream.parse()) > 1
    # A refusal before the limits (an unknown model) carries the counts, uncounted.
    missing = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "nope", "messages": HI},
        headers={"Authorization": "Bearer sk-limited"},
        timeout=30,
    )
    second = limited.chat.completions.with_raw_response.create(model="qwen-small", messages=HI)
    third = httpx.post(  # the Anthropic surface counts for the same key
        gw.v1 + "/messages",
        json={"model": "qwen-small", "max_tokens": 10, "messages": HI},
        headers={"x-api-key": "sk-limited"},
        timeout=30,
    )
    with pytest.raises(openai.RateLimitError) as refused:
        limited.chat.completions.create(model="qwen-small", messages=HI)
    over = refused.value.response
    retry = int(over.headers["retry-after"])
    assert (missing.status_code, third.status_code, refused.value.code) == (
        404,
        200,
        "rate_limited",
    )
    assert [
        rate_headers(r)["x-ratelimit-remaining-requests"]
        for r in (stream.http_response, missing, second.http_response, third, over)
    ] == ["2", "2", "1", "0", "0"]
    assert streamed["x-ratelimit-limit-requests"] == "3"
    assert streamed["x-ratelimit-limit-tokens"] == "100000"
    # The stream's estimate (its body's tokens and max_tokens 10) is reserved from the tokens.
    assert 100000 - 100 < int(streamed["x-ratelimit-remaining-tokens"]) < 100000 - 10
    assert 50 <= retry <= 60 and "limits.rpm: 3" in refused.value.message
    assert "Retry after" in refused.value.message


def test_T3_tpm_reserves_the_estimate_settles_the_usage_and_refuses_honestly(gw):
    tokens = client(gw, "sk-tokens")
    # An estimate over the whole limit: no wait can help, so no Retry-After.
    with pytest.raises(openai.RateLimitError) as hopeless:
        tokens.chat.completions.create(model="qwen-small", messages=HI, max_tokens=1000)
    assert "retry-after" not in hopeless.value.response.headers
    assert "exceed the limit 500: send a smaller max_tokens" in hopeless.value.message
    first = tokens.chat.completions.with_raw_response.create(
        model="qwen-small", messages=HI, max_tokens=200
    )
    usage = first.parse().usage
    assert usage is not None and usage.completion_tokens == 200
    # 200 + its prompt used; another 200 + prompt reserved would pass 500.
    assert int(rate_headers(first.http_response)["x-ratelimit-remaining-tokens"]) < 300
    with pytest.raises(openai.RateLimitError) as over:
        tokens.chat.completions.create(model="qwen-small", messages=HI, max_tokens=300)
    assert (
        over.value.code == "rate_limited"
        and 50 <= int(over.value.response.headers["retry-after"]) <= 60
    )
    assert tokens.chat.completions.create(model="qwen-small", messages=HI, max_tokens=100).choices


def test_T3_concurrent_counts_requests_held_and_a_client_gone_frees_its_place(gw):
    busy = client(gw, "sk-busy")
    stream = busy.chat.completions.create(model="slow", messages=HI, stream=True)
    next(iter(stream))  # running: its place is held
    with pytest.raises(openai.RateLimitError) as refused:
        busy.chat.completions.create(model="qwen-small", messages=HI)
    assert refused.value.response.headers["retry-after"] == "1"
    assert "limits.concurrent: 1" in refused.value.message
    stream.close()  # the client leaves mid-stream: its place is given back

    def served() -> bool:
        try:
            return bool(busy.chat.completions.create(model="qwen-small", messages=HI).choices)
        except openai.RateLimitError:
            return False

    wait_for(served, 10, 0.05, what="the place of the request whose client left")


def test_T3_a_keys_spendLimit_holds_beside_its_groups_and_refuses_honestly(gw):
    payer, lane = client(gw, "sk-payer"), client(gw, "sk-lane")
    # $0.04 a request: the key's $0.1 holds two; the group's $0.3 still has room.
    for _ in range(2):
        assert payer.chat.completions.create(model="paid", messages=HI, max_tokens=40).choices
    with pytest.raises(openai.RateLimitError) as key_over:
        payer.chat.completions.create(model="paid", messages=HI, max_tokens=40)
    assert lane.chat.completions.create(model="paid", messages=HI, max_tokens=40).choices
    assert key_over.value.code == "spend_limit"
    assert "The API key 'payer' has reached its spendLimit" in key_over.value.message
    assert int(key_over.value.response.headers["retry-after"]) > 3000
    # Estimates larger than a whole limit: the key's ($0.2 > $0.1), the group's ($0.4 > $0.3).
    with pytest.raises(openai.RateLimitError) as key_hopeless:
        payer.chat.completions.create(model="paid", messages=HI, max_tokens=200)
    with pytest.raises(openai.RateLimitError) as group_hopeless:
        lane.chat.completions.create(model="paid", messages=HI, max_tokens=400)
    for refused, estimate, limit in (
        (key_hopeless, "$0.20", "$0.10"),
        (group_hopeless, "$0.40", "$0.30"),
    ):
        assert refused.value.code == "spend_limit"
        assert "retry-after" not in refused.value.response.headers
        assert (
            f"the request's estimated cost {estimate} exceeds the limit {limit}: send max_tokens"
            in refused.value.message
        )
    # The activity rows charge the key by name.
    rows = wait_for(
        lambda: (
            (r := gw.api("GET", "activity?limit=50").json()["rows"])
            and sum(1 for x in r if x["key"] == "payer" and x["status"] == 200) == 2
            and r
        ),
        10,
        what="payer's rows",
    )
    assert all("sk-" not in str(row) for row in rows)


# -- across gateways ------------------------------------------------------------------------

SHARED_KEYS = "keys: {shared: {secret: sk-shared, limits: {rpm: 4}}}"


@POSTGRES_TIER
def test_T3_X5_rpm_is_counted_across_gateways_sharing_a_postgresql_store(
    gateway_factory, postgres_url: str, tmp_path: Path
):
    with running_fake_backend(tmp_path) as fast:
        text = f"""
{SHARED_KEYS}
models:
  m: {{backends: [{{proxy: "{fast.url}", maxConcurrent: 8}}]}}
"""
        a, b = (
            gateway_factory(text, home=tmp_path / f"home-{n}", env={"CORRALLM_DB": postgres_url})
            for n in "ab"
        )
        got = []
        for gw in (a, b, a, b, a, b):
            got.append(
                httpx.post(
                    gw.v1 + "/chat/completions",
                    json={"model": "m", "messages": HI},
                    headers={"Authorization": "Bearer sk-shared"},
                    timeout=30,
                )
            )
    assert [(r.status_code, r.headers.get("x-ratelimit-remaining-requests")) for r in got] == [
        (200, "3"),
        (200, "2"),
        (200, "1"),
        (200, "0"),
        (429, "0"),
        (429, "0"),
    ]
    assert got[4].json()["error"]["code"] == "rate_limited"
    assert 50 <= int(got[5].headers["retry-after"]) <= 60
