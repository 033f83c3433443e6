"""SPEC §11 D1 and §10 P3: the dashboard, served by corrallm itself through a real gateway.

The sign-in sets the admin token as an HttpOnly SameSite=Strict cookie; every section's
data comes from the same service layer as the REST API; the economics ledger counts wakes
and sleeps into the store.
"""

from __future__ import annotations

import re
import sqlite3

import httpx
import pytest

from tests.support.processes import fake_cmd, wait_for

CONFIG = f"""
servers: {{box: {{pools: {{gpu0: 8GB, ram: 16GB}}, reserve: {{gpu0: 1GB}}}}}}
ledger: {{gpuHourPrice: 2.5}}
commandCosts:
  chat: {{generateWattsPerToken: 0.01, processWattsPerToken: 0.001}}
priorityGroups:
  gold: {{weight: 3}}
  bronze: {{weight: 1, interruptible: true, spendLimit: {{usd: 5, window: 1h}}}}
scheduler: {{defaultGroup: bronze}}
keys: {{sk-gold: gold}}
models:
  alpha:
    aliases: [first]
    backends:
      - cmd: "{fake_cmd("--load-seconds", "0.2")}"
        proxy: ${{PORT}}
        server: box
        ramUsage: {{gpu0: 2GB, ram: 1GB}}
  beta:
    backends:
      - cmd: "{fake_cmd()}"
        proxy: ${{PORT}}
        quality: 80
        ramUsage: {{gpu0: 4GB}}
"""


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(CONFIG)


@pytest.fixture
def signed_in():
    """Sign in to a gateway through the form; the client keeps the cookie."""
    clients: list[httpx.Client] = []

    def sign_in(gw) -> httpx.Client:
        client = httpx.Client(base_url=gw.url, timeout=30)
        clients.append(client)
        response = client.post("/signin", data={"token": gw.token})
        assert response.status_code == 303 and response.headers["location"] == "/"
        return client

    yield sign_in
    for client in clients:
        client.close()


def section(client: httpx.Client, name: str, **params: str) -> str:
    response = client.get(f"/ui/section/{name}", params=params)
    assert response.status_code == 200, response.text
    return response.text


def test_P3_dashboard_asks_for_the_token_and_sets_a_strict_httponly_cookie(gw):
    page = httpx.get(gw.url + "/", timeout=10)
    assert page.status_code == 303 and page.headers["location"] == "/signin"
    form = httpx.get(gw.url + "/signin", timeout=10)
    assert form.status_code == 200 and 'name="token"' in form.text
    assert 'for="token"' in form.text  # labelled for screen readers
    good = httpx.post(gw.url + "/signin", data={"token": gw.token}, timeout=10)
    assert good.status_code == 303
    cookie = good.headers["set-cookie"]
    assert cookie.startswith(f"corrallm_token={gw.token};")
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= flags
    # The cookie opens the dashboard and the management API alike.
    cookies = {"corrallm_token": gw.token}
    assert httpx.get(gw.url + "/", cookies=cookies, timeout=10).status_code == 200
    assert httpx.get(gw.url + "/api/v1/lanes", cookies=cookies, timeout=10).status_code == 200


def test_P3_a_wrong_token_says_so_and_sets_nothing(gw):
    wrong = httpx.post(gw.url + "/signin", data={"token": "nope"}, timeout=10)
    assert wrong.status_code == 401
    assert "set-cookie" not in wrong.headers
    assert "not the admin token" in wrong.text and 'role="alert"' in wrong.text
    assert httpx.get(gw.url + "/ui/section/overview", timeout=10).status_code == 401
    bad_cookie = {"corrallm_token": "nope"}
    assert httpx.get(gw.url + "/", cookies=bad_cookie, timeout=10).status_code == 303
    assert httpx.get(gw.url + "/ui/section/../api/v1/lanes", timeout=10).status_code in (401, 404)


def test_T5_signout_is_post_only_and_the_page_signs_out_with_a_form(gw, signed_in):
    client = signed_in(gw)
    # A link or an image on another page (a GET) signs nobody out.
    lured = client.get("/signout")
    assert lured.status_code == 405 and lured.headers["allow"] == "POST"
    assert "set-cookie" not in lured.headers
    assert client.get("/").status_code == 200  # still signed in
    # The page's Sign out control is a form that posts.
    assert '<form method="post" action="/signout">' in client.get("/").text
    out = client.post("/signout")
    assert out.status_code == 303 and out.headers["location"] == "/signin"
    assert "Max-Age=0" in out.headers["set-cookie"]
    assert client.get("/").status_code == 303  # signed out


