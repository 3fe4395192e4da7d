"""Show that the property suite catches a broken core: apply one deliberate bug at a time to a staged copy of
the package, run the equivalence property against it, and report whether the suite failed (it must).

    python scripts/mutation_check.py            # every mutant, a quick Hypothesis profile
    python scripts/mutation_check.py --list

Exit status 0 only if every mutant was caught. The working tree is never modified.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (file under core/, text to replace, replacement): each one is a bug other engines have shipped.
MUTANTS = {
    "commit-past-eos": (
        "state.py",
        "        if finish is not None:\n            break\n",
        "        if finish is not None and finish is not FinishReason.EOS_TOKEN:\n            break\n",
    ),
    "rewind-off-by-one": (
        "state.py",
        "return new_state, tuple(commits), new_state.kv_len",
        "return new_state, tuple(commits), new_state.kv_len + 1",
    ),
    "budget-overshoot": (
        "state.py",
        "budget = state.options.max_new_tokens - len(state.generated_tokens) - 1",
        "budget = state.options.max_new_tokens - len(state.generated_tokens)",
    ),
    "max-tokens-overshoot": (
        "state.py",
        "if len(generated) >= opts.max_new_tokens:",
        "if len(generated) > opts.max_new_tokens:",
    ),
    "accept-without-check": ("state.py", "candidates[-1] == draft[len(candidates) - 1]", "candidates[-1] >= 0"),
    "stop-only-at-block-end": (
        "state.py",
        "        elif (s := text.find_stop()) is not None:",
        "        elif i == len(candidates) - 1 and (s := text.find_stop()) is not None:",
    ),
    "context-limit-ignored-mid-block": (
        "state.py",
        "budget = min(budget, limit - state.context_len - 1)",
        "budget = min(budget, limit - state.context_len + 1)",
    ),
    "ties-to-highest-id": ("state.py", "t = int(np.argmax(row))", "t = int(len(row) - 1 - np.argmax(row[::-1]))"),
}


def stage(tmp: Path, mutant: tuple[str, str, str]) -> Path:
    """A copy of the package laid out as installed (ortspec/, ortspec/core, ...), with one mutation applied."""
    pkg = tmp / "site" / "ortspec"
    shutil.copytree(ROOT / "ortspec", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("core", "backends", "adapters"):
        shutil.copytree(ROOT / sub, pkg / sub, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "property_tests", tmp / "property_tests", ignore=shutil.ignore_patterns("__pycache__"))
    filename, old, new = mutant
    path = pkg / "core" / filename
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutation anchor not found exactly once in core/{filename}: {old!r}")
    path.write_text(text.replace(old, new))
    return tmp / "site"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--profile", default="quick", help="Hypothesis profile (default quick)")
    parser.add_argument("mutants", nargs="*", help="names (default: all)")
    args = parser.parse_args()
    if args.list:
        print("\n".join(MUTANTS))
        return 0
    names = args.mutants or list(MUTANTS)
    missed = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="ortspec-mutant-") as tmp_str:
            tmp = Path(tmp_str)
            site = stage(tmp, MUTANTS[name])
            env = dict(os.environ, PYTHONPATH=str(site), HYPOTHESIS_PROFILE=args.profile)
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "property_tests/test_equivalence.py",
            ]
            # Isolate from the editable install: -I would drop PYTHONPATH, so check where ortspec comes from.
            probe = subprocess.run(
                [sys.executable, "-c", "import ortspec.core.state as s; print(s.__file__)"],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
            )
            if not probe.stdout.strip().startswith(str(site)):
                raise SystemExit(f"staged package not imported first: {probe.stdout or probe.stderr}")
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            caught = proc.returncode != 0
            summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
            print(f"{'CAUGHT' if caught else 'MISSED'}  {name:32s} {summary}", flush=True)
            if not caught:
                missed.append(name)
    print(f"{len(names) - len(missed)}/{len(names)} mutants caught by the property suite")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
