"""Loading `corrallm.yaml` (SPEC §2): YAML, ${VAR}, schema errors, every problem at once."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.auth.keys import hash_text
from corrallm.config import (
    Config,
    ConfigError,
    backend_id,
    json_schema,
    load_config,
    load_config_text,
    load_demo_config,
    summary,
)
from corrallm.config.loading import demo_config_text
from corrallm.config.schema import short_key_name

ENV = {"OPENAI_API_KEY": "sk-test-123"}

# The example of SPEC §2, verbatim.
SPEC_EXAMPLE_YAML = """\
costPerKwh: 0.14                       # $ per kWh for local energy
commandCosts:                          # cost classes; a backend's `type` names one
  chat:  { generateWattsPerToken: 0.0013, processWattsPerToken: 0.00005 }  # Wh/token
  embed: { generateWattsPerToken: 0,      processWattsPerToken: 0.000002 }
  stt:   { modality: audio, processWattsPerByte: 0.0000001 }               # Wh/byte
  openai-paid: { paid: true }          # a paid class: priced per backend

servers:
  box1:
    pools:   { gpu0: 32GB, system: 125GB }   # capacity vector
    reserve: { gpu0: 1GB,  system: 24GB }    # headroom never handed out

extensions:                            # one process that hosts several models
  sherpa:
    cmd: "sherpa-adapter --port ${PORT}"
    server: box1
    ramUsage: { system: 2GB }
    proxy: ${PORT}

models:
  my-embeddings:
    persistent: true                   # pinned + preloaded at boot
    backends:
      - cmd: "llama-server --embeddings -m e.gguf --port 5801"
        server: box1
        ramUsage: { gpu0: 1.5GB, system: 1GB }
        proxy: 5801
        type: embed
        maxConcurrent: 1
  my-chat:
    aliases: [chat, default-chat]
    sticky: { ttl: 600s, evictCost: medium }
    backends:
      - cmd: "llama-server -m big.gguf -ngl 99 --port 5800"
        server: box1
        ramUsage: { gpu0: 29.5GB, system: 4GB }
        swap: { loadSeconds: 30, loadWatts: 250 }
        proxy: 5800
        type: chat
        quality: 100
        maxConcurrent: 2
      - cmd: "llama-server -m small.gguf --port 5802"
        server: box1
        ramUsage: { gpu0: 5GB }
        proxy: 5802
        type: chat
        quality: 60
        maxTokens: 512                 # clamp when serving degraded traffic
        maxConcurrent: 4
      - proxy: https://api.openai.com  # no cmd: pure proxy
        model: gpt-4o-mini             # name sent upstream
        headers: { Authorization: "Bearer ${OPENAI_API_KEY}" }
        type: openai-paid
        pricing: { inputPerMillion: 0.15, outputPerMillion: 0.60 }
        costFactor: 1.0
        quality: 90
        maxConcurrent: 16
  parakeet:
    backends:
      - extension: sherpa
        type: stt
        modes: [batch]                 # batch | realtime; empty = both
        diarization: true

priorityGroups:
  interactive:
    weight: 10
    shareCurrency: slotSeconds         # requests | slotSeconds | tokens | dollars
    onSaturated: { chat: { queue: true }, embed: { queue: true }, default: reject }
  batch:
    weight: 1
    interruptible: true
    acceptDegrade: true
    qualityFloor: 50
    spendLimit: { usd: 5.00, window: 24h }
    onSaturated: { chat: { queue: true, spill: true }, default: reject }