def test_D1_page_is_self_contained_and_serves_its_own_assets(gw, signed_in):
    client = signed_in(gw)
    page = client.get("/")
    assert page.status_code == 200
    html = page.text
    for name in ("overview", "residency", "lanes", "usage", "logs", "economics", "definitions"):
        assert f'<section id="{name}"' in html
    assert '<section id="playground"' in html
    assert "http://" not in html and "https://" not in html  # no external requests
    assert "default-src 'self'" in page.headers["content-security-policy"]
    js = client.get("/ui/static/dashboard.js")
    assert js.status_code == 200 and "EventSource" in js.text
    assert '<script src="/ui/static/playground.js">' in html
    assert ".innerHTML" not in client.get("/ui/static/playground.js").text  # answers are text
    css = client.get("/ui/static/dashboard.css")
    assert "prefers-color-scheme: dark" in css.text
    assert "http" not in css.text  # no web fonts or remote images
    assert client.get("/ui/static/nope.js").status_code == 404


def test_D1_overview_shows_models_backends_state_and_pause(gw, signed_in):
    client = signed_in(gw)
    html = section(client, "overview")
    assert 'data-model="alpha"' in html and 'data-model="beta"' in html
    assert "alpha#0" in html or 'data-backend="alpha' in html
    assert html.count('data-testid="model-state">stopped<') == 2
    assert gw.api("POST", "models/load", {"model": "alpha"}).status_code == 200
    pid = gw.overview_backend(gw.api("GET", "overview").json()["models"][0]["backends"][0]["id"])[
        "pid"
    ]
    html = section(client, "overview")
    assert 'data-testid="model-state">ready<' in html
    assert f"<td>{pid}</td>" in html
    assert gw.api("POST", "models/pause", {"model": "beta", "until": "2h"}).status_code == 200
    html = section(client, "overview")
    assert 'data-testid="model-state">paused<' in html
    assert 'data-action="resume" data-model="beta"' in html
    assert "Z</td>" in html  # paused-until as an RFC 3339 time


def test_D1_residency_draws_declared_use_per_resident_as_stacked_bars(gw, signed_in):
    client = signed_in(gw)
    assert gw.api("POST", "models/load", {"model": "alpha"}).status_code == 200
    html = section(client, "residency")
    assert 'data-pool="gpu0"' in html and 'data-pool="ram"' in html
    backend = gw.api("GET", "residency").json()["servers"][0]["residents"][0]["backend"]
    assert f'data-resident="{backend}"' in html
    assert 'width="25.000"' in html  # 2 GB of 8 GB
    # M2: the legend says where the planned number comes from
    assert '<span data-footprint="declared">, 2.0 GB declared</span>' in html
    assert "1.0 GB reserved" in html and 'class="reserve"' in html


def test_D1_lanes_show_weights_shares_and_spend_limits(gw, signed_in):
    client = signed_in(gw)
    html = section(client, "lanes")
    assert 'data-lane="gold"' in html and 'data-lane="bronze"' in html
    assert "weight 75%" in html and "weight 25%" in html
    assert "of $5.00 per 1.0 h" in html
    assert "No live reservations." in html


def test_D1_usage_bars_per_key_and_lane_and_series(gw, signed_in):
    client = signed_in(gw)
    assert "No requests in this range." in section(client, "usage")
    for _ in range(3):
        r = httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sk-gold"},
            timeout=60,
        )
        assert r.status_code == 200

    def counted() -> str | None:
        html = section(client, "usage", range="hour")
        return html if "3 req" in html else None

    html = wait_for(counted, 15, 0.2, what="usage rows written")
    assert 'data-lane="gold"' in html and 'data-usage-bar="gold"' in html
    assert 'aria-pressed="true">hour<' in html
    keys = [row["key"] for row in gw.api("GET", "usage/by-key").json()["rows"]]
    assert all(f'data-key="{k}"' in html for k in keys if k)
    assert "Requests per bucket" in html and "Queue depth" in html
    for name in ("day", "week"):
        assert f'aria-pressed="true">{name}<' in section(client, "usage", range=name)


