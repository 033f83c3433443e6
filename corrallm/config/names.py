"""Public names of models: a config model is named `*Config` and an API view `*View` in
the code, while schemas, GraphQL and the docs keep the noun alone (`Backend`,
`Economics`), its `model_config` title. One rule, applied where a schema is rendered."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

SUFFIXES = ("Config", "View")


def public_name(model: type[BaseModel]) -> str:
    """`model`'s name as clients see it: its title where the title is its class name less
    a suffix (`BackendConfig` -> `Backend`), else its class name."""
    title = model.model_config.get("title")
    if title and any(model.__name__ == title + suffix for suffix in SUFFIXES):
        return title
    return model.__name__


def by_public_names(schema: dict[str, Any], defs: list[str], prefix: str) -> dict[str, Any]:
    """`schema` with each definition under `defs` (a path of keys) named by its title
    where `public_name` would (`BackendConfig` -> `Backend`, a `-Input`/`-Output`
    mode suffix kept), and every `$ref` to it (`prefix` + name) following it."""
    table: dict[str, Any] = schema
    for key in defs:
        table = table.get(key, {})
    renamed = {}
    for key, body in table.items():
        base, dash, mode = key.partition("-")
        title = body.get("title") if isinstance(body, dict) else None
        if title and any(base == title + suffix for suffix in SUFFIXES):
            renamed[key] = title + dash + mode
    if not renamed:
        return schema
    refs = {prefix + old: prefix + new for old, new in renamed.items()}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: refs.get(v, v) if k == "$ref" and isinstance(v, str) else walk(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out: dict[str, Any] = walk(schema)
    table = out
    for key in defs[:-1]:
        table = table[key]
    old_table = table[defs[-1]]
    table[defs[-1]] = dict(sorted((renamed.get(k, k), v) for k, v in old_table.items()))
    return out
