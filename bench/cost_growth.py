"""How a pass's cost grows with the batch size, the context and the prompt, against this CPU's two ceilings.

    python -m bench.cost_growth [--folder DIR] [--threads 2] [--repeats 3] [--passes 8] [--quick]
                                [--out docs/bench/cost-growth.json]

Every pass runs on an ``OrtBatchBackend`` with ``BackendConfig(threads=--threads)``, its KV sized for the section
(``max_length`` ``MARGIN`` positions above its longest context, at most the model's). Each timing is ``--passes``
passes (a decode pass then a rewind of its rows; a prompt pass: one), one warm-up then the median of ``--repeats``
(``bench.batch_pass_cost.timed_rounds``). After each row: peak RSS (``ru_maxrss``) and current RSS (psutil, else
``/proc/self/statm``).

* **Batch size**: B in 1, 2, 4, 8, 16, 32, 64: a decode pass of B one-token rows (slots 0..B-1), every row at a
  context of 128 (each slot filled by a prompt pass just before the first B that uses it, so the RSS after B counts
  B filled slots); tokens/s = B ÷ pass time.
* **Context**: a one-row decode pass at 128, 512, 1024, 2048, 4096, 8192 (one slot, extended in chunks of
  ``FILL_CHUNK``). A decode at context C needs C + 1 positions: a context of the model's length or more is
  measured at that length minus one (``fit_to_model``), and the report says so.
* **Prefill**: a prompt pass at position 0 of 128, 512, 2048 tokens, the LM head over the last position only
  (``last_logits=1``, as the batch driver asks); a prompt longer than the model's length is left out, said so.

The ceilings (``Ceilings.annotate``), with M = the tokens in the pass (B, 1 or the prompt's length):

* **compute**: FLOP rate ÷ FLOPs per token. The rate: a float32 numpy matmul ``[M, K] x [K, N]`` (``K, N``: the
  model's widest matmul below the LM head, e.g. ``[hidden, intermediate]``), best of 5 timings, BLAS held to
  ``--threads`` threads (threadpoolctl if installed, else ``BLAS_THREAD_VARIABLES`` in a child process; recorded);
  the rate at M is the best at M or fewer rows (M rows can run as products of fewer). Its weights stay in cache,
  so at small M it is a cache rate. FLOPs per token (``ModelCost``, from the ONNX initializers' shapes): 2 x K x N
  of every MatMul (MatMulNBits: its K, N), the LM head only for the positions whose logits are computed, plus
  attention's 4 x attended positions x heads x head_size per layer.
* **memory**: ``bench.machine.measure_memory_bandwidth`` split over ``--threads`` threads (a copy, read + write
  counted) x the tokens in the pass ÷ the bytes a pass reads: every MatMul's initializers once plus each row's KV
  of its past context. A read-only stream can beat a copy's rate and a cache can hold some weights, so a fraction
  a little above 1 is possible.

``fraction``: measured tokens/s ÷ min(the two); ``bound``: the lower one.

The JSON (``--out``) holds the machine (``bench.machine.machine_info``), date, commit, versions, the model's facts,
the settings, the ceilings' inputs, the other processes' load before, during and after (above ``DISTURBED_CORES``
cores: ``disturbed``, per row and for the run, as ``bench.suite`` flags) and every row; the markdown twin (same
name, ``.md``, also printed) the tables. ``--quick`` checks that it works, not speed: a tiny random model (unless
``--folder``), smaller sizes, results in a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from bench.batch_pass_cost import timed_rounds
from bench.machine import CpuContention, background_load, git_commit, machine_info, measure_memory_bandwidth
from ortspec.backends.base import BatchRow
from ortspec.backends.onnx import BackendConfig, OrtBatchBackend
from ortspec.backends.onnx.folder import ModelFolder

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("docs/bench/cost-growth.json")
DISTURBED_CORES = 0.3  # bench.suite's default --contention-threshold
FILL_CHUNK = 512  # tokens per pass when a slot is filled to a long context
MARGIN = 8  # KV positions above a section's longest context
MIB = 1 << 20
MATMUL_OPS = ("MatMul", "MatMulNBits")  # the builder writes no Gemm
FOLDER_FACTS = ("context_length", "num_layers", "num_attention_heads", "num_kv_heads", "head_size", "vocab_size")
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


@attrs.frozen
class Plan:
    """What one invocation measures (``FULL`` or ``QUICK``, with the command line's threads, repeats, passes)."""

    batches: tuple[int, ...]
    batch_context: int
    contexts: tuple[int, ...]
    prompts: tuple[int, ...]
    threads: int = 2
    repeats: int = 3
    passes: int = 8
    bandwidth_mib: int = 256
    bandwidth_repeats: int = 7
    matmul_seconds: float = 0.2
    load_seconds: float = 1.0


FULL = Plan((1, 2, 4, 8, 16, 32, 64), 128, (128, 512, 1024, 2048, 4096, 8192), (128, 512, 2048))
# seconds, not minutes: 2 threads, 3 repeats, 2 passes, bandwidth over 32 MiB x 3, matmuls 0.02 s, load over 0.2 s
QUICK = Plan((1, 2, 4, 8), 32, (32, 128, 512), (32, 128), 2, 3, 2, 32, 3, 0.02, 0.2)
QUICK_CONTEXT = 512  # the tiny model's length: its largest context (512) is measured at 511


@attrs.frozen
class ModelCost:
    """The model's arithmetic and bytes, read from its ONNX graph's initializers (weights not loaded).

    ``body_flops``: 2 x K x N summed over every matmul but the LM head (per token); ``head_flops``: the LM head's;
    ``weight_bytes``: the bytes of every matmul's initializer inputs (what a pass streams); ``attention_width``:
    heads x head_size; ``kv_values``: KV values per position of one row (2 x KV layers x kv_heads x head_size);
    ``shape``: (K, N) of the widest matmul below the LM head (the FLOP rate's test shape)."""

    body_flops: int
    head_flops: int
    weight_bytes: int
    attention_width: int
    layers: int
    kv_values: int
    shape: tuple[int, int]

    @classmethod
    def read(cls, folder: ModelFolder) -> ModelCost:
        import onnx

        from ortspec.backends.onnx.graph_rewrites import lm_head

        model = onnx.load(os.fspath(folder.model_path), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        head = lm_head(model, folder.logits_name)
        body, head_flops, weight_bytes, shapes = 0, 0, 0, []
        for node in model.graph.node:
            if node.op_type not in MATMUL_OPS:
                continue
            weights = [inits[name] for name in node.input if name in inits]
            k_n = _k_n(node, weights)
            if k_n is None:
                continue  # a matmul of two activations (none in the builder's decoders)
            weight_bytes += sum(_nbytes(onnx, t) for t in weights)
            if head is not None and node.output[0] == head.output[0]:
                head_flops += 2 * k_n[0] * k_n[1]
            else:
                body += 2 * k_n[0] * k_n[1]
                shapes.append(k_n)
        layers, width = len(folder.kv_layers), folder.num_attention_heads * folder.head_size
        shape = max(shapes, key=lambda s: s[0] * s[1]) if shapes else (width, width)
        kv_values = 2 * layers * folder.num_kv_heads * folder.head_size
        return cls(body, head_flops, weight_bytes, width, layers, kv_values, shape)

    def pass_flops(self, rows: int, tokens: int, context: int, head_rows: int) -> int:
        """FLOPs of a pass of ``rows`` rows of ``tokens`` tokens each, every row after ``context`` positions, the
        LM head over ``head_rows`` positions per row; attention: position p attends to p + 1 positions."""
        attended = tokens * context + tokens * (tokens + 1) // 2
        attention = 4 * self.attention_width * self.layers * attended
        return rows * (tokens * self.body_flops + head_rows * self.head_flops + attention)

    def pass_bytes(self, rows: int, context: int, kv_itemsize: int) -> int:
        """Bytes a pass must read: the weights once, and each row's KV of its ``context`` past positions."""
        return self.weight_bytes + rows * context * self.kv_values * kv_itemsize


def _k_n(node, weights) -> tuple[int, int] | None:
    """(K, N) of a matmul node whose weight is an initializer, else None."""
    if node.op_type == "MatMulNBits":
        attrs_ = {a.name: a.i for a in node.attribute}
        return int(attrs_["K"]), int(attrs_["N"])
    two_d = [t for t in weights if len(t.dims) == 2]
    return (int(two_d[0].dims[0]), int(two_d[0].dims[1])) if two_d else None


def _nbytes(onnx, tensor) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def matmul_gflops(sizes: Sequence[int], k: int, n: int, seconds: float) -> dict[str, float]:
    """GFLOP/s of a float32 ``[M, k] x [k, n]`` numpy matmul for each M in ``sizes`` (keys: str(M)), in this
    process as its BLAS threads are set: best of 5 timings of enough products to last ``seconds`` each."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n), dtype=np.float32)
    rates = {}
    for m in sizes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        np.matmul(a, w, out=out)  # warm-up
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 4 or count < 2:
            np.matmul(a, w, out=out)
            count += 1
        per = (time.perf_counter() - start) / count
        reps = max(1, int(seconds / max(per, 1e-9)))
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                np.matmul(a, w, out=out)
            best = min(best, (time.perf_counter() - start) / reps)
        rates[str(m)] = round(2 * m * k * n / best / 1e9, 3)
    return rates


def measure_flop_rates(sizes: Sequence[int], shape: tuple[int, int], threads: int, seconds: float) -> dict[str, Any]:
    """``matmul_gflops`` with numpy's BLAS at ``threads`` threads: by threadpoolctl in this process when it is
    installed, else in a child process with ``BLAS_THREAD_VARIABLES`` set; ``{"gflops", "shape", "threads",
    "threads_set_by", "blas"}``."""
    sizes = sorted(set(sizes))
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        env = {**os.environ, **dict.fromkeys(BLAS_THREAD_VARIABLES, str(threads))}
        code = (
            "import json, sys; from bench.cost_growth import matmul_gflops; "
            f"print(json.dumps(matmul_gflops({list(sizes)}, {shape[0]}, {shape[1]}, {seconds})))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        )
        rates = json.loads(done.stdout.strip().splitlines()[-1])
        how = "environment variables " + ", ".join(BLAS_THREAD_VARIABLES) + " in a child process"
    else:
        with threadpool_limits(limits=threads, user_api="blas"):
            rates = matmul_gflops(sizes, shape[0], shape[1], seconds)
        how = "threadpoolctl.threadpool_limits(user_api='blas')"
    return {"gflops": rates, "shape": list(shape), "threads": threads, "threads_set_by": how, "blas": _blas_name()}


def _blas_name() -> str | None:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # noqa: BLE001 - numpy's build facts differ between versions
        return None


@attrs.frozen
class Ceilings:
    """The two ceilings of ``cost`` on this machine: ``gflops`` (by str(M), ``measure_flop_rates``) and the copy
    ``bandwidth_gb_s``."""

    cost: ModelCost
    gflops: dict[str, float]
    bandwidth_gb_s: float

    def rate(self, rows: int) -> float:
        """GFLOP/s for a product of ``rows`` rows: the best measured at ``rows`` or fewer (``rows`` rows can always
        run as products of fewer, so a lower figure at ``rows`` is the test's noise, not a ceiling)."""
        return max(v for m, v in self.gflops.items() if int(m) <= rows)

    def annotate(self, row: dict[str, Any], *, rows: int, tokens: int, context: int, head_rows: int, kv_itemsize: int):
        """``row`` (which holds ``tokens_per_s``) with its FLOPs per token, both ceilings' tokens/s, ``bound`` and
        ``fraction`` (tokens/s ÷ the lower ceiling); the pass: ``rows`` rows of ``tokens`` tokens after
        ``context`` positions, the LM head over ``head_rows`` positions of each."""
        in_pass = rows * tokens
        flops = self.cost.pass_flops(rows, tokens, context, head_rows) / in_pass
        compute = self.rate(in_pass) * 1e9 / flops
        memory = in_pass * self.bandwidth_gb_s * 1e9 / self.cost.pass_bytes(rows, context, kv_itemsize)
        lower = min(compute, memory)
        row.update(
            flops_per_token=round(flops),
            compute_ceiling_tok_s=round(compute, 2),
            memory_ceiling_tok_s=round(memory, 2),
            bound="compute" if compute <= memory else "memory",
            fraction=round(row["tokens_per_s"] / lower, 4),
        )
        return row


def rss_mib() -> dict[str, float | None]:
    """The process's peak RSS (``ru_maxrss``) and current RSS (psutil, else ``/proc/self/statm``), in MiB."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mib = peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux
    current: float | None = None
    try:
        import psutil

        current = psutil.Process().memory_info().rss / MIB
    except ImportError:
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            current = pages * os.sysconf("SC_PAGE_SIZE") / MIB
        except (OSError, ValueError, IndexError):
            current = None
    return {"peak_rss_mib": round(peak_mib, 1), "rss_mib": None if current is None else round(current, 1)}


def _timed(run: Callable[[], None], repeats: int, passes: int) -> dict[str, Any]:
    """One warm-up then ``repeats`` timings of ``run`` (``passes`` passes): per pass, the median, min and max ms,
    and the other processes' cores during the timings."""
    with CpuContention() as c:
        ms = timed_rounds([run], repeats)[:, 0] / passes
    return {
        "pass_ms": round(float(np.median(ms)), 4),
        "min_ms": round(float(ms.min()), 4),
        "max_ms": round(float(ms.max()), 4),
        "others_cores": c.others_cores,
        "disturbed": c.others_cores is not None and c.others_cores > DISTURBED_CORES,
    }


def _ids(rng: np.random.Generator, vocab: int, count: int) -> list[int]:
    return rng.integers(3, vocab, count).tolist()


def measure_batches(folder: ModelFolder, plan: Plan, ceilings: Ceilings) -> tuple[list[dict[str, Any]], float]:
    """The batch-size rows (module docstring); and the KV buffers' MiB."""
    context = min(plan.batch_context, folder.context_length - 1)
    config = BackendConfig(threads=plan.threads, max_length=min(folder.context_length, context + MARGIN))
    backend = OrtBatchBackend.from_folder(folder, config, slots=max(plan.batches))
    itemsize = backend.graph.kv_dtype.itemsize
    rng = np.random.default_rng(0)
    filled, results = 0, []
    for b in plan.batches:
        if b > filled:  # the new slots' prompts, one pass at position 0
            backend.run_pass(
                [BatchRow(s, _ids(rng, folder.vocab_size, context), 0, last_logits=1) for s in range(filled, b)]
            )
            filled = b
        decode = [BatchRow(s, (int(t),), context) for s, t in enumerate(_ids(rng, folder.vocab_size, b))]

        def run(decode=decode) -> None:
            for _ in range(plan.passes):
                backend.run_pass(decode)
                for row in decode:
                    backend.rewind(row.slot, context)

        pass_ = {"rows": b, "tokens": 1, "context": context}
        results.append(_row({"batch": b, "context": context}, run, plan.passes, plan, ceilings, pass_, itemsize))
    return results, _kv_mib(backend)


def measure_contexts(
    folder: ModelFolder, plan: Plan, ceilings: Ceilings, contexts: Sequence[int], prompts: Sequence[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """The context rows and the prefill rows (module docstring), on one one-slot backend; and its KV's MiB."""
    longest = max([*contexts, *prompts])
    config = BackendConfig(threads=plan.threads, max_length=min(folder.context_length, longest + MARGIN))
    backend = OrtBatchBackend.from_folder(folder, config, slots=1)
    itemsize = backend.graph.kv_dtype.itemsize
    rng = np.random.default_rng(1)
    held, by_context = 0, []
    for context in contexts:
        while held < context:  # extend the one slot's context in chunks
            chunk = min(FILL_CHUNK, context - held)
            backend.run_pass([BatchRow(0, _ids(rng, folder.vocab_size, chunk), held, last_logits=1)])
            held += chunk
        decode = [BatchRow(0, (int(rng.integers(3, folder.vocab_size)),), context)]

        def run(decode=decode, context=context) -> None:
            for _ in range(plan.passes):
                backend.run_pass(decode)
                backend.rewind(0, context)

        pass_ = {"rows": 1, "tokens": 1, "context": context}
        by_context.append(_row({"context": context}, run, plan.passes, plan, ceilings, pass_, itemsize))
    by_prompt = []
    for tokens in prompts:
        prompt = [BatchRow(0, _ids(rng, folder.vocab_size, tokens), 0, last_logits=1)]

        def prefill(prompt=prompt) -> None:
            backend.reset(0)
            backend.run_pass(prompt)

        pass_ = {"rows": 1, "tokens": tokens, "context": 0}
        by_prompt.append(_row({"prompt": tokens}, prefill, 1, plan, ceilings, pass_, itemsize))
    return by_context, by_prompt, _kv_mib(backend)


def _row(label, run, passes: int, plan: Plan, ceilings: Ceilings, pass_: dict[str, int], itemsize: int):
    """A row: ``label``, ``_timed(run)`` (``passes`` passes per run), tokens/s = rows x tokens of ``pass_`` ÷ the
    median pass time, the RSS after, and the ceilings of ``pass_`` (``Ceilings.annotate``, LM head over one
    position per row)."""
    row = {**label, **_timed(run, plan.repeats, passes)}
    row["tokens_per_s"] = round(1000 * pass_["rows"] * pass_["tokens"] / row["pass_ms"], 2)
    row.update(rss_mib())
    named = ", ".join(f"{k} {v}" for k, v in label.items())
    print(f"bench.cost_growth: {named}: {row['pass_ms']:.2f} ms, {row['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return ceilings.annotate(row, **pass_, head_rows=1, kv_itemsize=itemsize)


def _kv_mib(backend: OrtBatchBackend) -> float:
    return round(sum(a.nbytes for a in (*backend.keys, *backend.values)) / MIB, 1)


def fit_to_model(plan: Plan, context_length: int) -> tuple[list[int], list[int], list[str]]:
    """The contexts and prompts ``plan`` can measure on a model of ``context_length`` positions, and a note per
    change: a context of ``context_length`` or more is measured at ``context_length - 1`` (a decode needs one more
    position), a prompt longer than ``context_length`` is left out."""
    notes, contexts = [], []
    for context in plan.contexts:
        kept = min(context, context_length - 1)
        if kept != context:
            notes.append(f"context {context} measured at {kept}: the model's length is {context_length}")
        if kept not in contexts:
            contexts.append(kept)
    prompts = [p for p in plan.prompts if p <= context_length]
    notes += [f"prompt {p} left out: the model's length is {context_length}" for p in plan.prompts if p not in prompts]
    if plan.batch_context >= context_length:
        notes.append(f"batch rows' context {plan.batch_context} measured at {context_length - 1}")
    return contexts, prompts, notes


def measure(folder_path: Path, plan: Plan) -> dict[str, Any]:
    """Every section (module docstring): the ceilings' inputs first, then the batch rows, then on a second backend
    (the first released) the context and prefill rows; the report's measured part."""
    folder = ModelFolder.load(folder_path)
    cost = ModelCost.read(folder)
    contexts, prompts, notes = fit_to_model(plan, folder.context_length)
    bandwidth = measure_memory_bandwidth(plan.bandwidth_mib, plan.bandwidth_repeats, threads=(plan.threads,))
    sizes = {1, *plan.batches, *prompts}
    flop_rates = measure_flop_rates(sorted(sizes), cost.shape, plan.threads, plan.matmul_seconds)
    ceilings = Ceilings(cost, flop_rates["gflops"], bandwidth["per_threads"][str(plan.threads)])
    with CpuContention() as during:
        batch, batch_kv = measure_batches(folder, plan, ceilings)
        gc.collect()  # the batch backend's KV and session go before the next one opens
        by_context, by_prompt, context_kv = measure_contexts(folder, plan, ceilings, contexts, prompts)
    return {
        "model": {
            "folder": str(folder.path).replace(str(Path.home()), "~"),
            **{name: getattr(folder, name) for name in FOLDER_FACTS},
            **attrs.asdict(cost, recurse=False),
        },
        "notes": notes,
        "memory_bandwidth": bandwidth,
        "flop_rate": flop_rates,
        "kv_mib": {"batch": batch_kv, "context": context_kv},
        "during": during.as_dict(),
        "batch": batch,
        "context": by_context,
        "prefill": by_prompt,
    }


def _load(report: dict[str, Any]) -> str:
    load = report["load"]
    flagged = "**disturbed**" if load["disturbed"] else "quiet"
    return (
        f"Other processes' load, in cores: {load['before_cores']} before, {load['during']['others_cores']} during, "
        f"{load['after_cores']} after ({flagged}: above {load['threshold_cores']} cores is disturbed; "
        f"{load['disturbed_rows']} rows flagged)."
    )


def _table(rows: Sequence[dict[str, Any]], key: str, label: str) -> list[str]:
    head = f"| {label} | pass ms | min–max ms | tok/s | MFLOP/token | compute ceiling tok/s | memory ceiling tok/s |"
    head += " ÷ lower ceiling | bound | peak RSS MiB | RSS MiB | disturbed |"
    lines = [head, "|--:" * 8 + "|:-:" + "|--:" * 2 + "|:-:|"]
    for r in rows:
        cells = [
            str(r[key]),
            f"{r['pass_ms']:.2f}",
            f"{r['min_ms']:.2f}–{r['max_ms']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['flops_per_token'] / 1e6:.1f}",
            f"{r['compute_ceiling_tok_s']:.1f}",
            f"{r['memory_ceiling_tok_s']:.1f}",
            f"{r['fraction']:.2f}",
            r["bound"],
            f"{r['peak_rss_mib']:.0f}",
            "–" if r["rss_mib"] is None else f"{r['rss_mib']:.0f}",
            "yes" if r["disturbed"] else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report's tables and how they were made (the JSON's twin)."""
    m, model, s = report["machine"], report["model"], report["settings"]
    bw, rate = report["memory_bandwidth"], report["flop_rate"]
    k, n = rate["shape"]
    rates = ", ".join(f"{size}: {value:.1f}" for size, value in rate["gflops"].items())
    lines = [
        "# How a pass's cost grows: batch size, context and prompt, against the CPU's ceilings",
        "",
        f"Generated by `{report['command']}` on {report['date_utc']} (UTC), commit {report['commit']}, in "
        f"{report['elapsed_s'] / 60:.1f} minutes. Machine: {m.get('cpu')}, cores {m.get('cores')}, "
        f"{m.get('memory_gib')} GiB; onnxruntime {report['versions'].get('onnxruntime')}, numpy "
        f"{report['versions'].get('numpy')}. Model `{Path(model['folder']).name}` (context length "
        f"{model['context_length']}), `OrtBatchBackend` with {s['threads']} intra-op threads; median of "
        f"{s['repeats']} timings after a warm-up, each of {s['passes']} decode passes (a prompt pass: 1). "
        + _load(report),
        "",
        f"**Ceilings.** Compute: numpy's float32 `[M, {k}] x [{k}, {n}]` at M = the tokens in the pass, "
        f"{rate['threads']} BLAS threads ({rate['threads_set_by']}; {rate['blas']}), GFLOP/s by M: {rates}; "
        f"÷ FLOPs per token: {model['body_flops'] / 1e6:.1f} M in the matmuls below the LM head, "
        f"{model['head_flops'] / 1e6:.1f} M in the LM head (a prompt pass: its last position only), plus "
        "attention's 4 x attended positions x heads x head_size per layer. Memory: "
        f"{bw['per_threads'][str(s['threads'])]} GB/s (numpy copy split over {s['threads']} threads, read + write "
        f"counted, {bw['size_mib']} MiB) ÷ the bytes a pass reads: {model['weight_bytes'] / MIB:.1f} MiB of matmul "
        "weights, plus each row's KV of its past context; x the tokens in the pass. The FLOP test's weights stay in "
        "cache (at small M a cache rate); the rate at M is the best at M or fewer rows. A read-only stream can beat "
        "a copy: a fraction a little above 1 is possible. ÷ lower ceiling: measured tok/s ÷ min(the two).",
        *(["", "Limits: " + "; ".join(report["notes"]) + "."] if report["notes"] else []),
        "",
        f"## Batch size: a decode pass of B one-token rows, every row at a context of {s['batch_context']}",
        "",
        f"KV buffers {report['kv_mib']['batch']} MiB (the context plus {MARGIN} positions per slot); the slots are "
        "filled as B grows, so each row's RSS counts B filled slots. tok/s = B ÷ pass time.",
        "",
        *_table(report["batch"], "batch", "B"),
        "",
        "## Context: a one-row decode pass",
        "",
        *_table(report["context"], "context", "context"),
        "",
        "## Prefill: a prompt pass at position 0, the LM head over its last position",
        "",
        *_table(report["prefill"], "prompt", "prompt tokens"),
    ]
    return "\n".join(lines) + "\n"


def _default_folder() -> Path:
    from bench.throughput import model_folder

    return model_folder("fp32")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--folder", type=Path, help="the model folder (default: SmolLM2-135M-Instruct fp32, converted)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads, and the FLOP test's BLAS threads")
    ap.add_argument("--repeats", type=int, default=3, help="timings per row after a warm-up (default 3)")
    ap.add_argument("--passes", type=int, help="decode passes per timing (default 8; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, small sizes: checks, not speed")
    ap.add_argument("--out", type=Path, help=f"the JSON; the markdown beside it (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if min(args.threads, args.repeats, args.passes or 1) < 1:
        ap.error("--threads, --repeats and --passes must be at least 1")
    base = QUICK if args.quick else FULL
    plan = attrs.evolve(base, threads=args.threads, repeats=args.repeats, passes=args.passes or base.passes)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ortspec-cost-growth-") as tmp:
        if args.folder is not None:
            folder = args.folder
        elif args.quick:
            from tests.support.models import make_tiny_model

            folder = Path(make_tiny_model(Path(tmp) / "tiny-model", context=QUICK_CONTEXT))
        else:
            folder = _default_folder()
        before = background_load(plan.load_seconds)
        machine = machine_info()
        measured = measure(folder, plan)
        after = background_load(plan.load_seconds)
    report = {
        "command": "python -m bench.cost_growth" + (" " + " ".join(argv) if argv else ""),
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(short=True) or "unknown",
        "elapsed_s": round(time.perf_counter() - started, 1),
        "quick": args.quick,
        "machine": machine,
        "versions": machine["versions"],
        "load": _load_facts(before, measured.pop("during"), after, measured),
        "settings": {
            **attrs.asdict(plan),
            "contexts_requested": plan.contexts,
            "contexts": [r["context"] for r in measured["context"]],
            "prompts": [r["prompt"] for r in measured["prefill"]],
        },
        **measured,
    }
    fractions = [r["fraction"] for r in (*report["batch"], *report["context"], *report["prefill"])]
    report["summary"] = {"fraction_median": statistics.median(fractions), "fraction_max": max(fractions)}
    out = args.out or DEFAULT_OUT
    if args.quick and args.out is None:  # kept after the run, unlike the model's folder
        out = Path(tempfile.mkdtemp(prefix="ortspec-cost-growth-")) / DEFAULT_OUT.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    text = markdown(report)
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out} and {out.with_suffix('.md').name}", file=sys.stderr)
    return 0


def _load_facts(before: float | None, during: dict[str, Any], after: float | None, measured: dict[str, Any]):
    """The other processes' cores before, during and after; the run is ``disturbed`` when any of them or any row
    is above ``DISTURBED_CORES``."""
    rows = [*measured["batch"], *measured["context"], *measured["prefill"]]
    loads = (before, during["others_cores"], after)
    return {
        "before_cores": before,
        "during": during,
        "after_cores": after,
        "threshold_cores": DISTURBED_CORES,
        "disturbed_rows": sum(r["disturbed"] for r in rows),
        "disturbed": any(x is not None and x > DISTURBED_CORES for x in loads) or any(r["disturbed"] for r in rows),
    }


if __name__ == "__main__":
    raise SystemExit(main())
