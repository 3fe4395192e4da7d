"""Write the README's headline numbers from the results files ``python -m bench`` writes.

    python scripts/readme_numbers.py                    # docs/bench/results-evaluation.json, slots-evaluation.json
    python scripts/readme_numbers.py RESULTS --slots SLOTS   # other runs
    python scripts/readme_numbers.py --check            # exit status 1 if README.md differs

The table is one row per workload (the run's categories) and headline setting (``speculative="auto"``, greedy and
sampled): tokens/s end to end, the medians of per-prompt speedups over plain ortspec decoding (greedy, or plain
sampling at the same seed), over ONNX Runtime GenAI greedy and over its n-gram speculation (sampled: its sampled
n-gram speculation), tokens per target pass, and how many outputs were identical to plain decoding's. Every number
is read from the results file as ``bench.report_files`` wrote it (the same ratios and cells as its markdown report,
``bench.report_tables``), and the paragraph above the table gives the run's date, commit, machine and model, linking
the results files. A second table, from ``bench.slots``' results file, gives many requests at once: each
configuration's median tokens/s, its spread and its ratio to ORT GenAI's best static batch. All of it goes between
the two marker lines in README.md; tests/test_readme_numbers.py fails when the README's copy differs from what this
writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # the repository root, for bench

from bench import report_tables  # noqa: E402
from bench.engines import SAMPLED_AUTO  # noqa: E402

DEFAULT_RESULTS = ROOT / "docs" / "bench" / "results-evaluation.json"
DEFAULT_SLOTS = ROOT / "docs" / "bench" / "slots-evaluation.json"
README = ROOT / "README.md"
BEGIN = "<!-- scripts/readme_numbers.py writes this table -->"
END = "<!-- end of the numbers -->"

# (engine, label, ratio over plain ortspec, over ORT GenAI greedy (None: not measured), over ORT GenAI n-gram)
SETTINGS: tuple[tuple[str, str, str, str | None, str], ...] = (
    ("ortspec-auto", "auto, greedy", "spec_vs_ortspec_greedy_e2e", "vs_ortgenai_e2e", "spec_vs_ortgenai_ngram_e2e"),
    (
        SAMPLED_AUTO,
        "auto, sampled",
        "sampled_spec_vs_sampled_plain_e2e",
        None,
        "sampled_spec_vs_ortgenai_ngram_sampled_e2e",
    ),
)


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def caption(result: dict[str, Any], path: Path) -> str:
    """The lines above the table: the run (date, commit, machine, model) and what the numbers are."""
    cfg, machine = result["config"], result["machine"]
    date = datetime.fromisoformat(result["date_utc"]).astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = machine.get("versions") or {}
    ngram = cfg.get("ngram") or {}
    sampling = ", ".join(f"{k} {v}" for k, v in ((result.get("sampling") or {}).get("options") or {}).items())
    files = [f"[{path.suffix[1:]}]({_relative(path)})"]
    if path.with_suffix(".md").exists():
        files.insert(0, f"[report]({_relative(path.with_suffix('.md'))})")
    return (
        f"Measured {date} at commit `{result['git_commit'][:10]}` on {machine.get('cpu')}, "
        f"{(machine.get('cores') or {}).get('usable')} cores, {cfg['threads']} threads per engine (onnxruntime "
        f"{versions.get('onnxruntime')}, ONNX Runtime GenAI {versions.get('onnxruntime-genai')}); "
        f"{Path(cfg['model_dir']).name}, {cfg['n_per_category']} prompts per workload (its {cfg.get('split', 'all')} "
        f"split) x {cfg['max_new_tokens']} new tokens, {cfg['repeat']} interleaved repetitions; ORT GenAI's n-gram at "
        f"ngram_size {ngram.get('ngram_size', 3)}, max_draft_tokens {ngram.get('max_draft_tokens', 8)} (its best on "
        f"the tuning split, [grid](docs/bench/ngram-grid.md)); {result.get('disturbed_runs', 0)} of "
        f"{len(result.get('runs', []))} runs disturbed "
        f"({', '.join(files)}). Medians of per-prompt speedups in tokens/s end to end, prefill included. Sampled rows: "
        f"{sampling}, a seed per prompt; *plain* is then plain sampling at the same seed, and the n-gram peer samples "
        "too."
    )


def table(result: dict[str, Any]) -> list[str]:
    """Workload x headline setting: tok/s, the three speedups, tokens per pass, identical outputs."""
    lines = [
        "| workload | setting | tok/s | ÷ ortspec plain | ÷ ORT GenAI greedy | ÷ ORT GenAI n-gram | tokens / pass "
        "| identical to plain |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    summary = result["summary"]["table"]
    for cat in result["config"]["categories"]:
        for engine, label, over_plain, over_greedy, over_ngram in SETTINGS:
            row = summary.get(cat, {}).get(engine)
            if row is None:
                continue
            cells = [
                cat,
                label,
                report_tables._fmt(row["e2e_tok_s"]),
                report_tables._ratio_cell(report_tables._ratio(result, over_plain, engine, cat)),
                report_tables._ratio_cell(report_tables._ratio(result, over_greedy, engine, cat))
                if over_greedy
                else "—",
                report_tables._ratio_cell(report_tables._ratio(result, over_ngram, engine, cat)),
                report_tables._fmt(row["tokens_per_step"], 2),
                report_tables._identity_cell(row),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def slots_caption(slots: dict[str, Any], path: Path) -> str:
    """The lines above the batched table: the run and its load."""
    machine = slots["machine"]
    same = (
        "every ortspec output the same in every configuration"
        if slots["identity"]["ortspec_identical"]
        else ("**ortspec outputs differed between configurations**")
    )
    return (
        f"Many requests at once, measured {slots['date_utc'][:16].replace('T', ' ')} UTC at commit "
        f"`{slots['commit']}` on {machine.get('cpu')}, {slots['threads']} threads: {slots['requests']} chat requests "
        f"(the {slots['split']} split of the throughput dataset; {slots['prompt_tokens']} prompt tokens, "
        f"{slots['new_tokens']} new tokens, greedy), each configuration run {_runs(slots)} times interleaved; "
        f"{same} ([report]({_relative(path.with_suffix('.md'))}), [json]({_relative(path)})). Median tokens/s, "
        "the spread, and the ratio to ORT GenAI's best static batch size; `ortspec batch` is the whole command, "
        "model load included."
    )


def _runs(slots: dict[str, Any]) -> str:
    counts = sorted({row["runs"] for row in slots["summary"]})
    return "/".join(str(c) for c in counts)


def slots_table(slots: dict[str, Any]) -> list[str]:
    lines = ["| configuration | tok/s | min–max | ÷ ORT GenAI's best batch |", "| --- | ---: | ---: | ---: |"]
    for row in slots["summary"]:
        ratio = f"{row['vs_best_genai']:.2f}x" if row["vs_best_genai"] else "—"
        lines.append(f"| {row['column']} | {row['median']:.1f} | {row['min']:.1f}–{row['max']:.1f} | {ratio} |")
    return lines


def block(path: Path = DEFAULT_RESULTS, slots_path: Path = DEFAULT_SLOTS) -> str:
    """What goes between the README's markers (the markers excluded)."""
    result = json.loads(path.read_text(encoding="utf-8"))
    slots = json.loads(slots_path.read_text(encoding="utf-8"))
    return "\n".join(
        [caption(result, path), "", *table(result), "", slots_caption(slots, slots_path), "", *slots_table(slots)]
    )


def readme_block(text: str) -> str:
    """The README's copy of the block (between the markers)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def with_block(text: str, new: str) -> str:
    """``text`` with the block between the markers replaced by ``new``."""
    readme_block(text)  # the markers are there
    head, rest = text.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + new + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT_RESULTS, help="a bench.suite results file")
    parser.add_argument("--slots", type=Path, default=DEFAULT_SLOTS, help="a bench.slots results file (.json)")
    parser.add_argument("--readme", type=Path, default=README, help="the file holding the markers")
    parser.add_argument("--check", action="store_true", help="write nothing; exit status 1 if the file differs")
    args = parser.parse_args(argv)
    new = block(args.results, args.slots)
    text = args.readme.read_text(encoding="utf-8")
    if args.check:
        if readme_block(text) != new:
            print(f"{_relative(args.readme)}: its numbers are not {_relative(args.results)}'s; run without --check")
            return 1
        return 0
    args.readme.write_text(with_block(text, new), encoding="utf-8")
    print(f"wrote the numbers of {_relative(args.results)} into {_relative(args.readme)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
