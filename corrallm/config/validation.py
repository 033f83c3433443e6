"""Cross-field config rules, each problem as `(location, message)`.

Locations are tuples of keys and list indices, as in the YAML (`("models", "my-chat",
"backends", 0, "ramUsage", "gpu9")`); `format_path` turns them into the text the
operator reads (`models.my-chat.backends[0].ramUsage.gpu9`).

The cross-field rules read the raw YAML data (after `${VAR}` substitution) rather than
the validated `Config`, so they still run when the schema itself fails: the operator
sees every problem in one pass. They therefore check the shape of each value they use
and skip what the schema errors already cover.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic.alias_generators import to_camel

from corrallm.config.schema import ANY_GPU, PORT_PLACEHOLDER
from corrallm.config.units import format_size, parse_size

Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]

_PLAIN_KEY = re.compile(r"^[^.\[\]\s\"']+$")
_KEY_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def mask_key(key: str) -> str:
    """An API key shown in a path: its first characters only, never the whole secret."""
    if "${" in key or len(key) <= 4:
        return key
    return key[:4] + "…"


def format_path(loc: Loc) -> str:
    """`models.my-chat.backends[0].proxy`; keys with dots or spaces are quoted."""
    out = ""
    for depth, part in enumerate(loc):
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
            continue
        text = str(part)
        if depth == 1 and loc[0] == "keys":
            text = mask_key(text)
        if _PLAIN_KEY.match(text):
            out += f".{text}" if out else text
        else:
            out += f'["{text}"]'
    return out or "(top level)"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)`, or `` when nothing is close."""
    options = sorted({c for c in choices if isinstance(c, str)})
    camel = to_camel(word) if "_" in word else ""
    if camel in options:
        return f" (did you mean '{camel}'? keys are camelCase)"
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# -- cross-field rules ----------------------------------------------------------------


