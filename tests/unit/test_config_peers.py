"""X1, X4 config: `peers`, `peerOrder`, `peerTimeout`; each problem with its YAML path."""

from __future__ import annotations

import textwrap

import pytest

from corrallm.config import Config, ConfigError, load_config_text


def load(text: str, **env: str) -> Config:
    return load_config_text(textwrap.dedent(text), env=env)


def problems_of(text: str, **env: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(text, **env)
    return caught.value.problems


def one_problem(text: str, **env: str) -> str:
    problems = problems_of(text, **env)
    assert len(problems) == 1, problems
    return problems[0]


def peer(url: str = "http://10.0.0.2:6502", token: str = "t", name: str = "box2") -> str:
    return f'peers: {{"{name}": {{url: "{url}", token: "{token}"}}}}\n'


def test_X1_peers_load_with_their_defaults() -> None:
    config = load(peer(token="${BOX2_TOKEN}"), BOX2_TOKEN="s3cret")
    assert config.peers["box2"].url == "http://10.0.0.2:6502"
    assert config.peers["box2"].token == "s3cret"
    assert (config.peer_order, config.peer_timeout) == ("last", 5.0)
    config = load(peer("https://box2.lan/") + "peerOrder: first\npeerTimeout: 1500ms\n")
    assert (config.peer_order, config.peer_timeout) == ("first", 1.5)
    assert load("models: {}\n").peers == {}


@pytest.mark.parametrize("url", ["10.0.0.2:6502", "ftp://10.0.0.2:6502", "http://:6502", "box2"])
def test_X1_a_peer_url_must_be_http(url: str) -> None:
    assert one_problem(peer(url)) == (
        f"peers.box2.url: '{url}' is not an http(s) URL; write it as http://host:port "
        "(the peer's corrallm, as its clients reach it)"
    )


@pytest.mark.parametrize("url", ["http://10.0.0.2:6502/v1", "http://10.0.0.2:6502/?x=1"])
def test_X1_a_peer_url_is_a_base_url(url: str) -> None:
    assert one_problem(peer(url)) == (
        f"peers.box2.url: '{url}' has a path; give the peer's base URL only (http://host:port)"
    )


@pytest.mark.parametrize("token", ["", "   "])
def test_X1_an_empty_token_is_refused(token: str) -> None:
    assert one_problem(peer(token=token)) == (
        "peers.box2.token: the token is empty (an unset ${VAR}?); it is the peer's admin "
        "token, the file admin.token in its home folder"
    )


def test_X1_an_unset_token_variable_and_a_missing_token_name_the_path() -> None:
    assert one_problem(peer(token="${BOX2_TOKEN}")) == (
        "peers.box2.token: environment variable BOX2_TOKEN is not set"
    )
    assert one_problem('peers: {box2: {url: "http://h:1"}}') == (
        "peers.box2.token: missing required key"
    )


@pytest.mark.parametrize(
    ("name", "path"), [("box 2", 'peers["box 2"]'), ("a@b", "peers.a@b"), ("a.b", 'peers["a.b"]')]
)
def test_X1_a_peer_name_is_letters_digits_dash_underscore(name: str, path: str) -> None:
    assert one_problem(peer(name=name)) == (
        f"{path}: peer name '{name}' must be letters, digits, '-' or '_': it names the "
        "peer's backends as <model>@<peer>"
    )


def test_X1_every_problem_is_reported_at_once() -> None:
    text = """
    peers:
      box2: {url: "10.0.0.2", token: ""}
      "box 3": {url: "http://h:1", token: t}
      box4: {url: "http://h:1", token: t, weight: 2}
    """
    assert sorted(p.split(":")[0] for p in problems_of(text)) == [
        "peers.box2.token",
        "peers.box2.url",
        "peers.box4.weight",
        'peers["box 3"]',
    ]


def test_X1_peer_order_and_peer_timeout_are_checked() -> None:
    assert one_problem("peerOrder: middle") == "peerOrder: must be 'last' or 'first', got 'middle'"
    assert one_problem("peerTimeout: 0s") == "peerTimeout: must be greater than 0, got 0.0"


def test_X1_a_config_cannot_set_a_backends_peer() -> None:
    text = 'models: {m: {backends: [{proxy: "http://127.0.0.1:9", peer: box2}]}}'
    assert one_problem(text) == (
        "models.m.backends[0].peer: 'peer' is set by corrallm on the backends it imports; "
        "list the other node under the top-level 'peers' instead"
    )


def test_X1_a_local_backend_cannot_take_a_peer_backends_name() -> None:
    text = peer() + 'models: {m: {backends: [{name: "m@box2", proxy: "http://127.0.0.1:9"}]}}'
    assert one_problem(text).startswith("models.m.backends[0].name:")
