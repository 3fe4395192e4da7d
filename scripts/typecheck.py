"""Run mypy on ortspec as it is installed (``ortspec``, ``ortspec.core``, ``ortspec.backends``,
``ortspec.adapters``), from this checkout.

The repository keeps ``core/``, ``backends/`` and ``adapters/`` at the top level and installs them as
``ortspec.core`` etc. (``package-dir`` in pyproject.toml). Python resolves that through the editable install's
import hook, which mypy cannot follow, so this script stages the installed layout as a tree of symbolic links in
``build/typecheck``, runs ``mypy -p ortspec`` there with the settings of ``[tool.mypy]`` in pyproject.toml, and
prints the findings with the repository's own paths. Exit status: mypy's.

    python scripts/typecheck.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / "build" / "typecheck"
SUBPACKAGES = ("core", "backends", "adapters")


def stage() -> Path:
    """``build/typecheck/ortspec``: links to ``ortspec/*.py`` and to the subpackage folders."""
    shutil.rmtree(STAGE, ignore_errors=True)
    pkg = STAGE / "ortspec"
    pkg.mkdir(parents=True)
    for f in (ROOT / "ortspec").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    for sub in SUBPACKAGES:
        (pkg / sub).symlink_to(ROOT / sub, target_is_directory=True)
    return pkg


def main() -> int:
    stage()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "ortspec"]
    proc = subprocess.run(cmd, cwd=STAGE, capture_output=True, text=True)
    paths = re.compile(r"^ortspec/(?:(" + "|".join(SUBPACKAGES) + r")/)?", re.MULTILINE)
    out = paths.sub(lambda m: f"{m.group(1)}/" if m.group(1) else "ortspec/", proc.stdout + proc.stderr)
    print(out, end="")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
