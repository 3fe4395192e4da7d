"""Every number the README shows, from one command: ``python -m bench`` (``--quick``: a check in minutes).

    python -m bench [--quick] [--reuse-grid] [--steps grid,suite,slots,readme]

In order, each step a subprocess writing its own results file under docs/bench/ (machine, date, commit, versions,
load; with ``--quick`` a temporary folder, on tiny random models, nothing in the repository touched):

1. ``grid``: ``python -m bench.ngram_grid`` chooses ORT GenAI's n-gram setting on the tuning split
   (``ngram-grid.json``; ``--reuse-grid`` keeps the file there).
2. ``suite``: ``python -m bench.suite`` on the evaluation split, the README's settings (ortspec plain, ``auto``,
   greedy and sampled, and ``auto`` with its lookup drafting token trees) beside ORT GenAI greedy and its n-gram at
   the chosen setting, 3 interleaved repetitions (``results-evaluation.json``).
3. ``slots``: ``python -m bench.slots`` on the evaluation split of the throughput dataset: 16 slots, plain and
   ``auto``, against ORT GenAI's static batches of 1 to 32 requests (every power of two; the split has 32), and the
   ``ortspec batch`` job end to end, 3 interleaved repetitions (``slots-evaluation.json``).
4. ``readme``: ``python scripts/readme_numbers.py`` writes the README's tables from those files
   (tests/test_readme_numbers.py checks that the README holds them).

Optional, run only when ``--steps`` names it (so the default run does not grow):

* ``cost``: ``python -m bench.cost_growth`` measures how a pass's cost grows with the batch size, the context and
  the prompt, against the CPU's compute and memory ceilings (``cost-growth.json`` and ``.md``).

A failing step stops the run with its exit status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench"
STEPS = ("grid", "suite", "slots", "readme")
OPTIONAL_STEPS = ("cost",)  # known to --steps, not in its default
SUITE_ENGINES = (
    "ortspec-greedy,ortspec-auto,ortspec-auto-tree,ortspec-sampled,ortspec-auto-sampled,ortspec-auto-tree-sampled,"
    "ortgenai,ortgenai-ngram,ortgenai-sampled,ortgenai-ngram-sampled"
)
SUITE_CATEGORIES = "repetitive,open_ended,code_edit"
GENAI_SIZES = "1,2,4,8,16,32"  # ORT GenAI's static batch sizes: every power of two up to the split's 32 requests


def commands(out: Path, quick: bool, grid_file: Path) -> dict[str, list[str]]:
    """Each step's command (the suite's lacks its ``--ngram``, read from the grid's file once the grid has run)."""
    py = [sys.executable, "-m"]
    quick_flag = ["--quick"] if quick else []
    suite_size = [] if quick else ["--n-per-category", "10", "--repeat", "3", "--overhead-prompts", "0"]
    slots_size = [] if quick else ["--sizes", "16", "--genai-sizes", GENAI_SIZES, "--repeats", "3"]
    return {
        "grid": [*py, "bench.ngram_grid", *quick_flag, "--out", str(grid_file)],
        "suite": [
            *py,
            "bench.suite",
            *quick_flag,
            "--split",
            "evaluation",
            "--categories",
            SUITE_CATEGORIES,
            "--engines",
            SUITE_ENGINES,
            *suite_size,
            "--label",
            "evaluation",
            "--out",
            str(out),
            "--no-progress",
        ],
        "slots": [
            *py,
            "bench.slots",
            *quick_flag,
            "--split",
            "evaluation",
            *slots_size,
            "--speculative",
            "none,auto",
            "--batch-command",
            "--out",
            str(out / "slots-evaluation.md"),
        ],
        "readme": [
            sys.executable,
            str(ROOT / "scripts" / "readme_numbers.py"),
            str(out / "results-evaluation.json"),
            "--slots",
            str(out / "slots-evaluation.json"),
            *(["--readme", str(out / "README.md")] if quick else []),
        ],
        "cost": [*py, "bench.cost_growth", *quick_flag, "--out", str(out / "cost-growth.json")],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random models, a temporary folder: checks, not speed")
    ap.add_argument("--reuse-grid", action="store_true", help="keep docs/bench/ngram-grid.json (skip the grid)")
    ap.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"which steps, in order (default {','.join(STEPS)}; optional: {','.join(OPTIONAL_STEPS)})",
    )
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS + OPTIONAL_STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; known: {', '.join(STEPS + OPTIONAL_STEPS)}")
    with tempfile.TemporaryDirectory(prefix="ortspec-bench-") as tmp:
        out = Path(tmp) if args.quick else RESULTS
        if args.quick:
            (out / "README.md").write_text((ROOT / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
        grid_file = out / "ngram-grid.json"
        plan = commands(out, args.quick, grid_file)
        for step in steps:
            if step == "grid" and args.reuse_grid and grid_file.exists():
                continue
            command = plan[step] + (["--ngram", _chosen_ngram(grid_file)] if step == "suite" else [])
            print("python -m bench:", " ".join(command[1:]), file=sys.stderr, flush=True)
            done = subprocess.run(command, cwd=ROOT)
            if done.returncode != 0:
                print(f"python -m bench: step {step} failed with exit status {done.returncode}", file=sys.stderr)
                return done.returncode
    return 0


def _chosen_ngram(grid_file: Path) -> str:
    """The grid's chosen ``SIZE,DRAFT``, or the suite's default when no grid ran."""
    from bench.engines import DEFAULT_NGRAM
    from bench.ngram_grid import best_setting

    size, draft = best_setting(grid_file) if grid_file.exists() else DEFAULT_NGRAM
    return f"{size},{draft}"


if __name__ == "__main__":
    sys.exit(main())
