"""One request at a time: the latency of a lone ``Engine.generate``, this checkout against another (e.g. before a
refactor), side by side in one run.

    python -m bench.single_request --against /tmp/before/.venv/bin/python [--model DIR] [--rounds 3]
        [--out docs/bench/single-request.md]

Each round runs this file once under each interpreter, in alternating order (``--against``: a Python whose
``ortspec`` is the other checkout); each run opens the folder (``Engine.from_dir(model, BackendConfig(threads=T))``)
and generates every prompt once per setting (greedy, ``prompt-lookup``, ``auto``), after one warm-up call per
setting (the measurements read from the cache). Prompts: the first ``--prompts`` chat records of
``bench/data/throughput-prompts.json`` (a mix of workloads), ``--new-tokens`` each, EOS ignored. A request's time is
its ``GenerateResult.timings.total_s`` (the call's wall time, prefill included) and its first token
``first_token_s``. The report gives, per setting, the median over prompts of each checkout's time (the least of the
rounds per prompt) and their ratio, and whether the outputs were identical. This file uses only the public API that
both checkouts have.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
PROMPTS = HERE.parent / "data" / "throughput-prompts.json"
SETTINGS = {"greedy": None, "prompt-lookup": "prompt-lookup", "auto": "auto"}
DEFAULT_OUT = Path("docs/bench/single-request.md")


def run_once(model: str, threads: int, prompts: int, new_tokens: int) -> dict[str, Any]:
    """Every prompt once per setting on a fresh Engine of this interpreter's ortspec: per setting, per prompt,
    ``(total_s, first_token_s, token_ids)``."""
    import ortspec
    from ortspec import BackendConfig, Engine

    records = json.loads(PROMPTS.read_text())["records"][:prompts]
    engine = Engine.from_dir(model, BackendConfig(threads=threads))
    out: dict[str, Any] = {"ortspec": ortspec.__file__, "settings": {}}
    for name, speculative in SETTINGS.items():
        engine.generate(records[0]["messages"], max_tokens=4, ignore_eos=True, speculative=speculative)  # warm-up
        rows = []
        for record in records:
            r = engine.generate(record["messages"], max_tokens=new_tokens, ignore_eos=True, speculative=speculative)
            rows.append((r.timings.total_s, r.timings.first_token_s, list(r.token_ids)))
        out["settings"][name] = rows
    close = getattr(engine, "close", None)
    if callable(close):
        close()
    return out


def _child(python: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [python, str(HERE), "--child", "--model", str(args.model), "--threads", str(args.threads)]
    command += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """The markdown report of ``runs`` (``{"this": [...], "other": [...]}``, one result per round)."""
    lines = [
        "# One request at a time: this checkout against another",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC by `python -m bench.single_request` "
        f"({args.rounds} rounds, alternating), {args.threads} intra-op threads, `{Path(args.model).name}`; "
        f"{args.prompts} chat prompts x {args.new_tokens} new tokens (EOS ignored), each setting once per prompt "
        "per round; per prompt the least time of the rounds, then the median over prompts.",
        "",
        f"- this: `{runs['this'][0]['ortspec']}`",
        f"- other: `{runs['other'][0]['ortspec']}`",
        "",
        "| setting | other s | this s | this ÷ other | first token other ms | this ms | identical |",
        "| --- | --: | --: | --: | --: | --: | --: |",
    ]
    for name in SETTINGS:
        best: dict[str, list[tuple[float, float]]] = {}
        identical = 0
        for side in ("this", "other"):
            per_prompt = zip(*(run["settings"][name] for run in runs[side]), strict=True)
            best[side] = [(min(r[0] for r in rows), min(r[1] for r in rows)) for rows in per_prompt]
        for a, b in zip(runs["this"][0]["settings"][name], runs["other"][0]["settings"][name], strict=True):
            identical += a[2] == b[2]
        total = {side: statistics.median(t for t, _ in best[side]) for side in best}
        first = {side: statistics.median(f for _, f in best[side]) for side in best}
        lines.append(
            f"| {name} | {total['other']:.3f} | {total['this']:.3f} | {total['this'] / total['other']:.3f} | "
            f"{first['other'] * 1000:.0f} | {first['this'] * 1000:.0f} | {identical}/{args.prompts} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="the model folder (default: the converted default model)")
    ap.add_argument("--against", help="the other checkout's Python (its ortspec importable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None:
        from ortspec.adapters.tools.convert import default_model_dir

        args.model = default_model_dir("fp32")
    if args.child:
        print(json.dumps(run_once(str(args.model), args.threads, args.prompts, args.new_tokens)))
        return 0
    if not args.against:
        ap.error("--against PYTHON is required (the other checkout's interpreter)")
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "other": []}
    for r in range(args.rounds):
        order = [("this", sys.executable), ("other", args.against)]
        for side, python in order if r % 2 == 0 else order[::-1]:
            print(f"round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            runs[side].append(_child(python, args))
    text = report(runs, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(runs))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