keys: { my-coder: interactive, my-indexer: batch }   # API key -> group
scheduler: { maxWait: 60s, maxQueueDepth: 8, defaultGroup: default }
realtime: { idleTimeout: 60s, maxDuration: 1h }       # realtime WebSocket sessions
ledger: { gpuHourPrice: 2.50 }                        # optional: show avoided cost
"""


@pytest.fixture
def spec_example(tmp_path: Path) -> Path:
    path = tmp_path / "corrallm.yaml"
    path.write_text(SPEC_EXAMPLE_YAML)
    return path


def problems_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config_text(textwrap.dedent(text), env=ENV if env is None else env)
    return caught.value.problems


def test_spec_example_config_loads_cleanly(spec_example: Path) -> None:
    config = load_config(spec_example, env=ENV)
    chat = config.models["my-chat"]
    assert chat.aliases == ["chat", "default-chat"]
    assert chat.sticky is not None and chat.sticky.ttl == 600.0
    assert chat.backends[0].ram_usage == {"gpu0": 29_500_000_000, "system": 4 * 10**9}
    assert chat.backends[0].proxy == "5800"
    assert chat.backends[2].headers == {"Authorization": "Bearer sk-test-123"}
    assert config.extensions["sherpa"].proxy == "${PORT}"
    assert config.priority_groups["batch"].on_saturated["default"].reject
    assert config.priority_groups["batch"].spend_limit is not None
    assert config.priority_groups["batch"].spend_limit.window == 86400.0
    # T1: short-form keys are named after their secret's digest; the secret is not kept.
    assert {n: k.group for n, k in config.keys.items()} == {
        short_key_name("my-coder"): "interactive",
        short_key_name("my-indexer"): "batch",
    }
    assert "my-coder" not in repr(config) and "my-indexer" not in repr(config)
    assert config.scheduler.max_queue_depth == 8


def test_empty_file_is_an_empty_config() -> None:
    assert load_config_text("") == Config()
    assert load_config_text("# nothing yet\n").models == {}


def test_top_level_must_be_a_mapping() -> None:
    assert problems_of("- a\n- b\n") == [
        "(top level): the config must be a mapping of keys (models, servers…), got a list"
    ]


def test_yaml_syntax_error_names_line_and_column() -> None:
    [problem] = problems_of("models:\n  a: [1\n")
    assert problem.startswith("line 3, column 1: invalid YAML:")


def test_unquoted_reference_in_flow_mapping_gets_a_quoting_hint() -> None:
    [problem] = problems_of("models: {m: {backends: [{cmd: x, proxy: ${PORT}}]}}")
    assert problem.endswith("quote references: proxy: '${PORT}'")


def test_yaml_python_tags_are_refused() -> None:
    [problem] = problems_of("costPerKwh: !!python/object/apply:os.getcwd []\n")
    assert "invalid YAML" in problem


def test_duplicate_keys_are_problems_not_silently_dropped() -> None:
    problems = problems_of("models:\n  a: {}\n  a: {backends: [{proxy: 1}]}\n")
    assert problems == [
        "models.a: given twice (lines 2 and 3); YAML would keep only the last, "
        "so remove or rename one"
    ]


def test_env_variables_are_substituted_everywhere_including_keys() -> None:
    config = load_config_text(
        textwrap.dedent("""
        models:
          m:
            backends:
              - proxy: ${UPSTREAM}
                maxConcurrent: ${SLOTS}
                headers: {Authorization: "Bearer ${TOKEN}"}
        keys: {"${CODER_KEY}": default}
        """),
        env={"UPSTREAM": "https://example.test", "SLOTS": "3", "TOKEN": "t", "CODER_KEY": "k1"},
    )
    backend = config.models["m"].backends[0]
    assert (backend.proxy, backend.max_concurrent) == ("https://example.test", 3)
    assert backend.headers["Authorization"] == "Bearer t"
    assert config.keys[short_key_name("k1")].secret_hash == hash_text("k1")


def test_unset_env_variable_is_a_problem_at_its_path() -> None:
    problems = problems_of(
        """
        models:
          m:
            backends:
              - proxy: https://api.openai.com
                headers: {Authorization: "Bearer ${OPENAI_API_KEY}"}
                maxConcurrent: ${SLOTS}
        """,
        env={},
    )
    assert problems == [
        "models.m.backends[0].headers.Authorization: "
        "environment variable OPENAI_API_KEY is not set",
        # only the env problem: no extra noise about the unparsable "${SLOTS}"
        "models.m.backends[0].maxConcurrent: environment variable SLOTS is not set",
    ]


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRALLM_TEST_UPSTREAM", "http://10.0.0.1:8000")
    text = "models: {m: {backends: [{proxy: '${CORRALLM_TEST_UPSTREAM}'}]}}"
    assert load_config_text(text).models["m"].backends[0].proxy == "http://10.0.0.1:8000"


def test_port_is_reserved_and_left_for_the_lifecycle() -> None:
    text = "models: {m: {backends: [{cmd: 'srv --port ${PORT}', proxy: '${PORT}'}]}}"
    backend = load_config_text(text, env={"PORT": "9999"}).models["m"].backends[0]
    assert (backend.cmd, backend.proxy) == ("srv --port ${PORT}", "${PORT}")


def test_double_dollar_escapes_a_literal_reference() -> None:
    text = "models: {m: {backends: [{proxy: 1, env: {X: '$${HOME}/a', Y: '$$x'}}]}}"
    backend = load_config_text(text, env={}).models["m"].backends[0]
    assert backend.env == {"X": "${HOME}/a", "Y": "$$x"}


def test_malformed_reference_is_a_problem() -> None:
    [problem] = problems_of("models: {m: {backends: [{proxy: 1, cwd: '${not a name}'}]}}")
    assert problem.startswith("models.m.backends[0].cwd: '${not a name}' is not a variable name")


def test_schema_errors_have_yaml_paths_and_human_messages() -> None:
    problems = problems_of(
        """
        models:
          my-chat:
            sticky: {evictCost: mid}
            backends:
              - proxy: 5800
                maxConcurrent: 0
                ramUsage: {gpu0: lots}
                quality: high
          empty: {backends: []}
          nothing: {}
        """
    )
    assert "models.my-chat.backends[0].maxConcurrent: must be at least 1, got 0" in problems
    assert "models.my-chat.sticky.evictCost: must be 'low', 'medium' or 'high', got 'mid'" in (
        problems
    )
    assert "models.my-chat.backends[0].quality: expected a whole number, got text" in problems
    size = "models.my-chat.backends[0].ramUsage.gpu0: expected a size like 512MB"
    assert any(p.startswith(size) for p in problems)
    assert "models.empty.backends: must list at least 1 item" in problems
    assert "models.nothing.backends: missing required key" in problems


def test_unknown_key_suggests_did_you_mean() -> None:
    problems = problems_of(
        """
        modelz: {}
        models: {m: {backends: [{proxy: 1, maxConcurent: 2}]}}
        scheduler: {maxWaiting: 5s}
        """
    )
    assert "modelz: unknown key (did you mean 'models'?)" in problems
    assert "models.m.backends[0].maxConcurent: unknown key (did you mean 'maxConcurrent'?)" in (
        problems
    )
    assert "scheduler.maxWaiting: unknown key (did you mean 'maxWait'?)" in problems


def test_snake_case_keys_are_refused_with_the_camel_case_spelling() -> None:
    [problem] = problems_of("models: {m: {backends: [{proxy: 1, max_concurrent: 2}]}}")
    assert problem == (
        "models.m.backends[0].max_concurrent: unknown key "
        "(did you mean 'maxConcurrent'? keys are camelCase)"
    )


def test_unknown_key_without_close_match_lists_the_allowed_keys() -> None:
    [problem] = problems_of("ledger: {zzz: 1}")
    assert problem == "ledger.zzz: unknown key; allowed here: gpuHourPrice"


def test_model_names_with_dots_are_quoted_in_paths() -> None:
    [problem] = problems_of("models: {qwen2.5: {backends: [{proxy: 1, quality: x}]}}")
    assert problem.startswith('models["qwen2.5"].backends[0].quality:')


def test_config_reports_every_problem_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        textwrap.dedent("""
        servers:
          box1: {pools: {gpu0: 8GB}, reserve: {gpu0: 9GB}}
        models:
          my-chat:
            backends:
              - cmd: llama-server --port 5800
                ramUsage: {gpu9: 1GB}
                maxConcurrent: -1
                typo: 1
              - proxy: ${PORT}
        priorityGroups: {batch: {weight: 0}}
        keys: {my-coder: bacth}
        """)
    )
    with pytest.raises(ConfigError) as caught:
        load_config(bad, env={})
    problems = caught.value.problems
    expected = [
        "servers.box1.reserve.gpu0: reserve 9GB is bigger than the pool's capacity 8GB",
        "models.my-chat.backends[0].ramUsage.gpu9: unknown pool 'gpu9' on server 'box1'",
        "models.my-chat.backends[0].maxConcurrent: must be at least 1, got -1",
        "models.my-chat.backends[0].proxy: missing proxy",
        "models.my-chat.backends[0].typo: unknown key",
        "models.my-chat.backends[1].proxy: ${PORT} needs cmd",
        "priorityGroups.batch.weight: must be greater than 0",
        "keys.my-c…: unknown group 'bacth' (did you mean 'batch'?)",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert len(problems) == len(expected)
    report = caught.value.report()
    assert report.splitlines()[0] == f"{bad}: invalid config, {len(expected)} problems:"
    assert "(line 3)" in report.splitlines()[1]  # the reserve line
    assert str(caught.value) == report


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path / "missing.yaml")


def test_demo_config_loads_and_uses_real_fake_backend_flags() -> None:
    from corrallm.fake_backend.options import build_parser

    config = load_demo_config()
    assert {"demo-chat", "demo-embed", "demo-rerank"} <= set(config.models)
    assert config.models["demo-chat"].aliases == ["chat", "gpt-4o-mini"]
    assert config.models["demo-embed"].backends[0].type == "embed"
    assert config.models["demo-rerank"].backends[0].type == "rerank"
    for model in config.models.values():
        for backend in model.backends:
            assert backend.cmd is not None and backend.proxy == "${PORT}"
            argv = shlex.split(backend.cmd.replace("${PORT}", "5999"))
            assert argv[:2] == ["corrallm", "fake-backend"]
            build_parser().parse_args(argv[2:])  # exits on an unknown flag
    assert "${PORT}" in demo_config_text()


def test_json_schema_is_camel_case_and_accepts_units() -> None:
    schema = json_schema()
    assert "models" in schema["properties"] and "maxBodySize" in schema["properties"]
    backend = schema["$defs"]["Backend"]["properties"]
    assert "maxConcurrent" in backend and "max_concurrent" not in backend
    assert {"type": "integer", "minimum": 1, "maximum": 65535} in backend["proxy"]["anyOf"]
    assert any(option.get("type") == "string" for option in backend["stopGrace"]["anyOf"])
    assert schema["$defs"]["Policy"]["anyOf"][0]["enum"] == ["preempt", "spill", "queue", "reject"]
    json.dumps(schema)


def test_summary_lists_backends_and_never_key_secrets(spec_example: Path) -> None:
    config = load_config(spec_example, env={"OPENAI_API_KEY": "sk-secret-xyz"})
    text = summary(config)
    for expected in (
        "box1",
        "gpu0 32GB",
        "my-chat#0",
        "maxConcurrent 16",
        "https://api.openai.com",
    ):
        assert expected in text
    assert "keys: 2" in text
    assert f"  {short_key_name('my-coder')}: group interactive" in text
    assert "2 short-form keys" in text  # T1: check suggests the named form
    for secret in ("my-coder", "my-indexer", "sk-secret-xyz"):
        assert secret not in text


def test_summary_redacts_secret_flags_and_url_credentials() -> None:
    config = load_config_text(
        "models: {m: {backends: [{cmd: 'srv --api-key abc --tokens 5', proxy: 1},"
        " {proxy: 'https://u:pw@example.test'}]}}"
    )
    text = summary(config)
    assert "--api-key ***" in text and "--tokens 5" in text
    assert "pw@" not in text


def test_backend_id_is_name_or_model_and_index() -> None:
    model = load_config_text("models: {m: {backends: [{proxy: 1}, {name: b, proxy: 2}]}}")
    backends = model.models["m"].backends
    assert [backend_id("m", i, b) for i, b in enumerate(backends)] == ["m#0", "b"]


yaml_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
    st.sampled_from(["", "x", "${PORT}", "${NOPE}", "5800", "1GB", "http://h:1", "queue"]),
)  # fmt: skip
yaml_keys = st.sampled_from(
    ["models", "backends", "servers", "pools", "ramUsage", "proxy", "cmd", "server", "keys",
     "extension", "extensions", "priorityGroups", "onSaturated", "type", "aliases", "x", "0"]
)  # fmt: skip
yaml_data = st.recursive(
    yaml_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(yaml_keys, inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None)
@given(yaml_data)
def test_any_yaml_gives_a_config_or_a_config_error(data: object) -> None:
    try:
        load_config_text(yaml.safe_dump(data), env={})
    except ConfigError as exc:
        assert exc.problems and all(": " in p for p in exc.problems)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corrallm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"OPENAI_API_KEY": "sk-test", "PATH": "/usr/bin:/bin"},
    )


def test_cli_check_prints_a_summary_for_a_good_config(spec_example: Path) -> None:
    result = run_cli("check", "--config", str(spec_example))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config OK: 3 models, 1 server")
    assert "my-chat#2" in result.stdout


def test_cli_check_lists_every_problem_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {m: {backends: [{cmd: x, maxConcurrent: 0}]}}\nmodelz: 1\n")
    result = run_cli("check", "--config", str(bad))
    assert result.returncode == 1
    assert f"{bad}: invalid config, 3 problems:" in result.stderr
    assert "models.m.backends[0].proxy: missing proxy" in result.stderr
    assert "models.m.backends[0].maxConcurrent: must be at least 1" in result.stderr
    assert "modelz: unknown key (did you mean 'models'?)" in result.stderr


def test_cli_config_schema_prints_json_schema() -> None:
    result = run_cli("config-schema")
    assert result.returncode == 0, result.stderr
    assert "models" in json.loads(result.stdout)["properties"]


K5_CONFIG = """
models:
  m:
    aliases: [chat, {name: chat-creative, setParams: {temperature: 1.1}}]
    filters:
      stripParams: [logprobs]
      setParams: {top_k: 40, chat_template_kwargs: {enable_thinking: false}}
      defaultParams: {temperature: 0.2}
    backends: [{proxy: 5800, contextLength: 8192}]