def test_D1_logs_show_a_backends_lines_and_parsed_context(gw, signed_in):
    client = signed_in(gw)
    assert gw.api("POST", "models/load", {"model": "alpha"}).status_code == 200
    api = gw.api("GET", "models/logs?model=alpha&lines=200").json()
    html = section(client, "logs", model="alpha")
    assert '<option value="alpha" selected>' in html
    assert api["lines"] and api["lines"][-1].split(" ")[-1] in html
    n_ctx = api["n_ctx"] if api["n_ctx"] is not None else "\N{EN DASH}"
    assert f'data-field="n_ctx">{n_ctx}<' in html


def test_D1_definitions_list_models_lanes_and_command_classes(gw, signed_in):
    html = section(signed_in(gw), "definitions")
    assert 'data-def-model="alpha"' in html and "aliases: first" in html
    assert 'data-def-lane="gold"' in html and 'data-def-lane="bronze"' in html
    assert 'data-def-command="chat"' in html
    assert "sk-gold" not in html  # API keys are secrets: never shown


def test_D1_economics_counts_wakes_and_sleeps_into_the_store(gw, signed_in):
    client = signed_in(gw)
    assert gw.api("POST", "models/load", {"model": "alpha"}).status_code == 200
    assert gw.api("POST", "models/unload", {"model": "alpha"}).status_code == 200
    html = section(client, "economics")
    row = html.split('data-econ="alpha')[1].split("</tr>")[0]
    assert 'data-field="wakes">1<' in row and 'data-field="sleeps">1<' in row
    assert "2.0 GB" in row  # its GPU footprint
    assert "avoided cost" in html and "$2.50" in html  # the assumption beside the number

    def stored() -> list[sqlite3.Row] | None:
        with sqlite3.connect(gw.home / "corrallm.db") as db:
            db.row_factory = sqlite3.Row
            rows = db.execute(
                "SELECT * FROM economics WHERE backend LIKE 'alpha%' AND sleeps = 1"
            ).fetchall()
        return rows or None

    rows = wait_for(stored, 10, 0.05, what="economics counters in the store")
    assert rows[0]["wakes"] == 1 and rows[0]["wake_count"] == 1
    assert rows[0]["wake_seconds_last"] >= 0.2  # the fake backend's load time


@pytest.mark.serve_process
def test_D1_C5_economics_counters_survive_a_restart(gateway_factory, tmp_path, signed_in):
    from tests.support.processes import cleanup

    first = gateway_factory(CONFIG, home=tmp_path / "shared-home")
    assert first.api("POST", "models/load", {"model": "beta"}).status_code == 200
    assert first.api("POST", "models/unload", {"model": "beta"}).status_code == 200
    first.signal(15)
    first.wait_exit()
    cleanup(first)
    second = gateway_factory(CONFIG, home=tmp_path / "shared-home")
    html = section(signed_in(second), "economics")
    row = html.split('data-econ="beta')[1].split("</tr>")[0]
    assert 'data-field="wakes">1<' in row and 'data-field="sleeps">1<' in row


AUDIO_CONFIG = f"""
commandCosts:
  chat: {{generateWattsPerToken: 0.001}}
  stt: {{modality: audio, processWattsPerByte: 0.001}}
  tts: {{modality: audio, generateWattsPerByte: 0.0001}}
models:
  diarist:
    backends:
      - {{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, modes: [batch], diarization: true}}
  ears:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt}}]
  half-diarist:
    backends:
      - {{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, diarization: true}}
      - {{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, quality: 50}}
  live-ears:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, modes: [realtime]}}]
  voice:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: tts}}]
  chat:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: chat}}]
"""


