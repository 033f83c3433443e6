"""Cross-field config rules (SPEC §2): each problem with its YAML path."""

from __future__ import annotations

import textwrap

import pytest

from corrallm.config import Config, ConfigError, load_config_text

TWO_SERVERS = """
servers:
  box1: {pools: {gpu0: 32GB, system: 64GB}}
  box2: {pools: {gpu0: 8GB}}
"""
ONE_SERVER = "servers: {box1: {pools: {gpu0: 32GB, system: 64GB}}}\n"


def load(text: str) -> Config:
    return load_config_text(textwrap.dedent(text), env={})


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(text)
    return caught.value.problems


def one_problem(text: str) -> str:
    problems = problems_of(text)
    assert len(problems) == 1, problems
    return problems[0]


def backend(fields: str, prelude: str = ONE_SERVER) -> str:
    return prelude + f"models:\n  m:\n    backends:\n      - {fields}\n"


def test_unknown_server_suggests_did_you_mean() -> None:
    problem = one_problem(backend("{cmd: x, proxy: 5800, server: box3}", TWO_SERVERS))
    assert problem == (
        "models.m.backends[0].server: unknown server 'box3' (did you mean 'box2'?); "
        "servers: box1, box2"
    )


def test_unknown_server_of_an_extension() -> None:
    problem = one_problem("extensions: {sh: {cmd: x, proxy: 1, server: nope}}")
    assert problem == "extensions.sh.server: unknown server 'nope'; no servers are configured"


def test_server_required_when_several_servers_and_backend_uses_ram_or_cmd() -> None:
    problem = one_problem(backend("{cmd: x, proxy: 5800}", TWO_SERVERS))
    assert problem == (
        "models.m.backends[0].server: missing: 2 servers are configured (box1, box2); "
        "say which one runs this"
    )
    assert one_problem(backend("{proxy: 5800, ramUsage: {gpu0: 1GB}}", TWO_SERVERS)).startswith(
        "models.m.backends[0].server: missing"
    )


def test_pure_proxy_needs_no_server_and_one_server_is_implied() -> None:
    load(backend("{proxy: 'https://api.openai.com'}", TWO_SERVERS))
    problem = one_problem(backend("{cmd: x, proxy: 1, ramUsage: {gpu1: 1GB}}"))
    assert problem == "models.m.backends[0].ramUsage.gpu1: unknown pool 'gpu1' on server 'box1'"


def test_ram_usage_naming_a_pool_the_server_lacks() -> None:
    text = backend("{cmd: x, proxy: 1, server: box1, ramUsage: {gpu9: 1GB, gpu0: 1GB}}")
    assert problems_of(text) == [
        "models.m.backends[0].ramUsage.gpu9: unknown pool 'gpu9' on server 'box1'"
    ]


def test_ram_usage_without_any_server() -> None:
    problem = one_problem(backend("{cmd: x, proxy: 1, ramUsage: {gpu0: 1GB}}", prelude=""))
    assert problem.startswith("models.m.backends[0].ramUsage: no servers are configured")


def test_reserve_naming_unknown_pool_or_bigger_than_capacity() -> None:
    problems = problems_of("servers: {b: {pools: {gpu0: 8GB}, reserve: {gpu0: 9GB, gpu1: 1GB}}}")
    assert problems == [
        "servers.b.reserve.gpu0: reserve 9GB is bigger than the pool's capacity 8GB",
        "servers.b.reserve.gpu1: unknown pool 'gpu1' on server 'b' (did you mean 'gpu0'?)",
    ]
    load("servers: {b: {pools: {gpu0: 8GB}, reserve: {gpu0: 8GB}}}")


def test_cmd_without_proxy() -> None:
    assert one_problem(backend("{cmd: llama-server}")) == (
        "models.m.backends[0].proxy: missing proxy: give the port the process listens on, "
        "e.g. proxy: 5800 or proxy: ${PORT}"
    )
    assert one_problem("extensions: {sh: {cmd: x}}").startswith(
        "extensions.sh.proxy: missing proxy"
    )