"""


def test_K5_alias_objects_load_and_the_names_stay_a_list_of_text() -> None:
    model = load_config_text(K5_CONFIG, env={}).models["m"]
    assert model.aliases == ["chat", "chat-creative"]
    assert [(a.name, a.set_params) for a in model.alias_specs] == [
        ("chat", {}),
        ("chat-creative", {"temperature": 1.1}),
    ]
    assert model.filters.strip_params == ["logprobs"]
    assert model.filters.default_params == {"temperature": 0.2}
    assert model.backends[0].context_length == 8192


def test_K5_check_summary_prints_each_models_filters_and_alias_params() -> None:
    text = summary(load_config_text(K5_CONFIG, env={}))
    assert (
        "  m  (aliases: chat, chat-creative)\n"
        "    filters: strip logprobs; default temperature=0.2; "
        'set top_k=40, chat_template_kwargs={"enable_thinking": false}\n'
        "    alias chat-creative: set temperature=1.1\n"
    ) in text


def test_K5_json_schema_takes_an_alias_as_a_name_or_an_object() -> None:
    schema = json_schema()
    aliases = schema["$defs"]["Model"]["properties"]["aliases"]
    alias = schema["$defs"]["Alias"]
    assert aliases["items"] == {"$ref": "#/$defs/Alias"}
    assert alias["anyOf"][0] == {"type": "string", "minLength": 1}
    assert set(alias["anyOf"][1]["properties"]) == {"name", "setParams"}
    assert set(schema["$defs"]["Filters"]["properties"]) == {
        "stripParams",
        "setParams",
        "defaultParams",
    }


def test_issue30_L6_maxConcurrent_left_out_takes_the_slots_of_llama_servers_np() -> None:
    """Issue 30: a llama-server started with `-np 4` got one slot, since maxConcurrent
    defaulted to 1. Left out, it now means the cmd's -np/--parallel (and `check` says so);
    given, it wins; another program's -np means nothing."""
    config = load_config_text(
        """
servers: {box: {pools: {gpu0: 24GB}}}
models:
  np:
    backends: [{cmd: "/opt/llama-server -m m.gguf -np 4 --port ${PORT}", proxy: "${PORT}",
                ramUsage: {gpu0: 1GB}}]
  parallel:
    backends: [{cmd: "llama-server --parallel=3 --port ${PORT}", proxy: "${PORT}",
                ramUsage: {gpu0: 1GB}}]
  given:
    backends: [{cmd: "llama-server -np 4 --port ${PORT}", proxy: "${PORT}", maxConcurrent: 2,
                ramUsage: {gpu0: 1GB}}]
  auto:
    backends: [{cmd: "llama-server -np -1 --port ${PORT}", proxy: "${PORT}",
                ramUsage: {gpu0: 1GB}}]
  other:
    backends: [{cmd: "vllm serve m -np 4 --port ${PORT}", proxy: "${PORT}",
                ramUsage: {gpu0: 1GB}}]
"""
    )
    slots = {name: m.backends[0].max_concurrent for name, m in config.models.items()}
    assert slots == {"np": 4, "parallel": 3, "given": 2, "auto": 1, "other": 1}
    text = summary(config)
    assert "np#0: type chat, quality 100, maxConcurrent 4 (from -np 4 in cmd)" in text
    assert "parallel#0: type chat, quality 100, maxConcurrent 3 (from --parallel 3 in cmd)" in text
    assert "given#0: type chat, quality 100, maxConcurrent 2  " in text


