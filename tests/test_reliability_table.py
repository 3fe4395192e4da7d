"""Runs the bad-input table (``tests/reliability_table.py``): every case must raise its error type (and cause),
name what the user gave, and leave the Engine usable; and ``docs/reliability.md`` must hold exactly the table these
runs produce (``python scripts/reliability_doc.py`` runs the same cases and rewrites it; this test only compares)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from reliability_table import BEGIN, CASES, END, Lab, Outcome, render, run_case, section_of

DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
_OUTCOMES: dict[int, Outcome] = {}


@pytest.fixture(scope="module")
def lab(tiny_model_dir, tmp_path_factory) -> Lab:
    return Lab.open(tiny_model_dir, tmp_path_factory.mktemp("reliability"))


def outcome(i: int, lab: Lab) -> Outcome:
    if i not in _OUTCOMES:
        _OUTCOMES[i] = run_case(CASES[i], lab)
    return _OUTCOMES[i]


def _slug(i: int) -> str:
    return f"{i + 1:02d}-" + re.sub(r"[^a-z0-9]+", "-", CASES[i].tried.lower()).strip("-")[:48]


@pytest.mark.parametrize("i", range(len(CASES)), ids=_slug)
def test_bad_input_gives_its_error_and_leaves_things_usable(i, lab):
    result = outcome(i, lab)
    assert not result.problems, "\n".join(result.problems)


def test_docs_reliability_md_holds_the_table_these_runs_produce(lab):
    table = render([(case, outcome(i, lab)) for i, case in enumerate(CASES)])
    document = DOC.read_text(encoding="utf-8")
    assert section_of(document, BEGIN, END) == table, (
        "docs/reliability.md does not hold the table the code produces: run python scripts/reliability_doc.py "
        "and commit the result"
    )
