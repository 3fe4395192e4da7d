"""The cost of one batched pass of B rows x (1 + K) tokens against B single-row passes, on the real model.

    python -m bench.batch_pass_cost [--folder DIR] [--threads 2] [--repeats 5] [--context 128] [--markdown FILE]

For B in 1, 2, 4, 8, 16 and K in 0, 2, 4 (K draft tokens after the pending one), every row at a context of
``--context`` tokens, it prints the median wall time (ms) of:

* ``batched``: ``OrtBatchBackend.run_pass`` over B rows of 1 + K tokens (slots 0..B-1), as opened by default: the
  graph takes each row's query length (``BackendConfig.ragged_rows``), so the B rows are one session run.
* ``alone``: B single-row passes of 1 + K tokens, one after the other, on the same session (a one-row run is
  ``OrtBackend.decode_verify``'s run: the same binding shapes, the same logits; on one session, so that the
  timings do not pay for two copies of the weights competing for the caches).
* drift: the largest absolute difference between a batched row's logits and the same sequence's alone.
* ``split``: the same rows on a batch backend opened with ``ragged_rows=False`` (the file's attention): with K > 0
  ONNX Runtime's GroupQueryAttention refuses a batch of several tokens after a past, so each row runs alone
  (B session runs; see ``backends/onnx/batch.py``).

Then, for prompt passes of 128 and 512 tokens (one row at position 0), the median wall and CPU time with the LM
head over the last position only (``BatchRow.last_logits=1``, what the batch driver asks for a prompt chunk) and
over every position (the graph as the file has it), and the largest difference of the last row's logits.

The report is printed and written to ``--markdown`` (default docs/bench/batch-pass-cost.md).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

from ortspec.backends.base import BatchRow
from ortspec.backends.onnx import BackendConfig, OrtBackend, OrtBatchBackend

BATCHES = (1, 2, 4, 8, 16)
DRAFTS = (0, 2, 4)
DEFAULT_FOLDER = Path.home() / ".cache/ortspec/models/SmolLM2-135M-Instruct-fp32"
DEFAULT_OUT = Path("docs/bench/batch-pass-cost.md")


def timed_rounds(runs: list[Callable[[], None]], repeats: int) -> np.ndarray:
    """Wall times in milliseconds, ``[repeats, len(runs)]``: one warm-up round, then ``repeats`` rounds that each
    run every one of ``runs`` once (interleaved, so that load from elsewhere on the machine falls on all alike).
    Each timed call follows an untimed call of the same run, so that no run pays for the one before it (another
    session's thread pool still spinning after its last run)."""
    times = np.zeros((repeats + 1, len(runs)))
    for round_ in range(repeats + 1):
        for index, run in enumerate(runs):
            run()
            start = time.perf_counter()
            run()
            times[round_, index] = 1000 * (time.perf_counter() - start)
    return times[1:]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


Row = tuple[int, int, float, float, float, float, float]


def measure(folder: Path, threads: int, repeats: int, context: int) -> list[Row]:
    """``(B, K, batched_ms, alone_ms, ratio, split_ms, drift)`` for every B and K (medians; ``ratio``: the
    median over rounds of batched / alone); ``drift``: the largest absolute
    difference between a batched row's logits and the same slot's alone (``OrtBackend``)."""
    config = BackendConfig(threads=threads, max_length=context + 2 * max(DRAFTS) + 8)
    top = max(BATCHES)
    batch = OrtBatchBackend.from_folder(folder, config, slots=top)
    split = OrtBatchBackend.from_folder(folder, attrs.evolve(config, ragged_rows=False), slots=top)
    single = OrtBackend.from_folder(folder, config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 10000, context).tolist() for _ in range(top)]  # a different context per slot
    for slot in range(top):
        batch.run_pass([BatchRow(slot, prompts[slot], 0)])
        split.run_pass([BatchRow(slot, prompts[slot], 0)])
    results = []
    for k in DRAFTS:
        tokens = tuple(rng.integers(100, 10000, 1 + k).tolist())
        alone_rows = []  # each slot's answer alone, for the drift
        for prompt in prompts:
            single.reset()
            single.decode_verify(prompt, 0)
            alone_rows.append(single.decode_verify(tokens, context).copy())
            single.rewind(context)
        for b in BATCHES:
            rows = [BatchRow(slot, tokens, context) for slot in range(b)]
            outputs = batch.run_pass(rows)
            drift = max(float(np.abs(out - alone_rows[row.slot]).max()) for row, out in zip(rows, outputs, strict=True))
            for slot in range(b):
                batch.rewind(slot, context)

            def batched(rows=rows, b=b) -> None:
                batch.run_pass(rows)
                for slot in range(b):
                    batch.rewind(slot, context)

            def alone(rows=rows) -> None:
                for row in rows:
                    batch.run_pass([row])
                    batch.rewind(row.slot, context)

            def file_layout(rows=rows, b=b) -> None:
                split.run_pass(rows)
                for slot in range(b):
                    split.rewind(slot, context)

            times = timed_rounds([batched, alone, file_layout], repeats)
            batched_ms, alone_ms, split_ms = np.median(times, axis=0).tolist()
            ratio = float(np.median(times[:, 0] / times[:, 1]))  # per round: steadier than a ratio of medians
            print(f"B={b:2d} K={k}  batched {batched_ms:.1f}  alone {alone_ms:.1f}  split {split_ms:.1f}", flush=True)
            results.append((b, k, batched_ms, alone_ms, ratio, split_ms, drift))
    return results