def test_backend_with_nothing_to_serve_from() -> None:
    problem = one_problem(backend("{type: chat}"))
    assert problem.startswith("models.m.backends[0]: a backend needs cmd + proxy")


@pytest.mark.parametrize(
    ("proxy", "message"),
    [
        ("0", "port must be 1 to 65535, got 0"),
        ("70000", "port must be 1 to 65535, got 70000"),
        ("localhost:8080", "(did you mean 'http://localhost:8080'?)"),
        ("ftp://host", "must be a port (5800), an http(s):// URL or ${PORT}, got 'ftp://host'"),
        ("'http://'", "the URL has no host"),
        ("'http://h:99999'", "not a valid URL"),
    ],
)
def test_proxy_must_be_port_url_or_port_placeholder(proxy: str, message: str) -> None:
    problem = one_problem(backend(f"{{proxy: {proxy}}}"))
    assert problem.startswith("models.m.backends[0].proxy: ") and message in problem


@pytest.mark.parametrize(
    "proxy",
    [
        "5800",
        "'http://127.0.0.1:5800/v1'",
        "https://x.test",
        "'${PORT}'",
        "'http://127.0.0.1:${PORT}'",
        "'http://localhost:${PORT}/v1'",
    ],
)
def test_valid_proxies(proxy: str) -> None:
    load(backend(f"{{cmd: x, proxy: {proxy}}}"))


def test_port_placeholder_in_proxy_needs_cmd() -> None:
    for proxy in ("'${PORT}'", "'http://127.0.0.1:${PORT}'"):
        assert one_problem(backend(f"{{proxy: {proxy}}}")).startswith(
            "models.m.backends[0].proxy: ${PORT} needs cmd"
        )


@pytest.mark.parametrize(
    "proxy", ["'http://gpu-box:${PORT}'", "'http://127.0.0.1:80${PORT}'", "'x${PORT}'"]
)
def test_port_placeholder_only_alone_or_as_a_loopback_urls_port(proxy: str) -> None:
    problem = one_problem(backend(f"{{cmd: srv, proxy: {proxy}}}"))
    assert problem.startswith("models.m.backends[0].proxy: ${PORT} stands alone")


def test_two_processes_on_one_fixed_port_name_both() -> None:
    problems = problems_of(
        """
        extensions: {sh: {cmd: sherpa, proxy: 5800}}
        models:
          a: {backends: [{cmd: x, proxy: 5800}]}
          b: {backends: [{cmd: y, proxy: 'http://localhost:5800'}]}
        """
    )
    assert problems == [
        "models.a.backends[0].proxy: port 5800 of backend 'a#0' is also the port of "
        "extension 'sh' (extensions.sh.proxy); two processes cannot listen on one port",
        "models.b.backends[0].proxy: port 5800 of backend 'b#0' is also the port of "
        "extension 'sh' (extensions.sh.proxy); two processes cannot listen on one port",
    ]


def test_pure_proxies_may_share_a_running_server() -> None:
    load("models: {a: {backends: [{proxy: 8080}]}, b: {backends: [{proxy: 8080}]}}")


def test_extension_must_exist_and_host_alone() -> None:
    problems = problems_of(
        """
        extensions: {sherpa: {cmd: s, proxy: '${PORT}'}}
        models:
          a: {backends: [{extension: sherpaa}]}
          b: {backends: [{extension: sherpa, cmd: x, proxy: 1}]}
        """
    )
    assert problems == [
        "models.a.backends[0].extension: unknown extension 'sherpaa' (did you mean 'sherpa'?); "
        "extensions: sherpa",
        "models.b.backends[0].cmd: a backend hosted by extension 'sherpa' must not set cmd: "
        "the extension's process serves it",
        "models.b.backends[0].proxy: a backend hosted by extension 'sherpa' must not set proxy: "
        "the extension's process serves it",
    ]


