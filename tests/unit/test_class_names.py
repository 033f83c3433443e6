"""CONVENTIONS ("Shape of the code"): no class name is defined twice in the package, so a
name found in a traceback, a review or a grep means one thing. A config model is named
`*Config` (config/), an API view `*View` (api/); schemas, GraphQL and the docs keep the
noun alone (config/names.py)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import corrallm

ROOT = Path(corrallm.__file__).resolve().parent


def class_definitions() -> dict[str, list[str]]:
    """Every class name defined in the package (nested classes too) -> file:line."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return found


def test_conventions_no_class_name_is_defined_twice():
    twice = {name: where for name, where in class_definitions().items() if len(where) > 1}
    assert twice == {}, "class names defined more than once:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in sorted(twice.items())
    )


def test_conventions_config_models_and_api_views_are_named_by_their_folder():
    from pydantic import BaseModel

    from corrallm.config import schema as config_schema
    from corrallm.config.names import public_name

    for name in ("Backend", "Model", "Policy", "Scheduler", "Ledger", "Capture"):
        model = getattr(config_schema, f"{name}Config")
        assert issubclass(model, BaseModel) and public_name(model) == name
