"""Long runs: a 20,000-token generation with flat memory and flat per-token speed, and 1,000 back-to-back
generations that leak nothing. Writes its figures into docs/reliability.md (``--write``).

    python scripts/long_run.py                  # about 10 minutes on 2 cores; prints the figures
    python scripts/long_run.py --write          # ... and replaces the long-run section of docs/reliability.md
    python scripts/long_run.py --tokens 2000 --generations 100     # a short version (tests/test_long_run.py)

The model is the tiny random Llama of ``make_tiny_model`` built with a context long enough for the run (kept in
the ortspec cache), on one intra-op thread, so that the thread's CPU time (``time.thread_time``) is the work of
the run itself: it is what the figures use, since wall time on a shared machine measures the neighbours too.

What is measured:

* **Raw greedy**: the backend alone (``decode`` one token, numpy argmax), no ortspec driver or core: how a pass's
  cost grows with the context (attention reads every earlier position).
* **Warm-up**: one generation of the full length. The KV buffers are allocated at load but the OS makes their
  pages resident as positions are first written, and onnxruntime's own allocations grow the same way; both
  happen once per Engine and are reported, not counted as growth.
* **ortspec greedy** and **ortspec speculative** (prompt lookup, cost-aware width), ``ignore_eos``: per-token CPU
  time of the first thousand tokens (after the first) and of the last thousand, split into the time inside the
  backend's passes and ortspec's own, and RSS every thousand tokens. Flat speed: the run's last/first ratio is
  within 15% of the ratio of the greedy runs' passes at the same positions (``growth_vs_greedy`` <= 1.15), i.e.
  the run slows down only as much as the model's attention does. Flat memory: RSS grows by less than 5 MB over
  the run.
* **Back to back**: ``--generations`` short generations (alternating greedy and speculative, varying prompts) on
  one Engine; RSS, live Python objects and allocated Python memory blocks after each tenth. No leak: over the
  second half, RSS grows by less than 1 MB and the objects and blocks by at most 100.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
BEGIN = "<!-- BEGIN long-run figures (written by `python scripts/long_run.py --write`; do not edit) -->"
END = "<!-- END long-run figures -->"
PROMPT = "the quick brown fox jumps over the lazy dog"
WINDOW = 1000  # tokens per speed window
SPEED_TOLERANCE = 1.15
MEMORY_TOLERANCE_MB = 5.0


def rss_mb() -> float:
    """Resident set size of this process, in MiB (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def long_context_model(tokens: int, folder: Path | None = None) -> Path:
    """The tiny builder model with a context of at least ``tokens`` + 64 positions (a multiple of 1024), built on
    first use into the ortspec cache, in a child process (the builder's torch would otherwise stay in this
    process's memory, under the figures)."""
    from ortspec.adapters.engine.cache import cache_root
    from ortspec.adapters.tools.convert import is_complete

    context = -(-(tokens + 64) // 1024) * 1024
    folder = folder or cache_root() / "models" / f"tiny-long-{context}"
    if not is_complete(folder):
        code = "import sys; from tests.support.models import make_tiny_model as m; m(sys.argv[1], context=int(sys.argv[2]))"  # noqa: E501
        subprocess.run([sys.executable, "-c", code, str(folder), str(context)], check=True, cwd=ROOT)
    return folder


def raw_greedy(backend: Any, prompt: Sequence[int], tokens: int) -> list[float]:
    """Greedy decoding on the backend alone; the thread CPU time after each token (index 0: the prompt pass)."""
    backend.reset()
    logits = backend.decode(list(prompt), 0)
    marks = [time.thread_time()]
    for _ in range(tokens - 1):
        token = int(np.argmax(logits))
        logits = backend.decode([token], backend.current_len())
        marks.append(time.thread_time())
    return marks


def run(engine: Any, tokens: int, speculative: str | None) -> dict[str, Any]:
    """One ``ignore_eos`` generation of ``tokens`` tokens: after each token, the thread CPU time in all and the
    part spent inside the backend's passes (so the rest is ortspec's own: driver, core, proposer, detokenizer,
    callback); RSS every WINDOW tokens."""
    from ortspec import CostAwareWidth, Options, PromptLookup, generate
    from ortspec.core import MAX_DRAFT

    marks: list[float] = []
    inside: list[float] = []
    rss: list[float] = [rss_mb()]
    spent = [0.0]
    backend = engine.backend
    passes = {
        name: getattr(backend, name) for name in ("decode", "decode_verify", "verify_picks") if hasattr(backend, name)
    }

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.thread_time()
            try:
                return method(*args)
            finally:
                spent[0] += time.thread_time() - t0

        return call

    def on_token(text: str, token_id: int, finish: str | None) -> None:
        marks.append(time.thread_time())
        inside.append(spent[0])
        if len(marks) % WINDOW == 0:
            rss.append(rss_mb())

    for name, method in passes.items():
        setattr(backend, name, timed(method))
    try:  # the Engine's loop on this thread (its one-sequence backend), so the thread's CPU time is all of it
        result = generate(
            backend,
            engine.prompt_ids(PROMPT),
            Options(max_tokens=tokens),
            PromptLookup(ngram=3, max_draft=MAX_DRAFT) if speculative else None,
            draft_width=CostAwareWidth(engine.measurements.pass_costs()) if speculative else 1,
            callback=on_token,
            detokenize=engine.tokenizer.decode,
        )
    finally:
        for name in passes:
            delattr(backend, name)  # the class's methods again
    assert len(result.token_ids) == tokens, (len(result.token_ids), tokens)
    own = [total - backend_part for total, backend_part in zip(marks, inside, strict=True)]
    return {"marks": marks, "own": own, "rss": rss, "steps": result.stats.steps}


def per_token_us(marks: Sequence[float], start: int, stop: int) -> float:
    return (marks[stop] - marks[start]) / (stop - start) * 1e6


def windows(marks: Sequence[float]) -> tuple[float, float]:
    """Per-token CPU microseconds over the first window (after the first token, whose time includes the prompt
    pass) and over the last."""
    n = len(marks) - 1
    return per_token_us(marks, 1, 1 + WINDOW), per_token_us(marks, n - WINDOW, n)


def speed(runs: Sequence[dict[str, Any]], greedy: Sequence[dict[str, Any]], raws: Sequence[Sequence[float]]) -> dict:
    """Per-token CPU microseconds over the first and last windows, each the least over the repeats (noise on a
    shared machine only ever adds time): of the run, of its own part (outside the backend's passes), of the
    greedy runs' passes (the decode steps at those positions: attention growth as measured by greedy) and of raw
    greedy (the backend alone, for reference); and the run's growth relative to greedy's passes."""

    def least(series: Sequence[Sequence[float]]) -> tuple[float, float]:
        first, last = zip(*(windows(m) for m in series), strict=True)
        return min(first), min(last)

    first, last = least([r["marks"] for r in runs])
    own_first, own_last = least([r["own"] for r in runs])
    passes_first, passes_last = least([[t - o for t, o in zip(r["marks"], r["own"], strict=True)] for r in greedy])
    raw_first, raw_last = least(raws)
    return {
        "first_us": first,
        "last_us": last,
        "own_first_us": own_first,
        "own_last_us": own_last,
        "greedy_passes_first_us": passes_first,
        "greedy_passes_last_us": passes_last,
        "raw_first_us": raw_first,
        "raw_last_us": raw_last,
        "growth": last / first,
        "greedy_growth": passes_last / passes_first,
        "growth_vs_greedy": (last / first) / (passes_last / passes_first),
    }


def cold_cache_step_us(kv_bytes: int, steps: int = 2000) -> tuple[float, float]:
    """CPU microseconds of one core step (the same state, the same row) with hot caches, and right after reading
    ``kv_bytes`` of memory, as an attention pass over a long context does: why ortspec's own time per token grows
    with the context on a real backend although its work does not."""
    from ortspec.core import DecodeState, Options, step

    streamed = np.ones(max(kv_bytes // 4, 1), np.float32)
    row = np.zeros(384, np.float32)
    row[7] = 1.0
    out = []
    for pollute in (False, True):
        state = DecodeState.start([5, 6, 7], Options(max_tokens=steps + 1))
        own = 0.0
        for _ in range(steps):
            if pollute:
                streamed.sum()
            t0 = time.thread_time()
            state, _, _, _, _ = step(state, row, None, ())
            own += time.thread_time() - t0
        out.append(own / steps * 1e6)
    return out[0], out[1]


def back_to_back(engine: Any, count: int) -> dict[str, Any]:
    """``count`` short generations on one Engine (alternately greedy and speculative, rotating prompts): RSS
    (MiB), live container objects and allocated Python memory blocks (after ``gc.collect()``) at each tenth."""
    words = PROMPT.split()
    samples: list[tuple[int, float, int, int]] = []

    def sample(done: int) -> None:
        gc.collect()
        samples.append((done, rss_mb(), len(gc.get_objects()), sys.getallocatedblocks()))

    t0 = time.perf_counter()
    for i in range(count):
        prompt = " ".join(words[i % len(words) :] + words[: i % len(words)])
        engine.generate(prompt, max_tokens=24, ignore_eos=True, speculative="prompt-lookup" if i % 2 else None)
        if (i + 1) % max(1, count // 10) == 0:
            sample(i + 1)
    half = next(s for s in samples if s[0] >= count // 2)
    return {"count": count, "seconds": time.perf_counter() - t0, "samples": samples, "half": half, "end": samples[-1]}


def measure(
    model: Path, tokens: int, generations: int, repeats: int = 3, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Everything the module docstring lists, on ``model``; a dict of figures. Each timed run is made ``repeats``
    times (in turn: raw greedy, ortspec greedy, ortspec speculative), and each window keeps its least time."""
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import BackendConfig, ModelFolder

    context = ModelFolder.load(model).context_length  # the whole context for one slot (batched slots cap theirs)
    engine = Engine.from_dir(model, BackendConfig(threads=1, max_length=context), batch_slots=1)
    folder = engine.folder
    assert folder is not None
    prompt_ids = engine.prompt_ids(PROMPT)
    engine.measurements.verify_drift(), engine.measurements.pass_costs()  # measured (or read) now, not timed
    log("warm-up: one full-length generation")
    rss_load = rss_mb()
    warm = run(engine, tokens, None)
    kv_bytes_per_token = folder.num_layers * 2 * folder.num_kv_heads * folder.head_size * 4
    figures: dict[str, Any] = {
        "tokens": tokens,
        "repeats": repeats,
        "model": folder,
        "rss_load": rss_load,
        "rss_warm_growth": warm["rss"][-1] - warm["rss"][0],
        "kv_touched_mb": kv_bytes_per_token * (len(prompt_ids) + tokens) / 2**20,
    }
    raws: list[list[float]] = []
    measured: dict[str, list[dict[str, Any]]] = {"greedy": [], "speculative": []}
    for r in range(repeats):
        log(f"round {r + 1}/{repeats}: raw greedy, ortspec greedy, ortspec speculative ({tokens} tokens each)")
        raws.append(raw_greedy(engine.backend, prompt_ids, tokens))
        for name, speculative in (("greedy", None), ("speculative", "prompt-lookup")):
            gc.collect()
            measured[name].append(run(engine, tokens, speculative))
    for name, results in measured.items():
        figures[name] = {
            **speed(results, measured["greedy"], raws),
            "rss_growth": max(max(m["rss"]) - m["rss"][0] for m in results),
            "steps": results[-1]["steps"],
        }
    log(f"back to back: {generations} generations")
    figures["back_to_back"] = back_to_back(engine, generations)
    figures["kv_read_mb"] = kv_bytes_per_token * (len(prompt_ids) + tokens) / 2**20
    figures["step_hot_us"], figures["step_cold_us"] = cold_cache_step_us(int(figures["kv_read_mb"] * 2**20))
    return figures


def verdicts(figures: dict[str, Any]) -> list[tuple[str, bool]]:
    """(what, held) for each target."""
    out = []
    for name in ("greedy", "speculative"):
        f = figures[name]
        out.append((f"{name}: speed flat (growth vs greedy {f['growth_vs_greedy']:.2f} <= {SPEED_TOLERANCE})",
                    f["growth_vs_greedy"] <= SPEED_TOLERANCE))  # fmt: skip
        out.append((f"{name}: memory flat (RSS +{f['rss_growth']:.1f} MB < {MEMORY_TOLERANCE_MB:g} MB)",
                    f["rss_growth"] < MEMORY_TOLERANCE_MB))  # fmt: skip
    b = figures["back_to_back"]
    (n0, rss0, objects0, blocks0), (n1, rss1, objects1, blocks1) = b["half"], b["end"]
    out.append((f"back to back, generations {n0}-{n1}: RSS {rss1 - rss0:+.2f} MB (< 1 MB)", rss1 - rss0 < 1.0))
    out.append(
        (
            f"back to back, generations {n0}-{n1}: live objects {objects1 - objects0:+d}, Python memory blocks "
            f"{blocks1 - blocks0:+d} (each at most +100)",
            objects1 - objects0 <= 100 and blocks1 - blocks0 <= 100,
        )
    )
    return out


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import onnxruntime

    return (
        f"{cpu}, {os.cpu_count()} logical CPUs; {platform.system()} {platform.release()}; Python "
        f"{platform.python_version()}, onnxruntime {onnxruntime.__version__}"
    )


def render(figures: dict[str, Any], command: str) -> str:
    folder = figures["model"]
    rows = []
    for name in ("greedy", "speculative"):
        f = figures[name]
        rows.append(
            f"| ortspec {name} | {f['first_us']:.0f} → {f['last_us']:.0f} ({f['growth']:.2f}x) | "
            f"{f['own_first_us']:.0f} → {f['own_last_us']:.0f} | "
            f"{f['greedy_passes_first_us']:.0f} → {f['greedy_passes_last_us']:.0f} ({f['greedy_growth']:.2f}x) | "
            f"**{f['growth_vs_greedy']:.2f}** | +{f['rss_growth']:.1f} MB | {f['steps']:,} |"
        )
    f = figures["greedy"]
    raw = f"{f['raw_first_us']:.0f} → {f['raw_last_us']:.0f} ({f['raw_last_us'] / f['raw_first_us']:.2f}x)"
    b = figures["back_to_back"]
    checks = "\n".join(f"- {'✓' if held else '✗ MISSED'} {what}" for what, held in verdicts(figures))
    return "\n".join(
        [
            BEGIN,
            "",
            f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; one intra-op thread; `{command}`.",
            "",
            f"Model: the tiny builder Llama (`make_tiny_model(context={folder.context_length})`: {folder.num_layers} "
            f"layers, {folder.num_attention_heads} heads, {folder.num_kv_heads} KV heads, head size {folder.head_size},"
            f" vocabulary {folder.vocab_size}), {figures['tokens']:,} new tokens with `ignore_eos`. Times are thread "
            f"CPU microseconds per token over the first {WINDOW:,} tokens (after the first) and the last {WINDOW:,}, "
            f"each the least of {figures['repeats']} runs. *ortspec's own*: the run's time outside the backend's "
            "passes (driver, core, proposer, detokenizer). *greedy's passes*: the time inside the passes of the "
            "greedy runs, i.e. decode steps at those positions, whose growth is the model's attention reading a "
            "longer context. *growth vs greedy*: the run's last/first ratio ÷ greedy's passes' (target <= "
            f"{SPEED_TOLERANCE}). Target passes: of the last run.",
            "",
            "| run | µs/token, first 1k → last 1k | ortspec's own | greedy's passes | growth vs greedy "
            "| RSS during the run | target passes |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            f"The backend alone (raw greedy: decode, argmax; no ortspec), for reference: {raw} µs/token.",
            "",
            "ortspec's own time grows with the context on this backend although its work per step does not (the "
            "fake-backend guard in tests/test_long_run.py, where no attention runs, keeps it flat): one core step "
            f"takes {figures['step_hot_us']:.1f} µs with hot caches and {figures['step_cold_us']:.1f} µs right after "
            f"reading {figures['kv_read_mb']:.1f} MB, the KV one pass reads at the last position. Speculative "
            "decoding makes fewer passes, so it pays this less often.",
            "",
            f"Warm-up (the first full-length generation on a fresh Engine): RSS +{figures['rss_warm_growth']:.1f} MB, "
            f"of which {figures['kv_touched_mb']:.1f} MB are KV pages written for the first time (allocated at load "
            "and made resident as positions are used) and the rest onnxruntime's own allocations (the backend alone, "
            "without ortspec, grows the same way). "
            "Later generations of the same length reuse both.",
            "",
            f"Back to back: {b['count']:,} generations of 24 tokens on one Engine (alternately greedy and speculative, "
            f"rotating prompts) in {b['seconds']:.1f} s. RSS (MB) after each tenth: "
            + ", ".join(f"{rss:.1f}" for _, rss, _, _ in b["samples"])
            + "; live container objects: "
            + ", ".join(f"{objects:,}" for _, _, objects, _ in b["samples"])
            + "; allocated Python memory blocks: "
            + ", ".join(f"{blocks:,}" for _, _, _, blocks in b["samples"])
            + ". The RSS of the first generations grows as onnxruntime's allocator settles (the backend alone, without "
            "ortspec, does the same), so the leak check compares the second half.",
            "",
            checks,
            "",
            END,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000, help="new tokens per long generation (default 20000)")
    parser.add_argument("--generations", type=int, default=1000, help="back-to-back generations (default 1000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each kind; windows keep the least")
    parser.add_argument("--model", type=Path, help="a model folder with a long enough context (default: built)")
    parser.add_argument("--write", action="store_true", help="replace the long-run section of docs/reliability.md")
    args = parser.parse_args(argv)
    if args.tokens < 2 * WINDOW + 2:
        parser.error(f"--tokens must be at least {2 * WINDOW + 2} (two windows of {WINDOW})")
    model = args.model or long_context_model(args.tokens)
    figures = measure(model, args.tokens, args.generations, args.repeats, log=lambda m: print(m, file=sys.stderr))
    defaults = {"tokens": 20_000, "generations": 1000, "repeats": 3}
    given = {"tokens": args.tokens, "generations": args.generations, "repeats": args.repeats}
    command = "python scripts/long_run.py" + "".join(f" --{k} {v}" for k, v in given.items() if v != defaults[k])
    section = render(figures, command)
    print(section)
    if args.write:
        document = DOC.read_text(encoding="utf-8")
        start, stop = document.index(BEGIN), document.index(END) + len(END)
        DOC.write_text(document[:start] + section + document[stop:], encoding="utf-8")
    return 0 if all(held for _, held in verdicts(figures)) else 1


if __name__ == "__main__":
    sys.exit(main())