def test_D1_U4_playground_lists_batch_stt_models_and_marks_the_diarizing_ones(
    gateway_factory, signed_in
):
    gw = gateway_factory(AUDIO_CONFIG)
    html = section(signed_in(gw), "playground")
    options = dict(re.findall(r'<option value="([^"]+)" data-diarizes="(true|false)"', html))
    # Uploads only: not the realtime-only model, the TTS voice or the chat model.
    assert options == {
        "diarist": "true",
        "ears": "false",
        # A fall-through to its second backend would drop the speakers: not marked.
        "half-diarist": "false",
    }
    assert "diarist · diarizes<" in html and "ears · diarizes" not in html
    # The first model diarizes, so the form asks for the diarized shape by default.
    assert '<option value="diarized_json" selected>' in html
    assert 'name="response_format"' in html and 'name="file"' in html
    key_field = html.split('id="pg-key"')[1].split(">")[0]
    assert "name=" not in key_field  # never posted in the body, only as a header
    caps = httpx.get(gw.v1 + "/capabilities", timeout=10).json()
    assert caps["diarizing_models"] == ["diarist"]  # the same rule as the playground's


def test_D1_playground_says_when_no_model_takes_uploads(gw, signed_in):
    html = section(signed_in(gw), "playground")
    assert "No speech-to-text model takes uploads" in html and "<form" not in html


def test_D1_C1_small_costs_show_their_magnitude_not_zeros(gateway_factory, signed_in):
    """Energy costs about a millionth of a dollar a request: shown as such, never $0.0000."""
    gw = gateway_factory(
        CONFIG.replace("commandCosts:", "costPerKwh: 0.15\ncommandCosts:").replace(
            "generateWattsPerToken: 0.01", "generateWattsPerToken: 0.0001"
        )
    )
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60).status_code == 200
    client = signed_in(gw)

    def shown() -> str | None:
        html = section(client, "usage", range="hour")
        return html if "1 req" in html else None

    html = wait_for(shown, 15, 0.2, what="the request in the usage section")
    cost = gw.api("GET", "usage/by-key?since=1h").json()["rows"][0]["cost_usd"]
    assert 0 < cost < 1e-4  # the premise: a tiny amount
    assert "$0.0000 " not in html and re.search(r"req · \$[\d.]+[µn] ·", html), html
    # The dashboard's ledger is the API's: the same backends, from the same service.
    api_rows = [r["backend"] for r in gw.api("GET", "economics").json()["rows"]]
    ledger = section(client, "economics")
    assert api_rows and all(f'data-econ="{b}"' in ledger for b in api_rows)


# -- X6: the Nodes section ----------------------------------------------------------------

NODE = f"""
models:
  m:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
"""


def peered(gateway_factory, tmp_path):
    """A second node serving `m`, and a gateway that lists it as peer `b`: (node, gateway)."""
    node = gateway_factory(NODE, home=tmp_path / "node")
    config = f"peerTimeout: 2s\npeers: {{b: {{url: '{node.url}', token: '{node.token}'}}}}\n"
    return node, gateway_factory(config, home=tmp_path / "gateway")


def test_X6_nodes_section_says_plainly_when_no_peer_is_configured(gw, signed_in):
    html = section(signed_in(gw), "nodes")
    assert "No peers configured" in html and "<code>peers</code>" in html
    assert "<table" not in html and "data-peer=" not in html
    assert '<section id="nodes"' in signed_in(gw).get("/").text


@pytest.mark.serve_process
def test_X6_nodes_section_shows_a_peer_up_with_its_models_then_down(
    gateway_factory, tmp_path, signed_in
):
    node, gw = peered(gateway_factory, tmp_path)
    client = signed_in(gw)

    def showing(state: str, *also: str) -> str | None:
        html = section(client, "nodes")
        wanted = (f'data-peer="b" data-state="{state}"', *also)
        return html if all(w in html for w in wanted) else None

    html = wait_for(lambda: showing("up", 'data-backend="m@b"'), 20, 0.1, what="b up")
    assert node.url in html and '<th scope="row">m</th>' in html
    assert 'data-field="state">stopped<' in html and "0</span> / 1" in html
    # A state change on the node shows here (its lifecycle, followed over its events).
    assert node.api("POST", "models/load", {"model": "m"}).status_code == 200
    html = wait_for(lambda: showing("up", 'data-field="state">ready<'), 15, 0.1, what="ready")
    assert 'data-process="m#0"' in html

    node.proc.kill()  # outright; its backend's group goes at the fixture's cleanup
    html = wait_for(lambda: showing("down"), 15, 0.1, what="b down")
    assert 'data-field="peer-error"' in html and "last reported" in html
    assert 'data-backend="m@b"' in html  # what it served, as it last said
