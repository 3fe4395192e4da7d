"""Batch throughput on this machine, embedded and on Ray: ``python -m bench.batch_scaling``.

One dataset (``bench.workloads``: ``--n`` prompts per category, chat messages, ``--max-new-tokens`` each, greedy,
prompt lookup with the cost-aware width, the ``ortspec batch`` defaults) goes through ``run_batch`` in each
configuration, ``--repeat`` times in ABBA order (the second pass runs the configurations in reverse, so a drift of
the machine's load hits all alike):

``embedded 1x2``  one worker (in the run's own process), 2 intra-op threads
``embedded 2x1``  two worker processes, 1 thread each (pinned to one core each)
``ray 1x2``       the same job on a local Ray instance (started by the run, as ``ortspec batch --ray`` does)
``ray 2x1``

Each run writes a fresh OUTPUT; the numbers are run_batch's ``BatchSummary`` (wall time from reading INPUT to the
last line, so startup is included: spawning workers or starting Ray, loading the model), the per-record Engine
timings summed (prefill = the prompt pass; decode = the steps after it), and the cores other processes used
while this run waited a second before it. Every configuration must give every record the same tokens; the report
says whether it did.

Writes ``docs/batch-scaling.json`` (everything) and ``docs/batch-scaling.md`` (tables, and the plan for N nodes
with this run's numbers). ``--quick``: a tiny random model, 2 prompts per category, 16 tokens, embedded only
unless ``--configs`` says otherwise; results in a temporary folder unless ``--out``: it checks the script works.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.machine import background_load, machine_info
from bench.workloads import build_workloads, describe_workloads, encode_chat
from ortspec.adapters.batch import BatchJob, run_batch
from ortspec.adapters.batch.output import OutputWriter
from ortspec.adapters.batch.worker import BatchWorker, WorkerSettings, planned_slots
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.core import PromptLookup
from ortspec.core.width import acceptance_rate

CONFIGS = ("embedded 1x2", "embedded 2x1", "ray 1x2", "ray 2x1")
# What `ortspec batch` uses by default: prompt lookup (3-gram, up to 16 tokens), cost-aware width, chat template.
OPTIONS = {"speculative": PromptLookup(ngram=3, max_draft=16), "chat": True}
MAX_BATCH = attrs.fields(BatchJob).max_batch.default  # each worker's slots: the job's default


def parse_config(text: str) -> tuple[str, int, int, bool]:
    """``"embedded 2x1"`` -> ("embedded", 2, 1, pinned); ``"embedded 2x1 nopin"``: workers not pinned."""
    mode, shape, *rest = text.split()
    workers, threads = shape.split("x")
    if mode not in ("embedded", "ray") or rest not in ([], ["nopin"]):
        raise ValueError(f"config {text!r}: expected 'embedded|ray WxT' or 'embedded WxT nopin'")
    return mode, int(workers), int(threads), not rest


def write_dataset(path: Path, model_dir: Path, n: int, max_new_tokens: int, max_prompt_tokens: int) -> dict:
    tokenizer = Tokenizer.from_folder(model_dir)
    workloads = build_workloads(n, max_prompt_tokens, tokenizer, max_new_tokens=max_new_tokens)
    with open(path, "w", encoding="utf-8") as f:
        for w in workloads:
            f.write(json.dumps({"id": w.name, "messages": w.messages, "max_tokens": w.max_new_tokens}) + "\n")
    info = describe_workloads(workloads)
    info["prompt_tokens_total"] = sum(len(encode_chat(w.messages, tokenizer)) for w in workloads)
    return info


def outputs(path: Path) -> dict[str, list[int] | str]:
    """id -> token ids (or the error)."""
    result: dict[str, list[int] | str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        result[str(r["id"])] = r["token_ids"] if "token_ids" in r else "error: " + r["error"]
    return result


def wait_quiet(limit_s: float, threshold: float = 0.5) -> float | None:
    """Wait (up to ``limit_s``) until other processes use less than ``threshold`` cores over a second; the last
    reading."""
    deadline = time.monotonic() + limit_s
    while True:
        load = background_load(1.0)
        if load is None or load < threshold or time.monotonic() >= deadline:
            return load
        time.sleep(2.0)


def one_run(config: str, src: Path, out_dir: Path, model_dir: Path, repeat: int, wait_s: float) -> tuple[dict, dict]:
    mode, workers, threads, pin = parse_config(config)
    out = out_dir / f"{config.replace(' ', '-')}-{repeat}.jsonl"
    out.unlink(missing_ok=True)
    load_before = wait_quiet(wait_s)
    job = BatchJob(
        src,
        out,
        model=model_dir,
        workers=workers,
        threads=threads,
        ray="local" if mode == "ray" else None,
        pin=pin,
        options=OPTIONS,
    )
    summary = run_batch(job, progress=False, log=lambda m: None)
    s = summary
    run = {
        "config": config,
        "repeat": repeat,
        "mode": mode,
        "workers": workers,
        "threads": threads,
        "pinned": pin if mode == "embedded" else None,
        "wall_s": s.wall_s,
        "records": s.written - s.errors,
        "errors": s.errors,
        "tokens": s.tokens,
        "prompt_tokens": s.prompt_tokens,
        "records_per_s": s.records_per_second,
        "tokens_per_s": s.tokens_per_second,
        "first_line_s": s.first_line_s,
        "load_s": s.load_s,
        "ray_init_s": s.ray_init_s,
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "generate_s": s.generate_s,
        "steps": s.steps,
        "proposed": s.proposed,
        "accepted": s.accepted,
        "background_cores_before": load_before,
    }
    errors = [r for r in outputs(out).values() if isinstance(r, str)]
    run["error_samples"] = sorted(set(errors))[:3]
    return run, outputs(out)


def driver_write_cost(out_dir: Path, n: int = 200) -> float:
    """Seconds per output line for the driver's writer (one write + fsync), with a line of typical size."""
    line = {"id": "x" * 40, "text": "word " * 80, "token_ids": list(range(100)), "finish_reason": "eos_token"}
    path = out_dir / "write-cost.jsonl"
    writer = OutputWriter(path)
    t0 = time.perf_counter()
    for _ in range(n):
        writer.write(line)
    elapsed = time.perf_counter() - t0
    writer.close()
    path.unlink()
    return elapsed / n


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values)


