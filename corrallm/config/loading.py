"""Reading `corrallm.yaml`: YAML, `${VAR}` substitution, and every problem at once.

The steps, each collecting problems rather than stopping at the first:
1. parse the YAML (a syntax error stops here: nothing after it can be trusted),
   noting each key's line and refusing duplicate keys;
2. replace `${VAR}` from the environment (`${PORT}` is left for the lifecycle,
   `$${X}` is a literal `${X}`);
3. validate against the schema (`schema.Config`);
4. run the cross-field rules (`validation.py`) on the same data, even when step 3
   failed, so that one run lists everything.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, NoReturn, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from corrallm.config.names import by_public_names
from corrallm.config.schema import Config
from corrallm.config.validation import (
    Loc,
    Problem,
    cross_field_problems,
    did_you_mean,
    format_path,
)

# `$${X}` (escape) | `${X}` (reference); anything inside the braces is checked below.
_REFERENCE = re.compile(r"\$(\$)?\{([^}]*)\}")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_VARIABLES = frozenset({"PORT", "GPU"})  # substituted per spawn by the lifecycle


class ConfigError(Exception):
    """A config that cannot be used; `.problems` lists every reason, each with its path."""

    def __init__(
        self,
        problems: Sequence[str],
        source: str = "<string>",
        lines: Sequence[int | None] | None = None,
    ) -> None:
        self.problems = list(problems)
        self.source = source
        self.lines: list[int | None] = list(lines) if lines else [None] * len(self.problems)
        super().__init__(self.report())

    def report(self) -> str:
        """A header naming the file, then one problem per line (with its line number)."""
        count = len(self.problems)
        head = f"{self.source}: invalid config, {count} problem{'s' if count != 1 else ''}:"
        rows = []
        for problem, line in zip(self.problems, self.lines, strict=False):
            rows.append(f"  - {problem}" + (f"  (line {line})" if line else ""))
        return "\n".join([head, *rows])


def _raise(problems: Sequence[Problem], source: str, lines: Mapping[Loc, int]) -> NoReturn:
    def line_of(loc: Loc) -> int | None:
        for end in range(len(loc), 0, -1):
            if loc[:end] in lines:
                return lines[loc[:end]]
        return None

    unique: dict[tuple[Loc, str], int | None] = {}
    for loc, message in problems:
        unique.setdefault((loc, message), line_of(loc))
    # In file order, so the report reads top to bottom like the YAML.
    ordered = sorted(unique.items(), key=lambda item: item[1] or 0)
    raise ConfigError(
        [f"{format_path(loc)}: {message}" for (loc, message), _ in ordered],
        source,
        [line for _, line in ordered],
    )


# -- YAML -----------------------------------------------------------------------------


def _walk_nodes(
    node: yaml.Node, loc: Loc, lines: dict[Loc, int], problems: list[Problem], stack: set[int]
) -> None:
    """Record each key's line; report duplicate keys (YAML would keep only the last)."""
    if id(node) in stack:
        return
    stack = stack | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(
                    (
                        (*loc, key),
                        f"given twice (lines {seen[key]} and {line}); YAML would keep "
                        "only the last, so remove or rename one",
                    )
                )
                continue
            seen[key] = line
            lines.setdefault((*loc, key), line)
            _walk_nodes(value_node, (*loc, key), lines, problems, stack)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines.setdefault((*loc, index), item.start_mark.line + 1)
            _walk_nodes(item, (*loc, index), lines, problems, stack)


