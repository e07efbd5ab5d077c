"""docs/configuration.md documents every knob, and only knobs that exist: its tables are checked against
EngineConfig's fields (group by group), BackendConfig's keys and kvloom/envs.py's variables, both ways."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvloom import envs
from kvloom.config import GROUPS, BackendConfig, EngineConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def sections(level: str) -> dict[str, str]:
    """Heading text -> the text under it, for headings of ``level`` ('##' or '###')."""
    parts = re.split(rf"^{level} (.+)$", DOC.read_text(), flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def table_names(text: str, column: int = 0) -> set[str]:
    """The backticked names in one column of the markdown table rows of ``text``."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = re.split(r"(?<!\\)\|", line)[1:-1]
            names.update(re.findall(r"`([A-Za-z_0-9]+)`", cells[column]))
    return names


def engine_tables() -> dict[str, str]:
    engine_part = sections("##")["Engine knobs"]
    parts = re.split(r"^### (.+)$", engine_part, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_the_doc_has_one_table_per_group_in_order() -> None:
    assert list(engine_tables()) == list(GROUPS.values())


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_group_table_lists_exactly_its_knobs(group: str) -> None:
    documented = table_names(engine_tables()[GROUPS[group]])
    fields_of_group = {f.name for f in EngineConfig.fields_by_group()[group]}
    assert not fields_of_group - documented, f"knobs missing from docs/configuration.md ({group})"
    assert not documented - fields_of_group, f"documented knobs that are not {group} fields of EngineConfig"


def test_every_engine_field_is_documented_once() -> None:
    documented = [name for text in engine_tables().values() for name in sorted(table_names(text))]
    assert sorted(documented) == sorted(EngineConfig.field_names())


def test_the_backend_table_lists_exactly_the_backend_keys() -> None:
    documented = table_names(sections("##")["Backend knobs"])
    keys = {f.name for f in fields(BackendConfig)}
    assert documented == keys, f"missing: {sorted(keys - documented)}; not keys: {sorted(documented - keys)}"


def test_the_environment_table_lists_exactly_the_variables_and_their_seed_names() -> None:
    text = sections("##")["Environment variables"]
    assert table_names(text) == set(envs.ENVIRONMENT_VARIABLES)
    assert table_names(text, column=1) == set(envs.SEED_ALIASES.values())


def test_table_rows_are_read_by_their_first_column() -> None:
    """The checks above can fail: every name in a row's first cell is read, none from the other cells."""
    assert table_names("| `a`, `b` | 1 | x `c` |\n| --- | --- | --- |\n| `d` | 2 | y |") == {"a", "b", "d"}
