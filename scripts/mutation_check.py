"""Show that the property suite catches a broken core or driver: apply one deliberate bug at a time to a staged
copy of the package, run ``property_tests/`` against it, and report which test caught it (every one must be).

    python scripts/mutation_check.py            # every mutant
    python scripts/mutation_check.py --list
    python scripts/mutation_check.py tie-guard-off lookup-oldest-match

Each mutant first runs against the quick Hypothesis profile (5% of the examples); one that survives runs again
with the ci profile's example counts (shrinking off: only the verdict matters), so caught mutants cost seconds and
the run stays within minutes. Exit status 0 only if every mutant was caught. The working tree is never modified.
CI runs this after the test suite (``.ci/run``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (file, text to replace, replacement): each one a bug that other engines have shipped, or that an earlier
# version of the suite let through. Files are paths in the repository.
MUTANTS: dict[str, tuple[str, str, str]] = {
    "commit-past-eos": (
        "core/state.py",
        "        if finish is not None:\n            break\n",
        "        if finish is not None and finish is not FinishReason.EOS_TOKEN:\n            break\n",
    ),
    "eos-does-not-end": (
        "core/state.py",
        "        if eos:\n            finish = FinishReason.EOS_TOKEN\n",
        "        if eos and False:\n            finish = FinishReason.EOS_TOKEN\n",
    ),
    "rewind-off-by-one": (
        "core/state.py",
        "return new_state, tuple(commits), new_state.kv_len",
        "return new_state, tuple(commits), new_state.kv_len + 1",
    ),
    "budget-overshoot": (
        "core/state.py",
        "budget = state.options.max_tokens - len(state.generated_tokens) - 1",
        "budget = state.options.max_tokens - len(state.generated_tokens)",
    ),
    "max-tokens-overshoot": (
        "core/state.py",
        "if len(generated) >= opts.max_tokens:",
        "if len(generated) > opts.max_tokens:",
    ),
    "accept-without-check": (
        "core/state.py",
        "candidates[-1] == draft[len(candidates) - 1]",
        "candidates[-1] >= 0",
    ),
    "stop-only-at-block-end": (
        "core/state.py",
        "        elif (stop := text.find_stop()) is not None:",
        "        elif i == len(candidates) - 1 and (stop := text.find_stop()) is not None:",
    ),
    "first-listed-stop-string-wins": (
        "core/state.py",
        "if at >= 0 and (best is None or (at + len(s), at) < best[:2]):",
        "if at >= 0 and best is None:",
    ),
    "context-limit-ignored-mid-block": (
        "core/state.py",
        "budget = min(budget, limit - state.context_len - 1)",
        "budget = min(budget, limit - state.context_len + 1)",
    ),
    "ties-to-highest-id": (
        "core/sampling.py",
        "best = int(np.argmax(z))",
        "best = int(len(z) - 1 - np.argmax(z[::-1]))",
    ),
    "tie-guard-off": (
        "core/state.py",
        "if k and opts.tie_margin > 0:",
        "if False:",
    ),
    "logprobs-not-normalised": (
        "core/sampling.py",
        "return float(x[token] - lse), tuple(",
        "return float(x[token] - m), tuple(",
    ),
    "partial-text-includes-undelivered": (
        "core/state.py",
        "        text=state.text[:streamed],\n",
        "        text=state.text,\n",
    ),
    "sampling-same-position-for-every-row": (
        "core/sampling.py",
        "uniform(_seed(s), self.first_index + i)",
        "uniform(_seed(s), self.first_index)",
    ),
    "penalties-ignore-the-draft-prefix": (
        "core/sampling.py",
        "z = self.processed(row, drafted) if s.processes else np.asarray(row)",
        "z = self.processed(row, ()) if s.processes else np.asarray(row)",
    ),
    "lookup-oldest-match": (
        "core/proposers.py",
        "while (at := data.rfind(needle, 0, end)) >= 0:",
        "while (at := data.find(needle, 0, end)) >= 0:",
    ),
    "lookup-unaligned-match": (
        "core/proposers.py",
        "if at % 4 == 0:",
        "if True:",
    ),
    "lookup-index-keeps-oldest": (
        "core/proposers.py",
        "table[_ngram_key(tokens[first - low : end + 1 - low])] = end + 1",
        "table.setdefault(_ngram_key(tokens[first - low : end + 1 - low]), end + 1)",
    ),
    "lookup-index-includes-last-token": (
        "core/proposers.py",
        "usable = len(head) + n - 1  # n-grams must end before the last token",
        "usable = len(head) + n",
    ),
    "driver-wrong-width-feedback": (
        "ortspec/driver.py",
        "self._policy = self._policy.observe(len(draft), new_state.stats.accepted_tokens - state.stats.accepted_tokens)",  # noqa: E501
        "self._policy = self._policy.observe(len(draft), len(draft))",
    ),
    "driver-skips-rewind": (
        "ortspec/driver.py",
        "        backend.rewind(rewind_to)\n        self._policy",
        "        self._policy",
    ),
    "driver-drops-device-margins": (
        "ortspec/driver.py",
        "state, picks, draft, vocab_size=backend.vocab_size, margins=margins",
        "state, picks, draft, vocab_size=backend.vocab_size, margins=None",
    ),
}

TEST_FILES = ("property_tests/test_prompt_lookup.py", "property_tests/test_equivalence.py")


def stage(tmp: Path, mutant: tuple[str, str, str]) -> Path:
    """A copy of the package laid out as installed (ortspec/, ortspec/core, ...) with one mutation applied, and
    the property tests beside it. Returns the folder to put on PYTHONPATH."""
    site = tmp / "site"
    pkg = site / "ortspec"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "ortspec", pkg, ignore=ignore)
    for sub in ("core", "backends", "adapters"):
        shutil.copytree(ROOT / sub, pkg / sub, ignore=ignore)
    shutil.copytree(ROOT / "property_tests", tmp / "property_tests", ignore=ignore)
    filename, old, new = mutant
    path = site / filename if filename.startswith("ortspec/") else pkg / filename
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutation anchor not found exactly once in {filename}: {old!r}")
    path.write_text(text.replace(old, new))
    return site


def run_suite(tmp: Path, site: Path, profile: str) -> tuple[str | None, str]:
    """Run the property tests against the staged package; return (the first failing test or None, a summary)."""
    env = dict(os.environ, PYTHONPATH=str(site), HYPOTHESIS_PROFILE=profile)
    probe = subprocess.run(
        [sys.executable, "-c", "import ortspec.core.state as s; print(s.__file__)"],
        cwd=tmp, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if not probe.stdout.strip().startswith(str(site)):  # the editable install must not shadow the staged copy
        raise SystemExit(f"staged package not imported first: {probe.stdout or probe.stderr}")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *TEST_FILES]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    failed = re.search(r"^FAILED (\S+)", proc.stdout, re.MULTILINE)
    lines = proc.stdout.strip().splitlines()
    return (failed.group(1) if failed else None), (lines[-1] if lines else proc.stderr[-200:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("mutants", nargs="*", help="names (default: all)")
    args = parser.parse_args()
    if args.list:
        print("\n".join(MUTANTS))
        return 0
    names = args.mutants or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise SystemExit(f"unknown mutants: {unknown}; --list shows them")
    missed = []
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="ortspec-mutant-") as tmp_str:
            tmp = Path(tmp_str)
            site = stage(tmp, MUTANTS[name])
            for profile in ("quick", "mutation"):
                caught_by, summary = run_suite(tmp, site, profile)
                if caught_by:
                    break
        verdict = f"CAUGHT by {caught_by} ({profile} profile)" if caught_by else f"MISSED ({summary})"
        print(f"{'CAUGHT' if caught_by else 'MISSED'}  {name:36s} {time.perf_counter() - t0:6.1f} s  {verdict}",
              flush=True)  # fmt: skip
        if not caught_by:
            missed.append(name)
    print(f"{len(names) - len(missed)}/{len(names)} mutants caught by the property suite "
          f"in {time.perf_counter() - t_all:.0f} s")  # fmt: skip
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
