"""CONVENTIONS ("No import cycles"): the package's import graph has no cycle, at two
granularities: modules, and top-level units (each subpackage of corrallm, and each
top-level module, as one node).

Every import counts, wherever it is written: at module level, inside a function, under
`if TYPE_CHECKING:`, relative or absolute, and `importlib.import_module("corrallm…")`
with a literal name. `from P import n` is an edge to P (the statement runs P's
`__init__` and reads from it) and, when P.n is a module, to P.n too. A failure lists
each cycle (a strongly connected component): its members, one shortest loop through
them, and every edge between them as file:line, so whoever fixes it sees which imports
close it.

Above that, the top-level units are layered: `LAYERS` is the table of every edge one
top-level unit may have to another, and any other edge fails (with its file:line). In
particular the management API (`api`) never imports the `/v1` package (`proxy`): what
both use sits lower (http/ for errors and ASGI helpers, scheduler/ for live leases).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import corrallm

PACKAGE = "corrallm"
ROOT = Path(corrallm.__file__).resolve().parent


@dataclass(frozen=True, order=True)
class Edge:
    source: str
    target: str
    file: str  # relative to the repository root
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.file}:{self.line})"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its `__init__.py`)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_package(name: str, known: dict[str, Path]) -> bool:
    return known[name].name == "__init__.py"


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` means: itself, else its longest known prefix (an attribute)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _named(node: ast.AST, source: str, known: dict[str, Path]) -> list[str]:
    """The dotted names an import statement (or `import_module("…")` call) runs."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the importing module's package upwards
            package = source if _is_package(source, known) else source.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        # The statement runs the module it names (a package's `__init__`) and reads from
        # it; `from corrallm.a import b` also imports the module corrallm.a.b if there is one.
        return [base, *(f"{base}.{alias.name}" for alias in node.names)]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def _targets(node: ast.AST, source: str, known: dict[str, Path]) -> list[str]:
    """The package's modules an import statement depends on, each once."""
    found = (_resolve(name, known) for name in _named(node, source, known) if _ours(name))
    return sorted({target for target in found if target is not None})


def module_edges() -> list[Edge]:
    known = modules()
    edges = set()
    for source, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        where = str(path.relative_to(ROOT.parent))
        for node in ast.walk(tree):
            for target in _targets(node, source, known):
                if target != source:
                    edges.add(Edge(source, target, where, getattr(node, "lineno", 0)))
    return sorted(edges)


def unit_of(module: str) -> str:
    """corrallm.proxy.forward -> corrallm.proxy; corrallm.gateway -> corrallm.gateway."""
    return ".".join(module.split(".")[:2])


def unit_edges() -> list[Edge]:
    return sorted(
        Edge(unit_of(e.source), unit_of(e.target), e.file, e.line)
        for e in module_edges()
        if unit_of(e.source) != unit_of(e.target)
    )


# What each top-level unit may import, lowest layers first. A unit missing from the table
# may import nothing of the package. Adding an edge here is a design decision: say why.
LAYERS: dict[str, set[str]] = {
    # The floor: imports nothing of the package.
    "config": set(),
    # Server pieces every surface shares (connection, head guard, errors, body reading,
    # the upstream client); -> config for the size units of `maxBodySize`.
    "http": {"config"},
    "fake_backend": set(),
    # What a feature says when its optional extra is not installed (X5, E2).
    "extras": set(),
    # -> extras: the PostgreSQL driver is the `postgres` extra.
    "store": {"extras"},
    "tools": {"config"},
    # Owners of one noun each.
    "auth": {"config", "store"},
    "lifecycle": {"config", "store"},
    "cost": {"config", "lifecycle", "store"},
    "peers": {"config", "lifecycle"},
    "routing": {"config", "lifecycle"},
    "residency": {"config", "lifecycle", "store"},
    "scheduler": {"config", "routing"},
    # -> extras: the OpenTelemetry SDK is the `otel` extra; -> (root): the version on
    # the spans' resource.
    "observe": {
        "(root)",
        "auth",
        "config",
        "cost",
        "extras",
        "lifecycle",
        "peers",
        "residency",
        "routing",
        "scheduler",
    },
    # The runtime: the topology the config makes, and the gateway holding the owners.
    "topology": {"config", "lifecycle", "peers", "residency", "routing"},
    # -> extras: a reload that turns traces on without the `otel` extra is logged.
    "gateway": {
        "auth",
        "config",
        "cost",
        "extras",
        "lifecycle",
        "observe",
        "peers",
        "residency",
        "routing",
        "scheduler",
        "store",
        "topology",
    },
    # The surfaces: /v1 (proxy) and management (api) side by side, neither importing
    # the other; the dashboard renders the management views. proxy -> (root): Ollama's
    # `GET /api/version` says corrallm's version (SPEC §23 E1).
    "proxy": {
        "(root)",
        "auth",
        "config",
        "cost",
        "gateway",
        "http",
        "lifecycle",
        "observe",
        "peers",
        "residency",
        "routing",
        "scheduler",
    },
    "api": {
        "(root)",
        "auth",
        "config",
        "gateway",
        "http",
        "lifecycle",
        "observe",
        "residency",
        "routing",
        "scheduler",
        "store",
    },
    # ui -> proxy: the audio catalog.
    # ui -> store: StoreUnavailable, for the page that says the store is down.
    "ui": {"(root)", "api", "config", "gateway", "http", "proxy", "store"},
    # The process: the ASGI app, the server, the command line.
    "app": {"api", "config", "gateway", "http", "observe", "peers", "proxy", "ui"},
    "server": {
        "api",
        "app",
        "config",
        "extras",
        "gateway",
        "http",
        "lifecycle",
        "observe",
        "proxy",
        "store",
    },
    # `serve --workers N`: the owner's hop server and pool, and the relaying worker
    # process (its app is the server's /v1 path over a runtime that asks the owner), so
    # it sits above the process pieces it runs twice over (-> api: the admin token; ->
    # store: a worker writes its own requests' activity rows).
    "workers": {
        "api",
        "app",
        "auth",
        "config",
        "cost",
        "extras",
        "gateway",
        "http",
        "lifecycle",
        "observe",
        "peers",
        "proxy",
        "routing",
        "scheduler",
        "server",
        "store",
        "topology",
    },
    "cli": {
        "(root)",
        "api",
        "auth",
        "config",
        "fake_backend",
        "lifecycle",
        "residency",
        "server",
        "tools",
        "workers",
    },
    "__main__": {"cli", "fake_backend"},
}


