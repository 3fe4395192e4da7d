"""Where the time of one decode step and one verify step goes: ONNX Runtime's per-operator profile, the wall time
of the session run, and what the Python side (backend binding, core step, proposer, driver) adds.

    python scripts/profile_step.py [--model DIR] [--threads 2] [--k 8] [--steps 30] [--out docs/profile-fp32.md]

Writes a Markdown report (and prints it).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ortspec import Options, PromptLookup
from ortspec.adapters.tools.convert import default_model_dir
from ortspec.backends.onnx import BackendConfig, OrtBackend, make_session_options
from ortspec.core import DecodeState, check_draft, step


def _ort_profile(folder: Path, threads: int, ids: list[int], k: int, steps: int) -> dict[str, dict[str, float]]:
    """Per-op-type microseconds per step from ONNX Runtime's profiler, for k = 0 (decode) and k (verify)."""
    out = {}
    for label, width in (("decode", 0), (f"verify K={k}", k)):
        so = make_session_options(threads=threads)
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ortspec")
        b = OrtBackend.from_folder(folder, BackendConfig(threads=threads), session_options=so)
        b.decode(ids, 0)
        base = b.current_len()
        feed = ids[-(width + 1) :]
        for _ in range(steps):
            b.decode_verify(feed, base)
            b.rewind(base)
        path = b.session.end_profiling()
        events = json.loads(Path(path).read_text())
        runs = sorted(
            (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
        )
        step_runs = runs[-steps:]  # the prompt pass comes first (possibly in chunks): leave it out
        since = step_runs[0]["ts"]
        per_op: dict[str, float] = collections.defaultdict(float)
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= since:
                per_op[e.get("args", {}).get("op_name", "?")] += e["dur"]
        out[label] = {
            "model_run_us": statistics.median(e["dur"] for e in step_runs),
            "ops_us": {op: us / steps for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])},
        }
    return out


def _python_overhead(folder: Path, threads: int, ids: list[int], k: int, steps: int) -> dict[str, float]:
    """Median microseconds per step of: the backend call (session run + binding), the core step, the proposer."""
    b = OrtBackend.from_folder(folder, BackendConfig(threads=threads))
    lookup = PromptLookup(max_draft=k)
    b.decode(ids[:-1], 0)
    state = DecodeState.start(ids, Options(max_tokens=10_000))
    t_backend, t_core, t_propose = [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        context = state.prompt_tokens + state.generated_tokens
        draft = check_draft(state, lookup.propose(context, k), b.vocab_size) if i % 2 else ()
        t1 = time.perf_counter()
        rows = b.decode_verify((state.pending_token, *draft), state.kv_len)
        t2 = time.perf_counter()
        state, _, rewind_to, _ = step(state, rows[0], rows[1:], draft)
        b.rewind(rewind_to)
        t3 = time.perf_counter()
        t_propose.append(t1 - t0)
        t_backend.append(t2 - t1)
        t_core.append(t3 - t2)
    return {
        "backend_call_us": statistics.median(t_backend) * 1e6,
        "core_step_us": statistics.median(t_core) * 1e6,
        "proposer_us": statistics.median(t_propose) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--out", default=None, help="write the Markdown report here")
    args = p.parse_args(argv)
    folder = Path(args.model) if args.model else default_model_dir("fp32")
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(100, 40000, size=args.prompt_len)]

    prof = _ort_profile(folder, args.threads, ids, args.k, args.steps)
    py = _python_overhead(folder, args.threads, ids, args.k, args.steps)
    lines = [
        f"# Where a step's time goes — {folder.name}",
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {args.threads} intra-op threads, "
        f"context {args.prompt_len} tokens, {args.steps} steps each. Command: `python scripts/profile_step.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| | decode (1 token) | " + f"verify (1 + {args.k} tokens) |",
        "| --- | --- | --- |",
    ]
    d, v = prof["decode"], prof[f"verify K={args.k}"]
    lines.append(
        f"| ONNX Runtime model_run (median) | {d['model_run_us'] / 1000:.2f} ms | {v['model_run_us'] / 1000:.2f} ms |"
    )
    ops = list(dict.fromkeys(list(d["ops_us"])[:8] + list(v["ops_us"])[:8]))
    for op in ops:
        lines.append(f"| op {op} | {d['ops_us'].get(op, 0) / 1000:.2f} ms | {v['ops_us'].get(op, 0) / 1000:.2f} ms |")
    lines += [
        "",
        "Python side, per step (median; verify steps and plain steps alternate):",
        "",
        f"- backend call (binding + session run + returning the logits view): {py['backend_call_us'] / 1000:.2f} ms",
        f"- core `step` (argmax of the rows, accept, commit rules): {py['core_step_us']:.0f} µs",
        f"- prompt-lookup proposer: {py['proposer_us']:.0f} µs",
        f"- core + proposer = {(py['core_step_us'] + py['proposer_us']) / (d['model_run_us']) * 100:.2f} % of a decode "
        "step's model_run",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