PROMPTS = (128, 512)
Prefill = tuple[int, float, float, float, float, float]


def measure_prefill(folder: Path, threads: int, repeats: int) -> list[Prefill]:
    """``(tokens, last_ms, every_ms, last_cpu_ms, every_cpu_ms, drift)`` per prompt length: one prompt pass with
    the LM head over its last position only against over every position (medians, interleaved rounds)."""
    config = BackendConfig(threads=threads, max_length=max(PROMPTS) + 8)
    batch = OrtBatchBackend.from_folder(folder, config, slots=1)
    rng = np.random.default_rng(1)
    results = []
    for tokens in PROMPTS:
        prompt = rng.integers(100, 10000, tokens).tolist()
        outputs = {}

        def run(last: int | None, prompt=prompt, outputs=outputs) -> None:
            batch.reset(0)
            outputs[last] = batch.run_pass([BatchRow(0, prompt, 0, last_logits=last)])[0][-1].copy()

        wall = timed_rounds([lambda: run(1), lambda: run(None)], repeats)
        cpu = np.zeros((repeats, 2))
        for round_ in range(repeats):
            for index, last in enumerate((1, None)):
                start = time.process_time()
                run(last)
                cpu[round_, index] = 1000 * (time.process_time() - start)
        drift = float(np.abs(outputs[1] - outputs[None]).max())
        last_ms, every_ms = np.median(wall, axis=0).tolist()
        last_cpu, every_cpu = np.median(cpu, axis=0).tolist()
        print(f"prompt {tokens}: last {last_ms:.1f} ms, every {every_ms:.1f} ms", flush=True)
        results.append((tokens, last_ms, every_ms, last_cpu, every_cpu, drift))
    return results


def prefill_markdown(results: list[Prefill]) -> str:
    lines = [
        "",
        "## A prompt pass: the LM head over its last position only",
        "",
        "One row at position 0 (`OrtBatchBackend`, the load-time rewrite `ortspec_logits_to_keep`): with",
        "`last_logits=1`, as the batch driver asks for a prompt chunk, against every position's logits (the graph as",
        "written). Median wall and process CPU time in milliseconds; drift: the largest difference of the last row.",
        "",
        "| prompt tokens | last only ms | every ms | last ÷ every | last only CPU ms | every CPU ms | drift |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for tokens, last, every, last_cpu, every_cpu, drift in results:
        lines.append(
            f"| {tokens} | {last:.1f} | {every:.1f} | {last / every:.2f} | {last_cpu:.1f} | {every_cpu:.1f} | "
            f"{drift:.3g} |"
        )
    return "\n".join(lines) + "\n"


def markdown(results, folder: Path, threads: int, repeats: int, context: int) -> str:
    import onnxruntime

    lines = [
        "# The cost of a batched pass (B rows x (1 + K) tokens) against B single-row passes",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `python -m bench.batch_pass_cost` on "
        f"{cpu_name()} ({platform.machine()}, a machine shared with other work), onnxruntime "
        f"{onnxruntime.__version__}, {threads} intra-op threads; model `{folder.name}`; every row at a context of "
        f"{context} tokens; median of {repeats} rounds after one warm-up round (the three runs interleaved in each "
        "round), in milliseconds.",
        "",
        "* **batched**: `OrtBatchBackend.run_pass` over B rows as opened by default: the graph takes each row's "
        "query length (`BackendConfig.ragged_rows`), so the B rows are one session run.",
        "* **alone**: B single-row passes of 1 + K tokens, one after another, on the same session (what "
        "`OrtBackend.decode_verify` runs; one session, so the weights are not read from two copies).",
        "* **drift**: the largest absolute difference between a batched row's logits and the same slot's "
        "(its own context) decoded alone by `OrtBackend` (batch invariance; 0 means bit for bit).",
        "* **split**: the same rows on a batch backend opened with `ragged_rows=False` (the file's attention): "
        "K > 0: GroupQueryAttention refuses several tokens after a past in a batch, so each row runs alone.",
        "",
        "| B | K | batched ms | alone ms | batched / alone (per round) | split ms | batched / split | max abs drift |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for b, k, batched, alone, ratio, split, drift in results:
        lines.append(
            f"| {b} | {k} | {batched:.1f} | {alone:.1f} | {ratio:.2f} | {split:.1f} | {batched / split:.2f} | "
            f"{drift:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_OUT, help=f"the report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    results = measure(args.folder, args.threads, args.repeats, args.context)
    prefill = measure_prefill(args.folder, args.threads, args.repeats)
    text = markdown(results, args.folder, args.threads, args.repeats, args.context) + prefill_markdown(prefill)
    print(text)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