def _map(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _proxy_text(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _text(value)


def _saves_slots(cmd: str | None) -> bool:
    """The cmd passes llama-server --slot-save-path (W2)."""
    try:
        argv = shlex.split(cmd or "")
    except ValueError:
        return False
    return any(a == "--slot-save-path" or a.startswith("--slot-save-path=") for a in argv)


def _names(items: Iterable[str]) -> str:
    listed = sorted(items)
    return ", ".join(listed) if listed else "none"


def _fixed_loopback_port(proxy: str) -> int | None:
    """The 127.0.0.1 port a proxy targets, when it is fixed in the config."""
    if proxy.isdigit():
        return int(proxy)
    if PORT_PLACEHOLDER in proxy or not proxy.startswith(("http://", "https://")):
        return None
    try:
        parts = urlsplit(proxy)
        return parts.port if parts.hostname in _LOOPBACK else None
    except ValueError:
        return None


# llama-swap's spelling: the port corrallm picks, in a URL on this machine.
_PORT_URL = re.compile(r"https?://(127\.0\.0\.1|localhost|\[::1\]):\$\{PORT\}(/[^\s$]*)?")


def _proxy_problem(proxy: str, has_cmd: bool) -> str | None:
    if PORT_PLACEHOLDER in proxy:
        if proxy != PORT_PLACEHOLDER and not _PORT_URL.fullmatch(proxy):
            return (
                "${PORT} stands alone (proxy: ${PORT}) or is the port of a loopback URL "
                "(proxy: http://127.0.0.1:${PORT}, optionally with a path such as /v1)"
            )
        if has_cmd:
            return None
        return (
            "${PORT} needs cmd: corrallm picks the port when it starts the process; "
            "a backend it does not start needs a fixed port or URL"
        )
    if proxy.isdigit():
        port = int(proxy)
        return None if 1 <= port <= 65535 else f"port must be 1 to 65535, got {port}"
    if proxy.startswith(("http://", "https://")):
        try:
            parts = urlsplit(proxy)
            _ = parts.port
        except ValueError as exc:
            return f"not a valid URL: {exc}"
        return None if parts.hostname else "the URL has no host"
    hint = ""
    if re.fullmatch(r"[\w.\-]+:\d+", proxy):
        hint = f" (did you mean 'http://{proxy}'?)"
    return f"must be a port (5800), an http(s):// URL or ${{PORT}}, got {proxy!r}{hint}"


def _cmd_port(cmd: str | None) -> str | None:
    """The value of `--port` in a cmd (the last one given), as written."""
    try:
        argv = shlex.split(cmd or "")
    except ValueError:
        return None
    found = None
    for index, arg in enumerate(argv):
        if arg == "--port" and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith("--port="):
            found = arg.partition("=")[2]
    return found


def _port_mismatch(cmd: str | None, proxy: str) -> str | None:
    """Issue 30: a cmd's `--port N` that disagrees with its proxy's port: the first request
    would wait out the whole health timeout on a port nothing listens on."""
    listens = _cmd_port(cmd)
    if listens is None or not listens.isdigit():
        return None  # no --port, or ${PORT}: the port corrallm gives it
    if PORT_PLACEHOLDER in proxy:
        return (
            f"the process listens on --port {listens}, but proxy: {proxy} has corrallm pick "
            f"a free port and wait for it there: write --port {PORT_PLACEHOLDER} in cmd "
            f"(or proxy: {listens})"
        )
    if proxy.isdigit():
        port: int | None = int(proxy)
    else:
        try:
            parts = urlsplit(proxy)
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            return None
    if port is None or int(listens) == port:
        return None
    return (
        f"the process listens on --port {listens}, but proxy sends its requests to port "
        f"{port}: make them the same (or write {PORT_PLACEHOLDER} in both, and corrallm "
        "picks a free port)"
    )


# K5: corrallm routes by `model` (renaming it per backend with `model:`) and reads `stream`
# itself to relay and meter the answer; no filter may change either.
UNTOUCHABLE_PARAMS = ("model", "stream")


def _untouchable(name: str, verb: str) -> str:
    why = {
        "model": "corrallm routes by it; a backend's own model: key names the model sent upstream",
        "stream": "corrallm reads it to relay and meter the answer; the caller decides",
    }[name]
    return f"'{name}' cannot be {verb} by a filter: {why}"


class _Checker:
    """Collects cross-field problems over the raw config data."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.problems: list[Problem] = []
        self.servers = {k: _map(v) for k, v in _map(data.get("servers")).items()}
        self.extensions = _map(data.get("extensions"))
        self.models = _map(data.get("models"))
        self.command_costs = _map(data.get("commandCosts"))
        self.groups = _map(data.get("priorityGroups"))
        # port -> (loc of the proxy, label, started by corrallm)
        self.ports: dict[int, list[tuple[Loc, str, bool]]] = {}

    def add(self, loc: Loc, message: str) -> None:
        self.problems.append((loc, message))

    def run(self) -> list[Problem]:
        self.check_servers()
        for name, ext in self.extensions.items():
            if isinstance(ext, Mapping):
                self.check_process(("extensions", name), f"extension '{name}'", ext)
        self.check_models()
        self.check_ports()
        self.check_groups()
        self.check_keys()
        self.check_peers()
        return self.problems

    def check_servers(self) -> None:
        for name, server in self.servers.items():
            pools = _map(server.get("pools"))
            gpus = server.get("gpus")
            for index, gpu in enumerate(gpus if isinstance(gpus, list) else []):
                if isinstance(gpu, str) and gpu not in pools:
                    hint = did_you_mean(gpu, pools)
                    self.add(
                        ("servers", name, "gpus", index),
                        f"unknown pool '{gpu}' on server '{name}'{hint}; each GPU in gpus "
                        f"is one of its pools ({_names(pools)})",
                    )
            for pool, amount in _map(server.get("reserve")).items():
                loc: Loc = ("servers", name, "reserve", pool)
                if pool not in pools:
                    hint = did_you_mean(str(pool), pools)
                    self.add(loc, f"unknown pool '{pool}' on server '{name}'{hint}")
                    continue
                try:
                    reserve, capacity = parse_size(amount), parse_size(pools[pool])
                except (ValueError, OverflowError):
                    continue  # the schema errors say why
                if reserve > capacity:
                    self.add(
                        loc,
                        f"reserve {format_size(reserve)} is bigger than the pool's "
                        f"capacity {format_size(capacity)}",
                    )

    def resolve_server(self, loc: Loc, raw: Mapping[str, Any]) -> str | None:
        """The server a process runs on (reporting a bad or missing `server`)."""
        if "server" in raw:
            name = _text(raw["server"])
            if name is None or name in self.servers:
                return name
            if self.servers:
                known = f"servers: {_names(self.servers)}"
                hint = did_you_mean(name, self.servers)
            else:
                known, hint = "no servers are configured", ""
            self.add((*loc, "server"), f"unknown server '{name}'{hint}; {known}")
            return None
        if len(self.servers) == 1:
            return next(iter(self.servers))
        needs_server = bool(_map(raw.get("ramUsage"))) or raw.get("cmd") is not None
        hosted = raw.get("extension") is not None  # its extension says where it runs
        if len(self.servers) > 1 and needs_server and not hosted:
            self.add(
                (*loc, "server"),
                f"missing: {len(self.servers)} servers are configured "
                f"({_names(self.servers)}); say which one runs this",
            )
        return None

    def check_process(self, loc: Loc, label: str, raw: Mapping[str, Any]) -> None:
        """Rules shared by model backends and extensions."""
        server = self.resolve_server(loc, raw)
        for key in ("ramUsage", "sleepUsage"):
            self.check_pools((*loc, key), _map(raw.get(key)), server)
        self.check_sleep(loc, raw)

        cmd, proxy = _text(raw.get("cmd")), _proxy_text(raw.get("proxy"))
        supervision = raw.get("supervision", "process")
        hosted = raw.get("extension") is not None
        if not hosted:
            if cmd is not None and raw.get("proxy") is None:
                self.add(
                    (*loc, "proxy"),
                    "missing proxy: give the port the process listens on, "
                    "e.g. proxy: 5800 or proxy: ${PORT}",
                )
            elif cmd is None and raw.get("proxy") is None:
                what = "an extension" if loc[0] == "extensions" else "a backend"
                self.add(
                    loc,
                    f"{what} needs cmd + proxy (a process corrallm starts), proxy alone "
                    "(a server that is already running)"
                    + (
                        ", or extension (a process hosting several models)"
                        if loc[0] == "models"
                        else ""
                    ),
                )
        if proxy is not None:
            problem = _proxy_problem(proxy, cmd is not None)
            if problem:
                self.add((*loc, "proxy"), problem)
            else:
                mismatch = _port_mismatch(cmd, proxy)
                if mismatch:
                    self.add((*loc, "cmd"), mismatch)
                port = _fixed_loopback_port(proxy)
                started = cmd is not None or supervision in ("docker", "systemd", "command")
                if port is not None:
                    self.ports.setdefault(port, []).append(((*loc, "proxy"), label, started))

        required = {
            "docker": ["dockerContainer"],
            "systemd": ["systemdUnit"],
            "command": ["cmd", "stop"],
        }.get(supervision if isinstance(supervision, str) else "", [])
        for key in required:
            if raw.get(key) is None:
                self.add((*loc, key), f"missing: supervision: {supervision} needs {key}")

    def check_sleep(self, loc: Loc, raw: Mapping[str, Any]) -> None:
        """sleep, sleepUsage and slotSave need a process corrallm runs (SPEC §18)."""
        cmd = _text(raw.get("cmd"))
        runs = cmd is not None or raw.get("supervision") in ("docker", "systemd", "command")
        if raw.get("extension") is not None:
            for key in ("sleep", "sleepUsage", "slotSave"):
                if raw.get(key):
                    self.add(
                        (*loc, key),
                        f"a hosted backend has no process of its own: put {key} on its extension",
                    )
            return
        if raw.get("sleep") is not None and not runs:
            self.add(
                (*loc, "sleep"),
                "a pure proxy is never started or stopped, so it cannot sleep: give it a "
                "cmd, or remove sleep",
            )
        if _map(raw.get("sleepUsage")) and raw.get("sleep") is None:
            self.add(
                (*loc, "sleepUsage"),
                "what a backend holds asleep needs a way to put it to sleep: add sleep: "
                "{kind: vllm, level: 1} (or kind: http), or remove sleepUsage",
            )
        if raw.get("slotSave") is True and not _saves_slots(cmd):
            self.add(
                (*loc, "slotSave"),
                "slotSave needs a llama-server cmd started with --slot-save-path DIR "
                "(where its slot caches are written); add it to cmd, or remove slotSave",
            )

    def check_pools(self, loc: Loc, usage: Mapping[str, Any], server: str | None) -> None:
        """A footprint (ramUsage, sleepUsage) names pools of its server, or `gpu`."""
        if server is not None:
            pools = _map(self.servers[server].get("pools"))
            gpus = self.servers[server].get("gpus")
            gpus = [g for g in gpus if isinstance(g, str)] if isinstance(gpus, list) else []
            for pool in usage:
                if pool == ANY_GPU and pool not in pools:
                    if not gpus:
                        self.add(
                            (*loc, pool),
                            f"'{ANY_GPU}' means any of the server's gpus, and server "
                            f"'{server}' lists none: add gpus: [gpu0, gpu1] to "
                            f"servers.{server}, or name the pool",
                        )
                    elif placed := sorted(set(usage) & set(gpus)):
                        self.add(
                            (*loc, pool),
                            f"'{ANY_GPU}' (placed on one of the server's gpus) cannot be "
                            f"combined with {', '.join(placed)} from the same gpus",
                        )
                elif pool not in pools:
                    self.add((*loc, pool), f"unknown pool '{pool}' on server '{server}'")
        elif usage and not self.servers:
            self.add(
                loc,
                "no servers are configured, so there are no pools to count this against; "
                f"add a servers section or remove {loc[-1]}",
            )

    def check_models(self) -> None:
        ids: dict[str, Loc] = {}
        alias_owner: dict[str, str] = {}
        costs = set(self.command_costs)
        for model, spec in self.models.items():
            spec = _map(spec)
            if model == "unknown":  # T5: what rows and metrics call a name not served
                self.add(
                    ("models", model),
                    "'unknown' is what corrallm calls a model name that is not served (in "
                    "activity rows, events and metrics); give this model another name",
                )
            backends = spec.get("backends")
            for index, raw in enumerate(backends if isinstance(backends, list) else []):
                if not isinstance(raw, Mapping):
                    continue
                loc: Loc = ("models", model, "backends", index)
                name = _text(raw.get("name"))
                bid = name if name is not None else f"{model}#{index}"
                id_loc: Loc = (*loc, "name") if name is not None else loc
                if bid in ids:
                    self.add(
                        id_loc,
                        f"backend id '{bid}' is also the id of {format_path(ids[bid])}; "
                        "give one of them a different name",
                    )
                else:
                    ids[bid] = loc
                self.check_process(loc, f"backend '{bid}'", raw)
                self.check_hosted(loc, raw)
                kind = raw.get("type", "chat")
                if costs and isinstance(kind, str) and kind not in costs:
                    given = "" if "type" in raw else " (the default when no type is given)"
                    self.add(
                        (*loc, "type"),
                        f"type '{kind}'{given} is not in commandCosts"
                        f"{did_you_mean(kind, costs)}; known types: {_names(costs)}",
                    )
            self.check_filters(("models", model, "filters"), _map(spec.get("filters")))
            aliases = spec.get("aliases")
            for index, item in enumerate(aliases if isinstance(aliases, list) else []):
                loc = ("models", model, "aliases", index)
                if isinstance(item, Mapping):
                    params = item.get("setParams")
                    if isinstance(params, Mapping):
                        self.check_params((*loc, "setParams"), params, "set")
                    item = item.get("name")
                    loc = (*loc, "name")
                alias = item
                if not isinstance(alias, str) or alias == model:
                    continue
                if alias in self.models:
                    self.add(loc, f"alias '{alias}' is already the name of model '{alias}'")
                elif alias_owner.get(alias, model) != model:
                    self.add(
                        loc, f"alias '{alias}' is also an alias of model '{alias_owner[alias]}'"
                    )
                else:
                    alias_owner[alias] = model

    def check_filters(self, loc: Loc, raw: Mapping[str, Any]) -> None:
        """K5: a filter never touches `model` or `stream`."""
        stripped = raw.get("stripParams")
        for index, name in enumerate(stripped if isinstance(stripped, list) else []):
            if name in UNTOUCHABLE_PARAMS:
                self.add((*loc, "stripParams", index), _untouchable(name, "stripped"))
        for key, verb in (("setParams", "set"), ("defaultParams", "defaulted")):
            params = raw.get(key)
            if isinstance(params, Mapping):
                self.check_params((*loc, key), params, verb)

    def check_params(self, loc: Loc, params: Mapping[str, Any], verb: str) -> None:
        for name in params:
            if name in UNTOUCHABLE_PARAMS:
                self.add((*loc, name), _untouchable(name, verb))

    def check_hosted(self, loc: Loc, raw: Mapping[str, Any]) -> None:
        extension = raw.get("extension")
        if not isinstance(extension, str):
            return
        if extension not in self.extensions:
            hint = did_you_mean(extension, self.extensions)
            known = _names(map(str, self.extensions))
            self.add(
                (*loc, "extension"), f"unknown extension '{extension}'{hint}; extensions: {known}"
            )
        for key in ("cmd", "proxy"):
            if raw.get(key) is not None:
                self.add(
                    (*loc, key),
                    f"a backend hosted by extension '{extension}' must not set {key}: "
                    "the extension's process serves it",
                )

    def check_ports(self) -> None:
        for port, users in sorted(self.ports.items()):
            if len(users) < 2 or not any(started for _, _, started in users):
                continue  # pure proxies may share a server that is already running
            first_loc, first_label, _ = users[0]
            for loc, label, _ in users[1:]:
                self.add(
                    loc,
                    f"port {port} of {label} is also the port of {first_label} "
                    f"({format_path(first_loc)}); two processes cannot listen on one port",
                )

    def check_groups(self) -> None:
        types_known = set(self.command_costs) | {"default"}
        for spec in self.models.values():
            backends = _map(spec).get("backends")
            for raw in backends if isinstance(backends, list) else []:
                kind = _map(raw).get("type", "chat")
                if isinstance(kind, str):
                    types_known.add(kind)
        for group, spec in self.groups.items():
            for kind in _map(_map(spec).get("onSaturated")):
                if kind not in types_known:
                    self.add(
                        ("priorityGroups", group, "onSaturated", kind),
                        f"unknown type '{kind}'{did_you_mean(str(kind), types_known)}; "
                        f"use 'default' or a backend type ({_names(types_known - {'default'})})",
                    )

    def check_keys(self) -> None:
        default = _text(_map(self.data.get("scheduler")).get("defaultGroup")) or "default"
        groups = {str(g) for g in self.groups} | {default, "default"}
        for key, entry in _map(self.data.get("keys")).items():
            loc: Loc = ("keys", key)
            group = entry
            if isinstance(entry, dict):
                loc, group = ("keys", key, "group"), entry.get("group")
                if not _KEY_NAME.fullmatch(str(key)):
                    self.add(
                        ("keys", key),
                        f"key name '{key}' must be 1-64 letters, digits, '.', '-', '_' or "
                        "'@': it names the key in rows, views and events",
                    )
            if isinstance(group, str) and group not in groups:
                self.add(
                    loc,
                    f"unknown group '{group}'{did_you_mean(group, groups)}; "
                    f"priorityGroups: {_names(map(str, self.groups))}",
                )

    def check_peers(self) -> None:
        for model, spec in self.models.items():
            backends = _map(spec).get("backends")
            for i, raw in enumerate(backends if isinstance(backends, list) else []):
                if "peer" in _map(raw):
                    self.add(
                        ("models", model, "backends", i, "peer"),
                        "'peer' is set by corrallm on the backends it imports; list the "
                        "other node under the top-level 'peers' instead",
                    )
                name = _map(raw).get("name")
                if isinstance(name, str) and "@" in name:
                    self.add(
                        ("models", model, "backends", i, "name"),
                        f"'{name}': '@' is kept for the backends of peers (<model>@<peer>); "
                        "name this backend without it",
                    )
        for name, raw in _map(self.data.get("peers")).items():
            loc: Loc = ("peers", name)
            if not _PEER_NAME.fullmatch(str(name)):
                self.add(
                    loc,
                    f"peer name '{name}' must be letters, digits, '-' or '_': it names the "
                    "peer's backends as <model>@<peer>",
                )
            url = _text(_map(raw).get("url"))
            if url is not None:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    self.add(
                        (*loc, "url"),
                        f"'{url}' is not an http(s) URL; write it as http://host:port "
                        "(the peer's corrallm, as its clients reach it)",
                    )
                elif parts.path not in ("", "/") or parts.query:
                    self.add(
                        (*loc, "url"),
                        f"'{url}' has a path; give the peer's base URL only (http://host:port)",
                    )
            token = _text(_map(raw).get("token"))
            if token is not None and not token.strip():
                self.add(
                    (*loc, "token"),
                    "the token is empty (an unset ${VAR}?); it is the peer's admin token, "
                    "the file admin.token in its home folder",
                )


_PEER_NAME = re.compile(r"[A-Za-z0-9_-]+")


def cross_field_problems(data: Mapping[str, Any]) -> list[Problem]:
    """The rules that span fields, run on raw (env-substituted) config data."""
    return _Checker(data).run()
