"""ONNX Runtime GenAI's n-gram speculation at its best: a grid of (ngram_size, max_draft_tokens) on the tuning split.

    python -m bench.ngram_grid [--sizes 2,3,4] [--drafts 4,8,16] [--n-per-category 6] [--threads 2]
                               [--out docs/bench/ngram-grid.json] [--quick]

Every setting of the grid, and ORT GenAI greedy for reference, runs greedy on the tuning half of the suite's
prompts (``bench.workloads.build_workloads(split="tuning")``: the prompts the suite reports on are the other half),
the same token ids the suite gives it, the settings back to back on each prompt in an order rotated by prompt.
Per setting and category: the median tokens/s end to end; the chosen setting is the one with the highest geometric
mean over the categories of that median (one setting for every workload, as a user would configure it). The
results file (machine, date, commit, every run) names it under ``best``; ``python -m bench`` reads it and runs the
suite's n-gram peers at that setting (``bench.suite --ngram``). A run disturbed by other processes (more than 0.3
cores on average) is flagged and counted. ``--quick``: a tiny random model, two prompts per category, a 2 x 2 grid.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engines import load_peer
from bench.machine import CpuContention, git_commit, machine_info
from bench.workloads import build_workloads, encode_chat
from ortspec.adapters.engine.tokenizer import Tokenizer

CATEGORIES = ("repetitive", "open_ended", "code_edit")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "bench" / "ngram-grid.json"
PLAIN = "greedy"
DISTURBED_CORES = 0.3


def setting_name(size: int, draft: int) -> str:
    return f"ngram {size}, draft {draft}"


def run_grid(
    model_dir: Path, grid: Sequence[tuple[int, int]], prompts: Sequence[tuple[str, str, list[int]]], cfg: dict
) -> list[dict[str, Any]]:
    """Every setting (and plain greedy) on every prompt ``(category, name, ids)``; one record per run."""
    peers: dict[str, Any] = {}
    for size, draft in grid:
        peer, why = load_peer("ortgenai-ngram", model_dir, cfg["threads"], ngram=(size, draft))
        if peer is None:
            raise SystemExit(f"bench.ngram_grid: ORT GenAI is unavailable: {why}")
        peers[setting_name(size, draft)] = peer
    plain, why = load_peer("ortgenai", model_dir, cfg["threads"])
    if plain is None:
        raise SystemExit(f"bench.ngram_grid: ORT GenAI is unavailable: {why}")
    peers[PLAIN] = plain
    names = list(peers)
    for peer in peers.values():
        peer.run(prompts[0][2], 4)  # warm-up
    runs = []
    for index, (category, name, ids) in enumerate(prompts):
        shift = index % len(names)
        for setting in names[shift:] + names[:shift]:
            with CpuContention() as c:
                out = peers[setting].run(ids, cfg["max_new_tokens"])
            runs.append(
                {
                    "setting": setting,
                    "category": category,
                    "workload": name,
                    "new_tokens": len(out.token_ids),
                    "total_s": out.total_s,
                    "tok_s": len(out.token_ids) / out.total_s if out.total_s > 0 else None,
                    "disturbed": c.others_cores is not None and c.others_cores > DISTURBED_CORES,
                }
            )
        print(f"bench.ngram_grid: {index + 1}/{len(prompts)} {name}", file=sys.stderr)
    for peer in peers.values():
        peer.close()
    return runs


def summarize(runs: Sequence[dict[str, Any]], categories: Sequence[str]) -> dict[str, Any]:
    """Per setting: the median tok/s per category, their geometric mean, its ratio to plain greedy's; ``best``: the
    n-gram setting with the highest geometric mean."""
    table: dict[str, Any] = {}
    for setting in dict.fromkeys(r["setting"] for r in runs):
        medians = {
            cat: statistics.median(r["tok_s"] for r in runs if r["setting"] == setting and r["category"] == cat)
            for cat in categories
        }
        geo = math.exp(statistics.fmean(math.log(v) for v in medians.values()))
        table[setting] = {"median_tok_s": medians, "geomean_tok_s": geo}
    for row in table.values():
        row["vs_greedy"] = row["geomean_tok_s"] / table[PLAIN]["geomean_tok_s"]
    best = max((s for s in table if s != PLAIN), key=lambda s: table[s]["geomean_tok_s"])
    return {"table": table, "best": best}


def report(result: dict[str, Any]) -> str:
    cats = result["config"]["categories"]
    lines = [
        f"# ORT GenAI n-gram grid ({result['config']['split']} split)",
        "",
        f"`{result['command']}` on {result['date_utc']} at commit `{(result['git_commit'] or '')[:10]}`, "
        f"{result['machine'].get('cpu')}, {result['config']['threads']} threads, {result['config']['model']}, "
        f"{result['config']['n_per_category']} prompts per category x {result['config']['max_new_tokens']} new "
        f"tokens, greedy; {result['disturbed_runs']} of {len(result['runs'])} runs disturbed. Median tokens/s end "
        f"to end per category; chosen: **{result['best']['setting']}** (highest geometric mean).",
        "",
        "| setting | " + " | ".join(cats) + " | geometric mean | ÷ greedy |",
        "| --- | " + " | ".join("---:" for _ in cats) + " | ---: | ---: |",
    ]
    for setting, row in result["summary"]["table"].items():
        cells = [f"{row['median_tok_s'][c]:.1f}" for c in cats]
        lines.append(
            f"| {setting} | " + " | ".join(cells) + f" | {row['geomean_tok_s']:.1f} | {row['vs_greedy']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def best_setting(path: Path = DEFAULT_OUT) -> tuple[int, int]:
    """The ``(ngram_size, max_draft_tokens)`` a grid results file chose."""
    best = json.loads(path.read_text(encoding="utf-8"))["best"]
    return int(best["ngram_size"]), int(best["max_draft_tokens"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ngram_grid", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="model folder (default: the SmolLM2 fp32 folder)")
    ap.add_argument("--sizes", default="2,3,4", help="ngram_size values (default 2,3,4)")
    ap.add_argument("--drafts", default="4,8,16", help="max_draft_tokens values (default 4,8,16)")
    ap.add_argument("--n-per-category", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help=f"results file (default {DEFAULT_OUT}; --quick: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, 2 prompts per category, a 2 x 2 grid")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.drafts, args.n_per_category, args.max_new_tokens = "2,3", "4,8", 2, 16
    grid = list(itertools.product((int(v) for v in args.sizes.split(",")), (int(v) for v in args.drafts.split(","))))
    with tempfile.TemporaryDirectory(prefix="ortspec-ngram-grid-") as tmp:
        if args.quick and not args.model_dir:
            from tests.support.models import make_tiny_model

            model_dir = Path(make_tiny_model(Path(tmp) / "tiny-model", context=1024))
        else:
            from ortspec.adapters.tools.convert import default_model_dir

            model_dir = (args.model_dir or default_model_dir("fp32")).expanduser().resolve()
        out = args.out or (Path(tmp) / "ngram-grid.json" if args.quick else DEFAULT_OUT)
        tokenizer = Tokenizer.from_folder(model_dir)
        workloads = build_workloads(
            args.n_per_category,
            400 if args.quick else 1500,
            tokenizer,
            max_new_tokens=args.max_new_tokens,
            categories=CATEGORIES,
            split="tuning",
        )
        prompts = [(w.category, w.name, encode_chat(w.messages, tokenizer)) for w in workloads]
        cfg = {
            "model": model_dir.name,
            "split": "tuning",
            "categories": list(CATEGORIES),
            "n_per_category": args.n_per_category,
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "grid": [list(g) for g in grid],
        }
        runs = run_grid(model_dir, grid, prompts, cfg)
        summary = summarize(runs, CATEGORIES)
        size, draft = next(g for g in grid if setting_name(*g) == summary["best"])
        result = {
            "command": "python -m bench.ngram_grid" + "".join(" " + a for a in (argv or sys.argv[1:])),
            "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "machine": machine_info(),
            "config": cfg,
            "summary": summary,
            "best": {"setting": summary["best"], "ngram_size": size, "max_draft_tokens": draft},
            "disturbed_runs": sum(r["disturbed"] for r in runs),
            "runs": runs,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        out.with_suffix(".md").write_text(report(result), encoding="utf-8")
        print(f"bench.ngram_grid: best {summary['best']}; wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