def summarize(runs: list[dict], configs: Sequence[str]) -> dict[str, Any]:
    by = {c: [r for r in runs if r["config"] == c] for c in configs}
    table = {}
    for c, rs in by.items():
        workers = rs[0]["workers"]
        generate = mean([r["generate_s"] for r in rs])
        table[c] = {
            "runs": len(rs),
            "wall_s": mean([r["wall_s"] for r in rs]),
            "records_per_s": mean([r["records_per_s"] for r in rs]),
            "tokens_per_s": mean([r["tokens_per_s"] for r in rs]),
            "tokens_per_s_min": min(r["tokens_per_s"] for r in rs),
            "tokens_per_s_max": max(r["tokens_per_s"] for r in rs),
            "first_line_s": mean([r["first_line_s"] or 0.0 for r in rs]),
            "load_s": mean([mean(r["load_s"]) for r in rs if r["load_s"]]) if any(r["load_s"] for r in rs) else None,
            "ray_init_s": mean([r["ray_init_s"] for r in rs]) if rs[0]["ray_init_s"] is not None else None,
            "prefill_share": mean([r["prefill_s"] / r["generate_s"] for r in rs]),
            "busy_tokens_per_s": mean([r["tokens"] * workers / r["generate_s"] for r in rs]),
            "per_worker_tokens_per_s": mean([r["tokens"] / r["generate_s"] for r in rs]),
            "utilization": mean([r["generate_s"] / (workers * r["wall_s"]) for r in rs]),
            "generate_s": generate,
            # 0 when nothing was proposed (a batched run whose speculation faded under load: core.acceptance_rate)
            "acceptance": acceptance_rate(sum(r["accepted"] for r in rs), sum(r["proposed"] for r in rs)),
            "tokens_per_pass": mean([r["tokens"] / r["steps"] for r in rs]),
            "background_cores": mean([r["background_cores_before"] or 0.0 for r in rs]),
        }
    ratios = {}
    baseline = configs[0]  # ratios are to the first configuration, run by run
    if baseline in by:
        base = {r["repeat"]: r for r in by[baseline]}
        for c, rs in by.items():
            pairs = [r["tokens_per_s"] / base[r["repeat"]]["tokens_per_s"] for r in rs if r["repeat"] in base]
            walls = [r["wall_s"] / base[r["repeat"]]["wall_s"] for r in rs if r["repeat"] in base]
            ratios[c] = {"tokens_per_s": pairs, "wall": walls}
    overhead = {}
    for c in configs:
        if c.startswith("ray "):
            twin = "embedded " + c.split()[1]
            if twin in table:
                overhead[c] = {
                    "vs": twin,
                    "extra_wall_s": table[c]["wall_s"] - table[twin]["wall_s"],
                    "ray_init_s": table[c]["ray_init_s"],
                    "extra_first_line_s": table[c]["first_line_s"] - table[twin]["first_line_s"],
                    "extra_after_first_line_s": (table[c]["wall_s"] - table[c]["first_line_s"])
                    - (table[twin]["wall_s"] - table[twin]["first_line_s"]),
                }
    return {"baseline": baseline, "table": table, "ratios": ratios, "ray_overhead": overhead}


