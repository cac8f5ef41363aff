"""Docstring examples are documentation that must stay true: every module of every package runs
its doctests here, found by walking the packages (a new module needs no list entry).

``__main__`` modules are left out: importing one runs its service."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import tomllib
from pathlib import Path

import pytest

# The packages the project installs (pyproject's package globs), so a new package needs no entry.
_INCLUDE = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
PACKAGES = sorted(g.rstrip("*") for g in _INCLUDE["tool"]["setuptools"]["packages"]["find"]["include"])


def _modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        path = importlib.import_module(pkg).__path__
        names += [pkg] + [m.name for m in pkgutil.walk_packages(path, f"{pkg}.")]
    return sorted(n for n in names if n.rsplit(".", 1)[-1] != "__main__")


MODULES = _modules()


def test_the_walk_finds_the_modules_with_examples() -> None:
    assert {"ps.table", "services.example_batch", "joiner.batches", "trainer.dedup", "serving.correction",
            "status.scrape", "evaluation.cli", "services.ports"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