def short(unit: str) -> str:
    """corrallm.proxy -> proxy; corrallm (its __init__) -> (root)."""
    return unit.partition(".")[2] or "(root)"


def components(edges: Iterable[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.source].add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # the package is small: recursion depth is no concern
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_loop(members: list[str], edges: list[Edge]) -> list[str]:
    """One shortest loop through the component's first member (breadth first)."""
    inside = set(members)
    graph: dict[str, list[str]] = defaultdict(list)
    for e in edges:
        if e.source in inside and e.target in inside:
            graph[e.source].append(e.target)
    start = members[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(set(graph[node])):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return members


def report(kind: str, edges: list[Edge]) -> str:
    cycles = components(edges)
    lines = [f"{len(cycles)} import cycle(s) between {kind}:"]
    for number, members in enumerate(cycles, 1):
        inside = set(members)
        lines.append(f"\n{number}. {', '.join(members)}")
        lines.append(f"   loop: {' -> '.join(shortest_loop(members, edges))}")
        lines.append("   edges that close it (remove or invert one per loop):")
        lines += [f"     {e}" for e in edges if e.source in inside and e.target in inside]
    return "\n".join(lines)


def test_conventions_no_import_cycle_between_modules():
    edges = module_edges()
    assert components(edges) == [], report("modules", edges)


def test_conventions_no_import_cycle_between_top_level_units():
    edges = unit_edges()
    assert components(edges) == [], report("top-level units", edges)


def test_conventions_top_level_units_import_only_along_the_layer_table():
    outside = [e for e in unit_edges() if short(e.target) not in LAYERS.get(short(e.source), set())]
    assert outside == [], "edges outside the layer table (LAYERS):\n" + "\n".join(
        f"  {e}" for e in outside
    )


def test_conventions_the_layer_table_names_real_units_and_has_no_cycle():
    units = {short(unit_of(m)) for m in modules()}
    named = set(LAYERS) | {t for targets in LAYERS.values() for t in targets}
    assert named <= units, f"the table names units that do not exist: {named - units}"
    table = [Edge(s, t, "LAYERS", 0) for s, targets in LAYERS.items() for t in targets]
    assert components(table) == [], report("rows of the layer table", table)


def test_conventions_the_management_api_never_imports_the_v1_package():
    assert "proxy" not in LAYERS["api"]
    assert [
        e
        for e in module_edges()
        if e.source.startswith("corrallm.api") and e.target.startswith("corrallm.proxy")
    ] == []


def test_conventions_the_import_walk_sees_every_kind_of_import():
    # The walk itself, on a stand-in tree: an import in a function, one under
    # TYPE_CHECKING, a relative one and a `from package import module` all count.
    known = {
        "corrallm": ROOT / "__init__.py",
        "corrallm.a": ROOT / "a" / "__init__.py",
        "corrallm.a.x": ROOT / "a" / "x.py",
        "corrallm.b": ROOT / "b.py",
    }
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from corrallm.b import Thing\n"
        "def f():\n    import corrallm.b.attr\n"
        "from . import x\n"
        "from corrallm.a import x as y\n"
        "import os\n"
    )
    seen = [
        (target, getattr(node, "lineno", 0))
        for node in ast.walk(ast.parse(source))
        for target in _targets(node, "corrallm.a", known)
    ]
    assert sorted(seen) == [
        ("corrallm.a", 6),
        ("corrallm.a", 7),
        ("corrallm.a.x", 6),
        ("corrallm.a.x", 7),
        ("corrallm.b", 3),
        ("corrallm.b", 5),
    ]
