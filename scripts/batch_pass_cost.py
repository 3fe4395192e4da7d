"""The cost of one batched pass of B rows x (1 + K) tokens against B single-row passes, on the real model.

For B in 1, 2, 4, 8, 16 and K in 0, 2, 4 (K draft tokens after the pending one), every row at a context of
``--context`` tokens, it prints the median wall time (ms) of:

* ``batched``: ``OrtBatchBackend.run_pass`` over B rows of 1 + K tokens (slots 0..B-1). With K = 0 this is one
  session run; with K > 0 ONNX Runtime's GroupQueryAttention refuses a batch of several tokens after a past, so the
  backend runs each row alone (B session runs; see ``backends/onnx/batch.py``).
* ``alone``: B ``OrtBackend.decode_verify`` calls of 1 + K tokens, one after the other (today's worker design, one
  session).
* ``at 0``: one session run of B rows x (1 + K) tokens at position 0 (no past): what a batched verify's matmuls
  would cost if the attention op took it, without the attention over the context (a lower bound).

Usage: ``python scripts/batch_pass_cost.py [--folder DIR] [--threads 2] [--repeats 5] [--markdown FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ortspec.backends.base import BatchRow
from ortspec.backends.onnx import BackendConfig, OrtBackend, OrtBatchBackend

BATCHES = (1, 2, 4, 8, 16)
DRAFTS = (0, 2, 4)
DEFAULT_FOLDER = Path.home() / ".cache/ortspec/models/SmolLM2-135M-Instruct-fp32"


def median_ms(runs: list[Callable[[], None]], repeats: int) -> list[float]:
    """The median wall time of each of ``runs`` in milliseconds, after one warm-up round; the runs are interleaved
    (one of each per round) so that load from elsewhere on the machine falls on all of them alike."""
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(repeats + 1):
        for run, taken in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            if round_:
                taken.append(time.perf_counter() - start)
    return [1000 * statistics.median(taken) for taken in times]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure(folder: Path, threads: int, repeats: int, context: int) -> list[tuple[int, int, float, float, float]]:
    """``(B, K, batched_ms, alone_ms, at_zero_ms)`` for every B and K."""
    config = BackendConfig(threads=threads, max_length=context + 2 * max(DRAFTS) + 8)
    top = max(BATCHES)
    batch = OrtBatchBackend.from_folder(folder, config, slots=2 * top)  # slots top.. for the runs at 0
    single = OrtBackend.from_folder(folder, config)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 10000, context).tolist()
    for slot in range(top):
        batch.run_pass([BatchRow(slot, prompt, 0)])
    single.decode_verify(prompt, 0)
    results = []
    for k in DRAFTS:
        tokens = tuple(rng.integers(100, 10000, 1 + k).tolist())
        for b in BATCHES:
            rows = [BatchRow(slot, tokens, context) for slot in range(b)]
            fresh = [BatchRow(top + slot, tokens, 0) for slot in range(b)]

            def batched(rows=rows, b=b) -> None:
                batch.run_pass(rows)
                for slot in range(b):
                    batch.rewind(slot, context)

            def alone(b=b, tokens=tokens) -> None:
                for _ in range(b):
                    single.decode_verify(tokens, context)
                    single.rewind(context)

            def at_zero(fresh=fresh) -> None:
                for row in fresh:
                    batch.reset(row.slot)
                batch.run_pass(fresh)

            batched_ms, alone_ms, zero_ms = median_ms([batched, alone, at_zero], repeats)
            print(f"B={b:2d} K={k}  batched {batched_ms:.1f}  alone {alone_ms:.1f}  at 0 {zero_ms:.1f} ms", flush=True)
            results.append((b, k, batched_ms, alone_ms, zero_ms))
    return results


def markdown(results, folder: Path, threads: int, repeats: int, context: int) -> str:
    import onnxruntime

    lines = [
        "# The cost of a batched pass (B rows x (1 + K) tokens) against B single-row passes",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `scripts/batch_pass_cost.py` on "
        f"{cpu_name()} ({platform.machine()}, a machine shared with other work), onnxruntime "
        f"{onnxruntime.__version__}, {threads} intra-op threads; model `{folder.name}`; every row at a context of "
        f"{context} tokens; median of {repeats} rounds after one warm-up round (the three runs interleaved in each "
        "round), in milliseconds.",
        "",
        "* **batched**: `OrtBatchBackend.run_pass` over B rows. K = 0: one session run of B rows. K > 0: ONNX "
        "Runtime's GroupQueryAttention (CPU) refuses a batch of several tokens after a past, so the backend runs "
        "each row alone (B runs).",
        "* **alone**: B `OrtBackend.decode_verify` calls of 1 + K tokens, one after another.",
        "* **at 0**: one session run of B rows x (1 + K) tokens at position 0 (no past): the matmul cost a batched "
        "verify would have if the attention op took it (a lower bound: no attention over the context).",
        "",
        "| B | K | batched ms | alone ms | batched / alone | at 0 ms | at 0 per token ms |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for b, k, batched, alone, at_zero in results:
        per_token = at_zero / (b * (1 + k))
        lines.append(
            f"| {b} | {k} | {batched:.1f} | {alone:.1f} | {batched / alone:.2f} | {at_zero:.1f} | {per_token:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    results = measure(args.folder, args.threads, args.repeats, args.context)
    text = markdown(results, args.folder, args.threads, args.repeats, args.context)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