def test_extension_backend_needs_no_server_of_its_own() -> None:
    load(
        TWO_SERVERS
        + "extensions: {sh: {cmd: s, proxy: 1, server: box1}}\n"
        + "models: {p: {backends: [{extension: sh}]}}"
    )


def test_duplicate_backend_ids_across_models() -> None:
    problems = problems_of(
        """
        models:
          a: {backends: [{name: shared, proxy: 1}, {proxy: 2}]}
          b: {backends: [{name: shared, proxy: 3}, {name: 'a#1', proxy: 4}]}
        """
    )
    assert problems == [
        "models.b.backends[0].name: backend id 'shared' is also the id of "
        "models.a.backends[0]; give one of them a different name",
        "models.b.backends[1].name: backend id 'a#1' is also the id of "
        "models.a.backends[1]; give one of them a different name",
    ]


def test_alias_colliding_with_a_model_name_or_alias() -> None:
    problems = problems_of(
        """
        models:
          a: {aliases: [chat, a], backends: [{proxy: 1}]}
          b: {aliases: [chat, a], backends: [{proxy: 2}]}
        """
    )
    assert problems == [
        "models.b.aliases[0]: alias 'chat' is also an alias of model 'a'",
        "models.b.aliases[1]: alias 'a' is already the name of model 'a'",
    ]


def test_type_must_name_a_command_cost_when_there_are_any() -> None:
    prelude = "commandCosts: {chat: {}, embed: {}}\n"
    problem = one_problem(backend("{proxy: 1, type: embedd}", prelude))
    assert problem == (
        "models.m.backends[0].type: type 'embedd' is not in commandCosts "
        "(did you mean 'embed'?); known types: chat, embed"
    )
    no_chat = "commandCosts: {embed: {}}\n"
    assert "the default when no type is given" in one_problem(backend("{proxy: 1}", no_chat))
    load(backend("{proxy: 1, type: anything}", prelude=""))


def test_keys_must_map_to_a_known_group() -> None:
    problem = one_problem(
        """
        priorityGroups: {batch: {}, interactive: {}}
        keys: {sk-secret-value: bacth, k2: default, k3: interactive}
        """
    )
    assert problem == (
        "keys.sk-s…: unknown group 'bacth' (did you mean 'batch'?); "
        "priorityGroups: batch, interactive"
    )
    assert "secret-value" not in problem


def test_keys_may_map_to_the_default_group() -> None:
    load("scheduler: {defaultGroup: fallback}\nkeys: {k1: fallback, k2: default}")


def test_on_saturated_keys_are_default_or_a_known_type() -> None:
    problem = one_problem(
        backend("{proxy: 1, type: chat}", prelude="")
        + "priorityGroups: {g: {onSaturated: {chat: queue, default: reject, chta: spill}}}"
    )
    assert problem == (
        "priorityGroups.g.onSaturated.chta: unknown type 'chta' (did you mean 'chat'?); "
        "use 'default' or a backend type (chat)"
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ("{proxy: 1, supervision: docker}", ["dockerContainer"]),
        ("{proxy: 1, supervision: systemd}", ["systemdUnit"]),
        ("{proxy: 1, supervision: command}", ["cmd", "stop"]),
    ],
)
def test_supervision_needs_its_keys(fields: str, expected: list[str]) -> None:
    problems = problems_of(backend(fields, prelude=""))
    mode = fields.split("supervision: ")[1].rstrip("}")
    assert problems == [
        f"models.m.backends[0].{key}: missing: supervision: {mode} needs {key}" for key in expected
    ]


def test_supervised_backends_load_when_complete() -> None:
    load(
        backend("{proxy: 1, supervision: docker, dockerContainer: llm}", prelude="")
        + "      - {proxy: 2, supervision: systemd, systemdUnit: llm.service}\n"
        + "      - {cmd: systemctl start x, stop: systemctl stop x, proxy: 3,"
        + " supervision: command}\n"
    )


