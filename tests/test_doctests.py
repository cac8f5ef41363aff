"""Docstring examples are documentation that must stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "services.settings",
    "services.codecs",
    "services.atomic",
    "producers.movielens_features",
    "services.example_batch",
    "joiner.batches",
    "joiner.types",
    "trainer.dedup",
    "trainer.ingest",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
