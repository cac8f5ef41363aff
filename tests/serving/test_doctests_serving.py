"""The serving modules' docstring examples stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["serving.model", "serving.correction", "serving.feature_store",
                                  "serving.feature_log", "serving.spool"])
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