def test_quality_floor_without_accept_degrade_and_persistent_pure_proxy_are_fine() -> None:
    load(
        "priorityGroups: {g: {qualityFloor: 50}}\n"
        "models: {m: {persistent: true, backends: [{proxy: 'https://x.test'}]}}"
    )


def test_negative_spend_limit_and_max_concurrent_are_errors() -> None:
    problems = problems_of(
        backend("{proxy: 1, maxConcurrent: -2}", prelude="")
        + "priorityGroups: {g: {spendLimit: {usd: -5}}}"
    )
    assert problems == [
        "models.m.backends[0].maxConcurrent: must be at least 1, got -2",
        "priorityGroups.g.spendLimit.usd: must be at least 0, got -5",
    ]


def test_cross_field_rules_still_run_when_the_schema_fails() -> None:
    problems = problems_of(backend("{cmd: x, proxy: 1, server: box9, maxConcurrent: many}"))
    assert sorted(problems) == [
        "models.m.backends[0].maxConcurrent: expected a whole number, got text",
        "models.m.backends[0].server: unknown server 'box9' (did you mean 'box1'?); servers: box1",
    ]


def test_K5_filters_never_touch_model_or_stream_each_with_its_path() -> None:
    problems = problems_of(
        """
        models:
          m:
            aliases: [chat, {name: hot, setParams: {temperature: 1.1, stream: true}}]
            filters:
              stripParams: [logprobs, model]
              setParams: {model: other, top_k: 40}
              defaultParams: {stream: false, temperature: 0.2}
            backends: [{proxy: 1}]
        """
    )
    assert problems == [
        "models.m.aliases[1].setParams.stream: 'stream' cannot be set by a filter: corrallm "
        "reads it to relay and meter the answer; the caller decides",
        "models.m.filters.stripParams[1]: 'model' cannot be stripped by a filter: corrallm "
        "routes by it; a backend's own model: key names the model sent upstream",
        "models.m.filters.setParams.model: 'model' cannot be set by a filter: corrallm "
        "routes by it; a backend's own model: key names the model sent upstream",
        "models.m.filters.defaultParams.stream: 'stream' cannot be defaulted by a filter: "
        "corrallm reads it to relay and meter the answer; the caller decides",
    ]


def test_K5_filter_and_alias_shapes_are_checked_with_the_rest() -> None:
    problems = problems_of(
        """
        models:
          m:
            aliases: [5, {nme: x}, {name: hot, stripParams: [x]}]
            filters: {stripParams: model, setParam: {}}
            backends: [{proxy: 1}]
        """
    )
    assert problems == [
        "models.m.aliases[0]: expected an alias name or a mapping such as "
        "{name: chat-creative, setParams: {temperature: 1.1}}",
        "models.m.aliases[1].name: missing required key",
        "models.m.aliases[1].nme: unknown key (did you mean 'name'?)",
        "models.m.aliases[2].stripParams: unknown key (did you mean 'setParams'?)",
        "models.m.filters.stripParams: expected a list, got text",
        "models.m.filters.setParam: unknown key (did you mean 'setParams'?)",
    ]


def test_K5_an_alias_object_collides_like_a_plain_alias() -> None:
    problems = problems_of(
        """
        models:
          a: {aliases: [chat], backends: [{proxy: 1}]}
          b: {aliases: [{name: chat, setParams: {temperature: 1}}], backends: [{proxy: 2}]}
        """
    )
    assert problems == ["models.b.aliases[0].name: alias 'chat' is also an alias of model 'a'"]


def test_E1_ollama_listen_must_be_an_address() -> None:
    problem = one_problem("ollama: {listen: localhost}\n")
    assert "ollama.listen" in problem and ":6502" in problem, problem
    assert load("ollama: {listen: '127.0.0.1:11434'}\n").ollama.listen == "127.0.0.1:11434"
    assert load("models: {}\n").ollama.listen is None
