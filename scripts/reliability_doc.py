"""Rewrite the bad-input table in docs/reliability.md from a run of the table (tests/reliability_table.py).

    python scripts/reliability_doc.py

It builds the tiny model the tests use, runs every case of the table on it, and, when every case gives its
error and leaves things usable, replaces the table section of the document (between its BEGIN/END markers) by
what the run produced; when a case fails it prints the problems and writes nothing (exit status 1). The rest of
the document, including the long-run figures of ``scripts/long_run.py``, is left alone. The test
(``tests/test_reliability_table.py``) never writes: it fails if the committed table differs from its run.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT))  # tests.support, after the installed package (see tests/conftest.py)

from reliability_table import BEGIN, CASES, END, Lab, render, replace_section, run_case  # noqa: E402

from tests.support.models import make_tiny_model  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ortspec-reliability-") as tmp:
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        lab = Lab.open(make_tiny_model(Path(tmp) / "tiny-fp32"), scratch)
        outcomes = [(case, run_case(case, lab)) for case in CASES]
    failed = [(case, outcome) for case, outcome in outcomes if outcome.problems]
    for case, outcome in failed:
        print(f"{case.tried}: " + "; ".join(outcome.problems), file=sys.stderr)
    if failed:
        print(f"{len(failed)} of {len(CASES)} cases failed: {DOC} left as it is", file=sys.stderr)
        return 1
    document = DOC.read_text(encoding="utf-8")
    DOC.write_text(replace_section(document, BEGIN, END, render(outcomes)), encoding="utf-8")
    print(f"wrote the table of {len(CASES)} cases into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
