"""The package layout holds: :mod:`services` is the shared plumbing and imports no driftline package
but itself and the ``proto`` contracts (the CLI and the local stack live in :mod:`driftline`)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
_INCLUDE = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
FIRST_PARTY = {g.rstrip("*") for g in _INCLUDE["include"]}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_services_imports_no_package_above_it() -> None:
    upward = {
        f"{path.relative_to(ROOT)} imports {sorted(bad)}"
        for path in (ROOT / "services").rglob("*.py")
        if (bad := (_imports(path) & FIRST_PARTY) - {"services", "proto"})
    }
    assert not upward


def test_the_cli_lives_in_its_own_package() -> None:
    assert not any((ROOT / "services" / f"{m}.py").exists() for m in ("cli", "stack", "supervisor", "embedded"))
    assert (ROOT / "driftline" / "cli.py").exists()
