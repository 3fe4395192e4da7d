"""Rewrite the bad-input table in docs/reliability.md from a run of the table (tests/reliability_table.py).

    python scripts/reliability_doc.py

It runs ``tests/test_reliability_table.py`` with ``ORTSPEC_WRITE_DOCS=1``: every case must still pass, and the
table section of the document (between its BEGIN/END markers) is replaced by what the run produced. The rest of the
document, including the long-run figures of ``scripts/long_run.py``, is left alone. CI never sets the variable:
there the same test fails if the committed table differs from the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    env = dict(os.environ, ORTSPEC_WRITE_DOCS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_reliability_table.py"]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