def test_issue30_a_cmd_port_that_disagrees_with_proxy_is_a_problem_at_its_path() -> None:
    """Issue 30: `--port 5801` with `proxy: 5800` passed `check`; the first request then
    waited the whole health timeout on a port nothing listened on."""
    with pytest.raises(ConfigError) as err:
        load_config_text(
            """
models:
  fixed: {backends: [{cmd: "srv --port 5801", proxy: 5800}]}
  url: {backends: [{cmd: "srv --port=5803", proxy: "http://127.0.0.1:5802/v1"}]}
  picked: {backends: [{cmd: "srv --port 5804", proxy: "${PORT}"}]}
  fine: {backends: [{cmd: "srv --port ${PORT}", proxy: "${PORT}"}]}
  same: {backends: [{cmd: "srv --port 5805", proxy: 5805}]}
"""
        )
    problems = err.value.problems
    assert [p.split(":")[0] for p in problems] == [
        "models.fixed.backends[0].cmd",
        "models.url.backends[0].cmd",
        "models.picked.backends[0].cmd",
    ], problems
    assert "listens on --port 5801, but proxy sends its requests to port 5800" in problems[0]
    assert "write --port ${PORT} in cmd (or proxy: 5804)" in problems[2]


def test_issue30_check_warns_of_a_missing_program_and_slot_save_folder_with_paths(
    tmp_path: Path,
) -> None:
    """Issue 30: a program not on PATH and a --slot-save-path folder that does not exist
    passed `check` silently. They read the machine, not the config (check may run where the
    programs are not installed), so they are warnings with the YAML path, as D4's are."""
    config = tmp_path / "c.yaml"
    config.write_text(
        f"""
extensions:
  gone: {{cmd: "/nowhere/adapter --port ${{PORT}}", proxy: "${{PORT}}"}}
models:
  m:
    backends:
      - cmd: "no-such-program-issue30 --port ${{PORT}}"
        proxy: "${{PORT}}"
      - cmd: "sh -c true --slot-save-path {tmp_path}/slots"
        proxy: "${{PORT}}"
        maxConcurrent: 1
      - cmd: "corrallm fake-backend --port ${{PORT}}"
        proxy: "${{PORT}}"
"""
    )
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert warned == [
        "warning: extensions.gone.cmd: program '/nowhere/adapter' not found (no such file: "
        "/nowhere/adapter): the process cannot start; install it or give its path",
        "warning: models.m.backends[0].cmd: program 'no-such-program-issue30' not found on "
        "PATH (/usr/bin:/bin): the process cannot start; install it or give its path",
        f"warning: models.m.backends[1].cmd: --slot-save-path {tmp_path}/slots: no such folder "
        f"({tmp_path}/slots); llama-server cannot save slots there: create it "
        f"(mkdir -p {tmp_path}/slots)",
    ], result.stdout