def _cores(c: Any) -> str:
    if isinstance(c, dict):
        return ", ".join(f"{v} {k}" for k, v in c.items() if v is not None) + " cores"
    return f"{c} cores"


def _f(x: Any, nd: int = 1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(result: dict[str, Any]) -> str:
    cfg, mi, wl, summary = result["config"], result["machine"], result["workloads"], result["summary"]
    table, ratios = summary["table"], summary["ratios"]
    lines = [
        "# ortspec batch: throughput on one machine, embedded and on Ray",
        "",
        f"Generated by `{result['command']}` on {result['date_utc']} (UTC). Model `{cfg['model_dir']}`; "
        f"{wl['count']} records ({', '.join(f'{k} {v}' for k, v in wl['per_category'].items())}; "
        f"{wl['prompt_tokens_total']} prompt tokens in all, chat-formatted), at most {cfg['max_new_tokens']} new "
        f"tokens each, greedy, prompt lookup with the cost-aware width (the `ortspec batch` defaults). "
        f"{cfg['repeat']} run(s) per configuration, ABBA order.",
        "",
        f"Machine: {mi.get('cpu')}, {_cores(mi.get('cores'))}, {mi.get('memory_gib')} GiB, {mi.get('os')}, "
        f"{mi.get('python')}; ray {result.get('ray_version') or 'not installed'}. **Shared and noisy**: other "
        f"agents run on the same cores (the `others` column: cores they used in the second before each run, after "
        f"waiting up to {cfg['wait_quiet_s']:.0f} s for them to drop below 0.5), so "
        "read the ratios (each run ÷ the baseline's run of the same pass, made back to back in this one "
        "invocation) more than the absolute rates.",
        "",
        f"Every configuration gave every record the same tokens: **{'yes' if result['identical'] else 'NO'}** "
        f"({result['identical_detail']}).",
        "",
        f"| configuration | wall s | records/s | tok/s (min–max) | ÷ {summary['baseline']} | to first line s "
        "| model load s "
        "| Ray start s | busy tok/s | per worker tok/s | utilization | others |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c, t in table.items():
        r = ratios.get(c, {}).get("tokens_per_s") or []
        ratio = f"{mean(r):.2f}x" + (f" ({', '.join(f'{x:.2f}' for x in r)})" if len(r) > 1 else "") if r else "–"
        lines.append(
            f"| {c} | {_f(t['wall_s'])} | {_f(t['records_per_s'], 3)} | {_f(t['tokens_per_s'])} "
            f"({_f(t['tokens_per_s_min'])}–{_f(t['tokens_per_s_max'])}) | {ratio} | {_f(t['first_line_s'])} | "
            f"{_f(t['load_s'])} | {_f(t['ray_init_s'])} | {_f(t['busy_tokens_per_s'])} | "
            f"{_f(t['per_worker_tokens_per_s'])} | {t['utilization']:.0%} | {_f(t['background_cores'], 2)} |"
        )
    uneven = uneven_load(result["runs"], summary["baseline"])
    if uneven:
        lines += [
            "",
            "**Uneven load**: in these pairs the other processes used at least one core more in one run than in "
            f"the other, so the ratio mixes the shape with the load: {'; '.join(uneven)}. This run cannot "
            "separate the two.",
        ]
    lines += [
        "",
        "wall = reading INPUT to the last line written, startup included (workers spawned or Ray started, the "
        "model loaded and warmed); records/s and tok/s = records and generated tokens ÷ wall; to first line = "
        "wall time until the first generated record was written; model load = per worker (Engine load, verify "
        "drift, cost curve from the cache); busy tok/s = tokens ÷ (Engine time summed over records ÷ workers): "
        "the rate once every worker is generating; per worker tok/s = tokens ÷ Engine time summed; utilization "
        "= Engine time ÷ (workers × wall).",
        "",
        "## Where the time goes",
        "",
    ]
    baseline = summary["baseline"]
    base = table.get(baseline)
    if base:
        lines.append(
            f"- Per record, prefill (the prompt pass) is {base['prefill_share']:.0%} of the Engine's time and "
            f"decoding {1 - base['prefill_share']:.0%} ({baseline}; acceptance {base['acceptance']:.0%}, "
            f"{base['tokens_per_pass']:.2f} tokens per target pass)."
        )
    for c, o in summary["ray_overhead"].items():
        lines.append(
            f"- {c} vs {o['vs']}: {o['extra_wall_s']:+.1f} s of wall time, of which {_f(o['ray_init_s'])} s "
            f"starting Ray, {o['extra_first_line_s']:+.1f} s more until the first line (Ray start, actor start, "
            f"model load) and {o['extra_after_first_line_s']:+.1f} s after it (per-record scheduling and "
            "transfer, and noise)."
        )
    lines.append(
        f"- The driver's writer costs {result['driver_write_ms']:.2f} ms per line (one write + fsync), "
        "against seconds of generation per record."
    )
    if {"embedded 1x2", "embedded 2x1"} <= table.keys():
        lines += ["", "## Scaling to N nodes", ""]
        lines += plan(result)
    lines += ["", "## Runs", "", "| configuration | repeat | wall s | tok/s | records | tokens | others |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["runs"]:
        lines.append(
            f"| {r['config']} | {r['repeat']} | {_f(r['wall_s'])} | {_f(r['tokens_per_s'])} | {r['records']} | "
            f"{r['tokens']} | {_f(r['background_cores_before'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def uneven_load(runs: list[dict], baseline: str, threshold: float = 1.0) -> list[str]:
    """The (configuration, pass) pairs whose background load differed from the baseline's run by ``threshold``
    cores or more."""
    base = {r["repeat"]: r for r in runs if r["config"] == baseline}
    found = []
    for r in runs:
        b = base.get(r["repeat"])
        if r["config"] == baseline or b is None:
            continue
        x, y = b["background_cores_before"], r["background_cores_before"]
        if x is not None and y is not None and abs(x - y) >= threshold:
            found.append(f"{r['config']} #{r['repeat']} (others {y:.2f}) vs {baseline} #{r['repeat']} ({x:.2f})")
    return found


def plan(result: dict[str, Any]) -> list[str]:
    """The plan for N nodes, with this run's numbers (only what was measured)."""
    t = result["summary"]["table"]
    one = t["embedded 1x2"]
    ray_cfgs = [c for c in t if c.startswith("ray ")]
    best = max(("embedded 1x2", "embedded 2x1"), key=lambda c: t[c]["busy_tokens_per_s"])
    per_node = t[best]["busy_tokens_per_s"]
    tokens_per_record = result["runs"][0]["tokens"] / max(1, result["runs"][0]["records"])
    per_node_records = per_node / tokens_per_record
    ray_start = mean([t[c]["ray_init_s"] for c in ray_cfgs]) if ray_cfgs else None
    load = one["load_s"] or 0.0
    records = result["runs"][0]["records"]
    extra = [o["extra_after_first_line_s"] for o in result["summary"]["ray_overhead"].values()]
    per_record_ray = mean(extra) / max(1, records - 1) if extra else None
    uneven = uneven_load(result["runs"], "embedded 1x2")
    ray_note = ""
    if per_record_ray is not None:
        ray_note = (
            "; Ray's extra wall time after the first line, against the embedded runner with the same shape, was "
            f"{per_record_ray:+.2f} s per record here (scheduling, transfer and noise together"
            + ("; negative: this machine's noise was larger than Ray's per-record cost)" if per_record_ray < 0 else ")")
        )
    other = "embedded 1x2" if best == "embedded 2x1" else "embedded 2x1"
    lines = [
        f"- **Workers per node.** Once busy, {best.split()[1]} (workers x threads) generated "
        f"{t[best]['busy_tokens_per_s'] / t[other]['busy_tokens_per_s']:.2f}x the tokens per second of "
        f"{other.split()[1]} here ({_f(t[best]['busy_tokens_per_s'])} vs {_f(t[other]['busy_tokens_per_s'])} "
        f"tok/s), so on nodes like this one give each actor {best.split()[1].split('x')[1]} thread(s) and run "
        "as many actors as the cores allow (`--threads` sets the CPUs Ray reserves per actor)"
        + (
            " (a weak conclusion: the load of other processes differed between these runs, see Uneven load)"
            if uneven
            else ""
        )
        + ". On a different "
        "node type, measure the two shapes there first (this script, `--configs`).",
        f"- **Fixed cost per job**: starting Ray, {_f(ray_start)} s here (once, on the driver); then each actor "
        f"loads and warms its Engine, {_f(load)} s here from a local disk ({result['model_mb']:.0f} MB folder; "
        "`--ship-model` adds one transfer of it to each node through the object store). Actors start in "
        "parallel, so this is paid about once per job, not once per node; it is amortized when each actor gets "
        f"many records (one record here: {tokens_per_record:.0f} tokens, about "
        f"{tokens_per_record / max(1e-9, t[best]['per_worker_tokens_per_s']):.1f} s of one worker).",
        f"- **Per-record work** splits {one['prefill_share']:.0%} prefill / {1 - one['prefill_share']:.0%} "
        f"decode for these prompts (up to {result['config']['max_prompt_tokens']} prompt tokens, up to "
        f"{result['config']['max_new_tokens']} new). Both run inside the actors, so both scale with the number of "
        f"actors; speculation shortens the decode part (acceptance {one['acceptance']:.0%} here, "
        f"{one['tokens_per_pass']:.2f} tokens per target pass).",
        f"- **Throughput with N nodes** like this one: about N x {_f(per_node)} tok/s "
        f"(N x {per_node_records:.2f} records/s at {tokens_per_record:.0f} tokens per record) once the actors are "
        "busy, if nothing but the driver is shared (an estimate from one node, not a multi-node measurement). "
        "The driver reads INPUT, hands Ray one record per block and writes each line: the writer alone took "
        f"{result['driver_write_ms']:.2f} ms per line here ({1000 / max(result['driver_write_ms'], 1e-9):.0f} "
        f"lines/s){ray_note}. How many records per second one driver can feed was not "
        "measured; it is the first thing to measure on a cluster.",
        "- **The tail**: records go out longest prompt first, one at a time per actor, so the job ends about "
        "one short record after the queue empties.",
        "- **Not measured here**: more than one node (one machine was available), network transfer of a shipped "
        "model, nodes with more cores. These numbers are what to measure first on such a cluster.",
    ]
    return lines


def quick_model(tmp: Path) -> Path:
    from tests.support.models import make_tiny_model

    return make_tiny_model(tmp / "tiny-fp32", context=1024)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct fp32 in the ortspec cache)")
    ap.add_argument("--n", type=int, default=8, help="prompts per category (default 8: 32 records)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per record at most (default 96)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1000, help="longest prompt (default 1000 tokens)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration, ABBA order (default 2)")
    ap.add_argument("--configs", help=f"comma-separated (default: {', '.join(CONFIGS)})")
    ap.add_argument("--out", help="folder for the report (default docs/)")
    ap.add_argument("--label", default="batch-scaling", help="report file names: LABEL.json, LABEL.md")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="S",
        help="before each run, wait up to S seconds for other processes to use < 0.5 cores (default 60)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 prompts per category, 16 tokens")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else list(CONFIGS)
    if args.quick and not args.configs:
        configs = ["embedded 1x2", "embedded 2x1"]
    for c in configs:
        parse_config(c)
    with tempfile.TemporaryDirectory(prefix="ortspec-batch-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.quick:
            model_dir = Path(args.model) if args.model else quick_model(tmp)
            n, max_new, max_prompt = 2, 16, 120
            out_dir = Path(args.out) if args.out else tmp / "results"
        else:
            from ortspec.adapters.tools.convert import default_model_dir

            model_dir = Path(args.model) if args.model else default_model_dir("fp32")
            n, max_new, max_prompt = args.n, args.max_new_tokens, args.max_prompt_tokens
            out_dir = Path(args.out) if args.out else Path("docs")
        src = tmp / "input.jsonl"
        workloads = write_dataset(src, model_dir, n, max_new, max_prompt)
        for threads in sorted({parse_config(c)[2] for c in configs}):
            # What speculation needs for each thread count is measured once and cached (BatchWorker's warm-up:
            # Engine.warm); doing it here keeps that one-off measurement out of the first timed run.
            slots = planned_slots(MAX_BATCH, len(src.read_text(encoding="utf-8").splitlines()), 1)
            BatchWorker(model_dir, WorkerSettings(threads, OPTIONS, max_batch=slots)).close()
        order = [c for r in range(args.repeat) for c in (configs if r % 2 == 0 else configs[::-1])]
        repeats: dict[str, int] = {}
        runs, outs = [], {}
        for c in order:
            repeats[c] = repeats.get(c, 0) + 1
            run, out = one_run(c, src, tmp, model_dir, repeats[c], args.wait_quiet)
            print(
                f"{c} #{run['repeat']}: {run['wall_s']:.1f} s, {run['tokens_per_s']:.1f} tok/s, "
                f"{run['records_per_s']:.3f} records/s, others {run['background_cores_before']}",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
            outs[f"{c} #{run['repeat']}"] = out
        reference = next(iter(outs.values()))
        differing = {k: sum(v.get(i) != t for i, t in reference.items()) for k, v in outs.items()}
        identical = all(d == 0 for d in differing.values())
        try:
            import ray

            ray_version: str | None = ray.__version__
        except ImportError:
            ray_version = None
        result = {
            "command": "python -m bench.batch_scaling" + (" " + " ".join(argv) if argv else ""),
            "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "ray_version": ray_version,
            "config": {
                "model_dir": str(model_dir).replace(str(Path.home()), "~"),
                "n_per_category": n,
                "max_new_tokens": max_new,
                "max_prompt_tokens": max_prompt,
                "repeat": args.repeat,
                "wait_quiet_s": args.wait_quiet,
                "configs": configs,
                "order": order,
            },
            "workloads": workloads,
            "runs": runs,
            "identical": identical,
            "identical_detail": (
                f"{len(outs)} runs x {len(reference)} records"
                if identical
                else "records differing from the first run: " + json.dumps(differing)
            ),
            "driver_write_ms": driver_write_cost(tmp) * 1000,
            "model_mb": sum(f.stat().st_size for f in model_dir.rglob("*") if f.is_file()) / 1e6,
            "summary": summarize(runs, configs),
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{args.label}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out_dir / f"{args.label}.md").write_text(markdown(result), encoding="utf-8")
        print(f"wrote {out_dir / args.label}.md and .json", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