def _parse_yaml(text: str, source: str) -> tuple[object, dict[Loc, int], list[Problem]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[Loc, int] = {}
        problems: list[Problem] = []
        if node is None:
            return None, lines, problems
        _walk_nodes(node, (), lines, problems, set())
        return loader.construct_document(node), lines, problems
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        what = str(getattr(exc, "problem", None) or exc)
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context:
            at = f" at line {context_mark.line + 1}" if context_mark else ""
            what += f" ({context}{at})"
        bad_line = (
            text.splitlines()[mark.line] if mark and mark.line < len(text.splitlines()) else ""
        )
        if "${" in bad_line and "flow" in str(context):
            what += "; inside { } or [ ], quote references: proxy: '${PORT}'"
        raise ConfigError([f"{where}: invalid YAML: {what}"], source) from exc
    finally:
        loader.dispose()


# -- ${VAR} ---------------------------------------------------------------------------


def _substitute_text(text: str, env: Mapping[str, str], loc: Loc, problems: list[Problem]) -> str:
    def replace(match: re.Match[str]) -> str:
        escaped, name = match.group(1), match.group(2)
        if escaped:
            return "${" + name + "}"
        if not _NAME.match(name):
            problems.append(
                (loc, f"'${{{name}}}' is not a variable name; write $${{...}} for a literal ${{")
            )
            return match.group(0)
        if name in RESERVED_VARIABLES:
            return match.group(0)
        value = env.get(name)
        if value is None:
            problems.append((loc, f"environment variable {name} is not set"))
            return match.group(0)
        return value

    return _REFERENCE.sub(replace, text) if "${" in text else text


def substitute_env(
    value: object, env: Mapping[str, str], loc: Loc = (), problems: list[Problem] | None = None
) -> tuple[object, list[Problem]]:
    """`value` with `${VAR}` replaced in every string (keys included), and the problems."""
    found: list[Problem] = [] if problems is None else problems
    if isinstance(value, str):
        return _substitute_text(value, env, loc, found), found
    if isinstance(value, list):
        items = [substitute_env(v, env, (*loc, i), found)[0] for i, v in enumerate(value)]
        return items, found
    if isinstance(value, dict):
        out: dict[object, object] = {}
        for key, item in value.items():
            new_key = (
                _substitute_text(key, env, (*loc, key), found) if isinstance(key, str) else key
            )
            out[new_key] = substitute_env(item, env, (*loc, key), found)[0]
        return out, found
    return value, found


# -- schema errors --------------------------------------------------------------------


def _unwrap(tp: Any) -> Any:
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) != 1:
                return tp
            tp = members[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _step(tp: Any, part: str | int) -> Any:
    tp = _unwrap(tp)
    if _is_model(tp) and isinstance(part, str):
        for name, field in tp.model_fields.items():
            if part in (field.alias, name):
                return field.annotation
        return None
    origin, args = get_origin(tp), get_args(tp)
    if origin in (list, tuple, Sequence) and isinstance(part, int) and args:
        return args[0]
    if origin in (dict, Mapping) and isinstance(part, str) and len(args) == 2:
        return args[1]
    return None


def model_at(loc: Loc) -> type[BaseModel] | None:
    """The schema class that validates the mapping found at `loc`, if any."""
    tp: Any = Config
    for part in loc:
        tp = _step(tp, part)
        if tp is None:
            return None
    tp = _unwrap(tp)
    return tp if _is_model(tp) else None


def allowed_keys(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _kind(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


_TYPE_WORDS = {
    "string_type": "text",
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "dict_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)",
    "model_attributes_type": "a mapping (key: value)",
    "list_type": "a list",
}


def _schema_message(error: Mapping[str, Any]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    loc: Loc = tuple(error["loc"])
    if kind == "extra_forbidden":
        key = str(loc[-1]) if loc else ""
        parent = model_at(loc[:-1])
        if parent is None:
            return "unknown key"
        keys = allowed_keys(parent)
        hint = did_you_mean(key, keys)
        return f"unknown key{hint}" if hint else f"unknown key; allowed here: {', '.join(keys)}"
    if kind == "missing":
        return "missing required key"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {_kind(value)}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(iter(ctx.values()), "?")
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        words = {
            "greater_than_equal": "at least",
            "greater_than": "greater than",
            "less_than_equal": "at most",
            "less_than": "less than",
        }[kind]
        return f"must be {words} {bound}, got {value!r}"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"must list at least {n} item{'s' if n != 1 else ''}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected', '?')}, got {value!r}"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    msg = str(error.get("msg", "invalid value"))
    return msg[:1].lower() + msg[1:]


def schema_problems(exc: ValidationError) -> list[Problem]:
    """Pydantic's errors, located and reworded for a person."""
    return [(_located(e["loc"]), _schema_message(e)) for e in exc.errors(include_url=False)]


def _located(loc: Sequence[str | int]) -> Loc:
    """The YAML path of an error: without the schema's union tags (`<sizes>`, `<auto>`)."""
    return tuple(
        p for p in loc if not (isinstance(p, str) and p.startswith("<") and p.endswith(">"))
    )


# -- public ---------------------------------------------------------------------------


# A last phase of loading, run on a config that is otherwise valid, for rules that need
# more than the file: the memory estimates read model files (SPEC §17 M1). Passed in by the
# caller so that the config package depends on no other.
Check = Callable[[Config], list[Problem]]


def load_config_text(
    text: str,
    source: str = "<string>",
    env: Mapping[str, str] | None = None,
    checks: Sequence[Check] = (),
) -> Config:
    """Parse and validate a config; raise `ConfigError` listing every problem."""
    environ: Mapping[str, str] = os.environ if env is None else env
    raw, lines, problems = _parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        kind = "a list" if isinstance(raw, list) else f"{type(raw).__name__} {raw!r}"
        _raise(
            [((), f"the config must be a mapping of keys (models, servers…), got {kind}")],
            source,
            lines,
        )
    data, env_problems = substitute_env(raw, environ)
    assert isinstance(data, dict)
    problems += env_problems
    # A value whose variable is unset has its one problem; don't add noise about it.
    unset = {loc for loc, _ in env_problems}
    config: Config | None = None
    try:
        config = Config.model_validate(data, by_name=False)
    except ValidationError as exc:
        problems += [p for p in schema_problems(exc) if p[0] not in unset]
    problems += [p for p in cross_field_problems(data) if p[0] not in unset]
    if problems or config is None:
        _raise(problems, source, lines)
    for check in checks:
        problems += check(config)
    if problems:
        _raise(problems, source, lines)
    return config


def load_config(
    path: Path, env: Mapping[str, str] | None = None, checks: Sequence[Check] = ()
) -> Config:
    """Load `path`; raise `ConfigError` listing every problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError([f"(file): cannot read the config: {reason}"], str(path)) from exc
    return load_config_text(text, source=str(path), env=env, checks=checks)


def demo_config_text() -> str:
    return resources.files("corrallm.config").joinpath("demo.yaml").read_text(encoding="utf-8")


def load_demo_config() -> Config:
    """The demo config shipped in the package (served by `corrallm fake-backend`)."""
    return load_config_text(demo_config_text(), source="<packaged demo.yaml>", env={})


def json_schema() -> dict[str, Any]:
    """The JSON Schema of `corrallm.yaml` (camelCase keys), for editors."""
    schema = by_public_names(Config.model_json_schema(by_alias=True), ["$defs"], "#/$defs/")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "corrallm.yaml",
        "description": "corrallm configuration (see docs/config.md)",
    }
