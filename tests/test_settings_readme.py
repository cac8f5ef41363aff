"""The README's settings table names every setting of ``services/settings.py``, and only those;
``DRIFTLINE_VAR_DIR`` moves everything under it, the dataset cache included."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import AliasChoices, BaseModel

from services.settings import Settings

#: sections the table may give as ``DRIFTLINE_<SECTION>__*``: the experiments' knobs, documented
#: field by field in ``EvalSettings`` (they reproduce docs/results.*, nobody tunes a stack with them)
WILDCARD_SECTIONS = {"DRIFTLINE_EVAL__"}


def env_names() -> set[str]:
    """Every setting's environment variable, walking the pydantic models."""
    out = set()
    for name, field in Settings.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out |= {f"DRIFTLINE_{name.upper()}__{sub.upper()}" for sub in kind.model_fields}
        elif isinstance(field.validation_alias, AliasChoices):
            out.add(str(field.validation_alias.choices[0]))  # the conventional name users have set
        else:
            out.add(f"DRIFTLINE_{name.upper()}")
    return out


def table_names(readme: str) -> tuple[set[str], set[str]]:
    """``(names, wildcard section prefixes)`` of the first column of the Configuration table.

    >>> names, wild = table_names("## Configuration\\n| `DRIFTLINE_A__B` / `__C` | 1 | x |\\n| `REDIS_URL` | | |\\n"
    ...                           "| `DRIFTLINE_E__*` | | |\\n## Next\\n| `DRIFTLINE_Z` | | |")
    >>> sorted(names), sorted(wild)   # sets print in hash order: sorted to compare
    (['DRIFTLINE_A__B', 'DRIFTLINE_A__C', 'REDIS_URL'], ['DRIFTLINE_E__'])
    """
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names, wildcards = set(), set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        prefix = ""
        for token in re.findall(r"`([A-Z0-9_*]+)`", line.split(" | ")[0]):
            if token.startswith("__"):
                token = prefix + token[2:]
            elif "__" in token:
                prefix = token.split("__")[0] + "__"
            if token.endswith("*"):
                wildcards.add(token[:-1])
            else:
                names.add(token)
    return names, wildcards


def test_table_names_reads_the_shorthand() -> None:
    readme = ("## Configuration\n| `DRIFTLINE_A__B` / `__C` | `1` | x |\n| `REDIS_URL` | | |\n"
              "| `DRIFTLINE_E__*` | | |\n## Next\n| `DRIFTLINE_Z` | | |")
    assert table_names(readme) == ({"DRIFTLINE_A__B", "DRIFTLINE_A__C", "REDIS_URL"}, {"DRIFTLINE_E__"})


def test_every_setting_is_in_the_readme_table(repo_root: Path) -> None:
    names, wildcards = table_names((repo_root / "README.md").read_text())
    assert wildcards <= WILDCARD_SECTIONS
    settings = env_names()
    covered = {n for n in settings if any(n.startswith(w) for w in wildcards)}
    assert not settings - names - covered, f"settings missing from the README table: {sorted(settings - names - covered)}"
    assert not names - settings, f"the README table names no such settings: {sorted(names - settings)}"
    assert {"DRIFTLINE_TRAINER__DENSE_SYNC_INTERVAL_S", "DRIFTLINE_STATUS__PORT",
            "DRIFTLINE_EMBEDDED__METRICS_PORT_BASE"} <= names


def test_var_dir_moves_the_data_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DRIFTLINE_DATA_DIR", raising=False)
    monkeypatch.setenv("DRIFTLINE_VAR_DIR", str(tmp_path / "v"))
    assert Settings().data_dir == tmp_path / "v" / "data"
    monkeypatch.setenv("DRIFTLINE_DATA_DIR", str(tmp_path / "d"))
    assert Settings().data_dir == tmp_path / "d"  # set on its own, it stays where it is set
    monkeypatch.delenv("DRIFTLINE_VAR_DIR")
    monkeypatch.delenv("DRIFTLINE_DATA_DIR")
    assert Settings().data_dir == Path("var/data")
