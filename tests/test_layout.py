"""The package layout holds: the product's modules sit on declared floors, and a module imports
only from its own floor or below; no two modules import each other, directly or round a circle.

Found by walking the code (every ``import`` of every module, lazy ones inside functions included:
a lazy import is still a dependency), not from a hand list. Imports under ``if TYPE_CHECKING:``
are for type checkers only and are not counted."""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[1]
_INCLUDE = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
FIRST_PARTY = {g.rstrip("*").rstrip(".") for g in _INCLUDE["include"]} | {"bench"}

# Bottom to top; a module's floor is that of the longest prefix naming it. The configuration
# floor (CONFIG: every setting, the project file that sets them and the model config it builds,
# the join's config) sits right above the parameter server whose table configs it reads and
# under every service that reads it; the client over the services; the dataset
# loaders under the trainer; the CLI and the local stack (``driftline`` itself) on top, and the
# benchmarks above everything.
CONFIG = ("services.settings", "trainer.config", "joiner.config", "driftline.project", "driftline.project_template")
FLOORS: tuple[tuple[str, ...], ...] = (
    ("proto",),
    ("ps",),
    CONFIG,
    ("services",),
    ("driftline.client",),
    ("movielens",),
    ("trainer",),
    ("joiner",),
    ("serving",),
    ("producers",),
    ("evaluation", "status"),
    ("driftline",),
    ("bench",),
)


@cache
def modules() -> dict[str, Path]:
    out = {}
    for top in FIRST_PARTY:
        for path in (ROOT / top).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _owner(name: str) -> str | None:
    """The module a dotted import name lands in (``pkg.mod.func`` -> ``pkg.mod``)."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


@cache
def imports(module: str) -> frozenset[str]:
    """The first-party modules ``module`` imports, anywhere in its code."""
    path = modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = _type_only(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            names |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in node.names}
    found = {_owner(n) for n in names if n.split(".")[0] in FIRST_PARTY}
    return frozenset(found - {None, module})


def floor(module: str) -> int:
    best, level = "", None
    for n, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, level = p, n
    assert level is not None, f"{module} is on no floor: add it to FLOORS"
    return level


def upward() -> set[tuple[str, str]]:
    return {(m, i) for m in modules() for i in imports(m) if floor(i) > floor(m)}


def circles() -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for m in sorted(modules()):
        if m not in index:
            visit(m)
    return found


def test_every_module_imports_only_its_floor_and_below() -> None:
    assert not upward(), f"upward imports (importer, imported): {sorted(upward())}"


def test_no_import_circles() -> None:
    assert not circles(), f"import circles: {sorted(circles())}"


def test_the_walk_sees_lazy_imports_and_skips_type_only_ones() -> None:
    assert "services.tansu_quirks" in imports("services.kafka")
    assert "trainer.config" in imports("driftline.project")
    assert "driftline.project" in imports("serving.model")  # inside a method
    assert "status.targets" in imports("status.series")
    assert "movielens.data" in imports("driftline.stack")  # `from movielens.data import ...` inside a function


def test_the_config_floor_imports_only_itself_ps_and_proto() -> None:
    """The configuration floor (issue 33): the settings, the project file, the model config and
    the join config read nothing of any service, so every service can read them."""
    assert set(CONFIG) <= set(modules())
    below = {m for m in modules() if floor(m) <= floor("services.settings")}
    assert {i for m in CONFIG for i in imports(m)} <= below
    assert {floor(m) for m in CONFIG} == {FLOORS.index(CONFIG)} and FLOORS.index(CONFIG) < floor("services.kafka")


def test_services_imports_no_package_above_it() -> None:
    upward = {f"{m} imports {i}" for m in modules() if m.startswith("services") for i in imports(m)
              if i.split(".")[0] not in ("services", "proto")}
    assert not upward


def test_the_cli_lives_in_its_own_package() -> None:
    assert not any((ROOT / "services" / f"{m}.py").exists() for m in ("cli", "stack", "supervisor", "embedded"))
    assert (ROOT / "driftline" / "cli.py").exists()
