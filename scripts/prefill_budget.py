"""The batch driver's prompt-token budget per pass (``BatchDriver``'s ``prefill_budget``), in process: many requests
arriving at once on one batched Engine, each budget in turn, on the same prompts.

    python scripts/prefill_budget.py [--model DIR] [--budgets none,512,256] [--rounds 2] [--clients 16]
                                     [--out docs/serve/prefill-budget/in-process.md]

``--clients`` requests are submitted together to a fresh driver (``adapters.engine.many.batch_driver``: what
``Engine.generate_many`` and ``ortspec batch`` run; the server's scheduler builds the same driver) over an Engine
opened with ``batch_slots=--clients`` and 2 intra-op threads: request ``c`` is prompt ``c`` mod 8 of the
serve_load prompts (``bench.workloads``: 2 chats per category, 37 to ~1,000 tokens) with ``max_tokens`` cycling
over 64, 128, 32, 96, prompt lookup with the cost-aware width (the server's default). Each budget runs once per
round, the order reversed every other round, so a change in the machine's load falls on every budget alike.

Per run: time to first token (p50, p99) and the largest gap between two passes that committed tokens for a request
(p99 over requests; what a streaming client sees as its worst stall), generated tokens per second, passes, and the
process's CPU seconds (every thread's; ``time.process_time``), each from the submission. Times are measured twice:
on the wall clock, and on this process's CPU clock, which a loaded machine stretches far less than the wall (the
wall clock is what a client sees; the CPU clock is what the driver's choice of rows costs). Every output is
compared with the same request's output under the first budget: they must be identical (the invariant).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info  # noqa: E402
from bench.workloads import build_workloads  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.adapters.engine.many import batch_driver, batch_request, submit  # noqa: E402
from ortspec.adapters.engine.options import GenerationOptions  # noqa: E402

MAX_TOKENS = (64, 128, 32, 96)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one_run(engine: Engine, requests: list, budget: int | None) -> dict:
    """Every request submitted at once on a fresh driver with ``budget``; the measurements (module docstring)."""
    engine.prefill_budget = budget
    driver = batch_driver(engine)
    commits: list[list[tuple[float, float]]] = [[] for _ in requests]
    t0, c0 = time.perf_counter(), time.process_time()

    def recorder(i: int):
        def record(text: str, token_id: int, finish_reason: object) -> None:
            commits[i].append((time.perf_counter() - t0, time.process_time() - c0))

        return record

    sequences = [submit(engine, driver, request, recorder(i)) for i, request in enumerate(requests)]
    driver.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    row = {"budget": budget, "passes": driver.passes, "wall_s": wall, "cpu_s": cpu}
    tokens = sum(len(c) for c in commits)
    row["tokens_per_s"] = tokens / wall
    row["tokens_per_cpu_s"] = tokens / cpu
    for clock, k in (("wall", 0), ("cpu", 1)):
        ttft = [c[0][k] for c in commits]
        stall = [max((b[k] - a[k] for a, b in zip(c, c[1:], strict=False)), default=0.0) for c in commits]
        row[f"ttft_p50_{clock}"], row[f"ttft_p99_{clock}"] = percentile(ttft, 0.5), percentile(ttft, 0.99)
        row[f"stall_p99_{clock}"] = percentile(stall, 0.99)
    row["outputs"] = [s.result().token_ids for s in sequences]
    return row


def label(budget: int | None) -> str:
    return "none" if budget is None else str(budget)


def report(rows: list[dict], args: argparse.Namespace, prompt_tokens: int, machine: dict) -> str:
    by_budget: dict[str, list[dict]] = {}
    for row in rows:
        by_budget.setdefault(label(row["budget"]), []).append(row)
    load = os.getloadavg()
    lines = [
        "# The prompt-token budget per pass, in process (`scripts/prefill_budget.py`)",
        "",
        f"Measured {machine['date_utc']} (start) on {machine['cpu']} ({machine['cores']['usable']} usable cores, "
        f"shared with other work: other processes used {machine['background_load_cores']} cores at the start, "
        f"load average {load[0]:.1f} at the end), onnxruntime {machine['versions'].get('onnxruntime')}, 2 intra-op "
        f"threads, `{Path(args.model).name}`; {args.clients} requests submitted at once ({prompt_tokens} prompt "
        f"tokens in all), prompt lookup with the cost-aware width; {args.rounds} round(s), the budgets' order "
        "reversed every other round; medians over the rounds. Wall: seconds since the submission; CPU: this "
        "process's CPU seconds since then (every thread).",
        "",
        "| budget | TTFT p50 wall / CPU s | TTFT p99 wall / CPU s | worst stall p99 wall / CPU s | tokens/s wall | "
        "tokens per CPU s | passes | outputs as the first budget's |",
        "| --- | --: | --: | --: | --: | --: | --: | --: |",
    ]
    first = rows[0]["outputs"]
    for name, runs in by_budget.items():

        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        same = sum(r["outputs"] == first for r in runs)
        lines.append(
            f"| {name} | {med('ttft_p50_wall'):.2f} / {med('ttft_p50_cpu'):.2f} | "
            f"{med('ttft_p99_wall'):.2f} / {med('ttft_p99_cpu'):.2f} | "
            f"{med('stall_p99_wall'):.2f} / {med('stall_p99_cpu'):.2f} | {med('tokens_per_s'):.1f} | "
            f"{med('tokens_per_cpu_s'):.1f} | {med('passes'):.0f} | {same}/{len(runs)} |"
        )
    lines += ["", "Every run:", "", "| round | budget | wall s | CPU s | TTFT p50 wall / CPU s | passes |"]
    lines += ["| --: | --- | --: | --: | --: | --: |"]
    for row in rows:
        lines.append(
            f"| {row['round']} | {label(row['budget'])} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
            f"{row['ttft_p50_wall']:.2f} / {row['ttft_p50_cpu']:.2f} | {row['passes']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: SmolLM2-135M-Instruct fp32)")
    ap.add_argument("--budgets", default="none,512,256", help="budgets to compare, comma-separated (none: unbounded)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    ap.add_argument("--clients", type=int, default=16, help="requests at once, and the Engine's slots (default 16)")
    ap.add_argument("--out", type=Path, default=Path("docs/serve/prefill-budget/in-process.md"), help="the report")
    args = ap.parse_args()
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    machine = machine_info()
    engine = Engine.from_dir(args.model, BackendConfig(threads=2), drafter=False, batch_slots=args.clients)
    workloads = build_workloads(2, 1000, engine.tokenizer)
    options = [
        GenerationOptions(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], chat=True, speculative="prompt-lookup")
        for i in range(len(workloads))
    ]
    engine.verify_drift(), engine.pass_costs(), engine.batch_decode_costs()  # measured (or read) before any run
    requests = [
        batch_request(engine, workloads[c % len(workloads)].messages, options[c % len(workloads)])
        for c in range(args.clients)
    ]
    rows = []
    for r in range(args.rounds):
        for budget in budgets if r % 2 == 0 else budgets[::-1]:
            row = one_run(engine, requests, budget) | {"round": r + 1}
            print(f"round {r + 1}, budget {label(budget)}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)
            ), flush=True)  # fmt: skip
            rows.append(row)
    prompt_tokens = sum(len(r.ids) for r in requests)
    text = report(rows, args, prompt_tokens, machine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0 if all(r["outputs"] == rows[0]["outputs"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
