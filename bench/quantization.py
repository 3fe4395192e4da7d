"""Quantized model folders compared: which settings keep speculative decoding exact and what they cost
(``settings``), and what int4 costs in quality against fp32, the choice of the default precision (``precision``).

    python -m bench.quantization settings               # about 45 minutes on 2 shared cores (2726 s on 2026-11-30)
    python -m bench.quantization settings --skip-real   # tiny models only (a minute)
    python -m bench.quantization precision [--prompts 64] [--tokens 512] [--generate 16] [--new-tokens 64]
                                           [--threads 2]

``settings``: the builder's fp32, int8 and int4 folders, int8/int4 at each MatMulNBits ``accuracy_level`` (the level
a folder is built with, ``ortspec convert --accuracy-level``, or set at load, ``matmul_accuracy_level``), and int4
at level 4 with the session option ``mlas.qnbit.force_fp32=1`` (onnxruntime >= 1.23: x64, 4-bit, block size 32
only). For each it measures, with pinned threads and interleaved so that machine noise hits every setting alike:

* **drift**: the largest |logit| difference between verify passes and one-token decodes
  (``Engine.verify_drift``'s protocol, 3 windows of 9 tokens, after contexts of 64, 256 and 512 tokens; 30 to 150
  on the tiny model), and whether speculative output (prompt lookup, cost-aware width) equals greedy output on the
  README's demo prompt and three benchmark prompts (``docs/bench/prompts``), 96 new tokens each;
* **speed**: a decode step and verify passes of 1 + K tokens after a 256-token context
  (``measure_pass_costs`` of ``ortspec.adapters.engine.measurements``, K = 4 and 8; its K values interleaved), and a
  256-token prefill; each round measures every setting in turn, speeds are ratios to fp32 within a round, medians
  over rounds; and end-to-end tokens/s of greedy and speculative decoding on the same prompts (settings whose decode
  step is more than 4x fp32's are not run end to end).

It writes ``--out`` (default docs/bench/quantization-settings.md: tables, machine, date) and prints each result as
it goes.

``precision``: the speed side of the default precision is ``python -m bench.throughput`` (docs/throughput.json);
this measures the other side on the same 64 chat prompts (bench/data/throughput-prompts.json), both default
folders, the same text:

* **perplexity**: each prompt's first ``--tokens`` tokens (chat-formatted) in one verify pass; the mean negative
  log-likelihood of every token after the first, as exp(mean NLL), per precision, and int4 ÷ fp32;
* **top-1 agreement**: at how many of those positions int4's most likely next token is fp32's;
* **greedy continuations**: ``--new-tokens`` new tokens (EOS ignored) from the first ``--generate`` prompts on each
  precision: how many are identical and, where they differ, the mean position of the first difference.

Then it states the choice: the precision with the best measured batched throughput (docs/throughput.json's
``fastest_precision``) unless its perplexity is more than ``--max-ppl-ratio`` (default 1.03) times fp32's. Writes
``--out`` (default docs/bench/quantization-precision.md) and the same numbers as JSON beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.machine import machine_info
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.cache import cache_root
from ortspec.adapters.engine.measurements import measure_pass_costs, measure_verify_drift, probe_ids
from ortspec.adapters.engine.options import DRIFT_WARNING_THRESHOLD
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.tools.convert import (
    EXACT_ACCURACY_LEVEL,
    convert_smollm2,
    default_model_dir,
    export_folder,
    is_complete,
    prepare_smollm2_hf,
)
from ortspec.backends.onnx import OrtBackend

ROOT = Path(__file__).resolve().parent.parent
OUT = {
    "settings": ROOT / "docs" / "bench" / "quantization-settings.md",
    "precision": ROOT / "docs" / "bench" / "quantization-precision.md",
}
PRECISIONS = ("fp32", "int4")
DATASET = ROOT / "bench" / "data" / "throughput-prompts.json"
THROUGHPUT = ROOT / "docs" / "throughput.json"

# ``settings``

FORCE_FP32 = {"mlas.qnbit.force_fp32": "1"}
DRIFT_CONTEXTS = {False: (30, 60, 100, 150), True: (64, 256, 512)}  # tiny, real


Setting = tuple[str, Path, dict, bool]  # label, folder, OrtBackend.from_folder options, run end to end


def setting_list(folders: dict[str, Path], *, all_levels: bool) -> list[Setting]:
    """Every setting measured. ``all_levels``: int8 at levels 2 and 3 and at level 1 set at load too (their decode
    steps take over a second on SmolLM2, so the real-model run measures int8 at levels 4 and 1 only). End to end:
    fp32, the builder defaults, int4 at level 1 (built and at load) and int4 with force_fp32 (levels 2 and 3 run
    the same float32 kernels as level 1 on x64: same drift to the digit)."""
    out: list[Setting] = [("fp32", folders["fp32"], {}, True)]
    for precision in ("int8", "int4"):
        built4, built1 = folders[f"{precision}-4"], folders[f"{precision}-1"]
        out.append((f"{precision} level 4 (builder default)", built4, {}, True))
        out.append((f"{precision} level 1 (built)", built1, {}, precision == "int4"))
        if precision == "int4" or all_levels:
            out.append((f"{precision} level 1 (at load)", built4, {"matmul_accuracy_level": 1}, precision == "int4"))
            for level in (2, 3):
                out.append((f"{precision} level {level} (at load)", built4, {"matmul_accuracy_level": level}, False))
        force = (f"{precision} level 4 + mlas.qnbit.force_fp32", built4, {"config_entries": FORCE_FP32})
        out.append((*force, precision == "int4"))
    return out


def real_folders(say) -> dict[str, Path]:
    """SmolLM2-135M-Instruct fp32 and int8/int4 at levels 4 and 1, converted into the ortspec cache once (the
    dequantized Hugging Face folder is kept under ``quant/`` to export each variant without redoing it)."""
    folders = {"fp32": convert_smollm2(default_model_dir("fp32"), "fp32", progress=say)}
    hf_dir = cache_root() / "quant" / "hf-SmolLM2-135M-Instruct"
    for precision in ("int8", "int4"):
        for level in (4, 1):
            dest = default_model_dir(precision, level)
            if not is_complete(dest):
                if not (hf_dir / "config.json").is_file():
                    with tempfile.TemporaryDirectory(prefix="ortspec-quant-") as work:
                        prepare_smollm2_hf(hf_dir, Path(work), say)
                t0 = time.perf_counter()
                export_folder(hf_dir, dest, precision, accuracy_level=level)
                say(f"[quant] exported {dest.name} in {time.perf_counter() - t0:.1f}s")
            folders[f"{precision}-{level}"] = dest
    return folders


def tiny_folders(say) -> dict[str, Path]:
    from tests.support.architectures import make_tiny_arch_model

    root = cache_root() / "arch" / "h256"
    folders = {"fp32": make_tiny_arch_model(root / "llama-fp32", "llama", "fp32", hidden=256)}
    for precision in ("int8", "int4"):
        folders[f"{precision}-4"] = make_tiny_arch_model(root / f"llama-{precision}", "llama", precision, hidden=256)
        folders[f"{precision}-1"] = make_tiny_arch_model(
            root / f"llama-{precision}-l1", "llama", precision, hidden=256, accuracy_level=1
        )
    say(f"[quant] tiny folders in {root}")
    return folders


def prompts(engine: Engine, count: int) -> list[list[int]]:
    from ortspec.adapters.cli.demo import DEMO_PROMPT

    texts = [DEMO_PROMPT] + [p.read_text() for p in sorted((ROOT / "docs" / "bench" / "prompts").glob("*.txt"))]
    return [engine.prompt_ids(text, chat=True) for text in texts[:count]]


def measure(settings: list[Setting], args, *, real: bool, say) -> list[dict]:
    threads = args.threads
    engines = []
    end_to_end = {}
    for label, folder, options, e2e_run in settings:
        end_to_end[label] = e2e_run
        backend = OrtBackend.from_folder(
            folder, BackendConfig(threads=threads, max_length=2048 if real else 256, **options)
        )
        tokenizer = Tokenizer.from_folder(folder)
        engine = Engine(backend, tokenizer, eos_token_ids=backend.folder.eos_token_ids, folder=backend.folder)
        engines.append((label, engine, options))
    results = {label: {"label": label, "end_to_end": end_to_end[label]} for label, _, _ in engines}
    context = 256 if real else 120
    kmax = 8
    ids = probe_ids(engines[0][1].backend.vocab_size, context + kmax + 1)
    # drift: Engine.verify_drift's protocol after several contexts (level-4 drift depends on the context)
    for label, engine, _ in engines:
        backend = engine.backend
        drifts = []
        for length in DRIFT_CONTEXTS[real]:
            drift_ids = probe_ids(backend.vocab_size, length + 27)
            drifts.append(measure_verify_drift(backend, drift_ids[:length], drift_ids[length:], windows=3))
        results[label]["drift"] = max(drifts)
        say(f"[quant] {label}: drift {results[label]['drift']:.3g} (contexts {DRIFT_CONTEXTS[real]})")
    # speed: each round measures every setting in turn (rotated per round) with measure_pass_costs
    # (its K values interleaved) and times a prefill; ratios to fp32 are taken within a round, then the median over
    # rounds, so that the machine's load hits fp32 and the setting alike
    rounds: dict[str, list[dict]] = {label: [] for label, _, _ in engines}
    for round_index in range(args.rounds):
        turn = engines[round_index % len(engines) :] + engines[: round_index % len(engines)]
        for label, engine, _ in turn:
            backend = engine.backend
            slow = bool(rounds[label]) and rounds[label][0]["decode_s"] > 0.5
            costs = measure_pass_costs(
                backend, ids[:context], ids[context:], kmax=kmax, repeats=1 if slow else (2 if real else 15)
            )
            t0 = time.perf_counter()
            backend.decode(ids[:context], 0)
            prefill_s = time.perf_counter() - t0
            backend.reset()
            rounds[label].append({"decode_s": costs["decode_step_s"], "curve": costs["curve"], "prefill_s": prefill_s})
        say(f"[quant] speed round {round_index + 1}/{args.rounds} done")
    fp32 = rounds[engines[0][0]]
    for label, _, _ in engines:
        mine = rounds[label]
        results[label].update(
            decode_ms=1000 * statistics.median(r["decode_s"] for r in mine),
            decode_vs_fp32=statistics.median(f["decode_s"] / r["decode_s"] for f, r in zip(fp32, mine, strict=True)),
            verify4=statistics.median(r["curve"][4] for r in mine),
            verify8=statistics.median(r["curve"][8] for r in mine),
            prefill_vs_fp32=statistics.median(f["prefill_s"] / r["prefill_s"] for f, r in zip(fp32, mine, strict=True)),
        )
    # end to end
    if real:
        prompt_ids = prompts(engines[0][1], args.prompts)
        e2e: dict[str, dict[str, list[float]]] = {label: {"greedy": [], "spec": []} for label, _, _ in engines}
        identical: dict[str, list[bool]] = {label: [] for label, _, _ in engines}
        for prompt in prompt_ids:
            for label, engine, _ in engines:
                if results[label]["decode_vs_fp32"] < 0.25 or not results[label]["end_to_end"]:
                    continue
                greedy = engine.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True, speculative=None)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    spec = engine.generate(
                        prompt, max_tokens=args.max_tokens, ignore_eos=True, speculative="prompt-lookup"
                    )
                identical[label].append(spec.token_ids == greedy.token_ids)
                e2e[label]["greedy"].append(len(greedy.token_ids) / greedy.timings.total_s)
                e2e[label]["spec"].append(len(spec.token_ids) / spec.timings.total_s)
            say(f"[quant] end to end: prompt {len(identical[engines[0][0]])}/{len(prompt_ids)} done")
        base = statistics.median(e2e[engines[0][0]]["greedy"])
        for label, _, _ in engines:
            if not identical[label]:
                results[label]["e2e"] = None
                results[label]["e2e_skipped"] = (
                    f"decode step {1 / results[label]['decode_vs_fp32']:.1f}x fp32's"
                    if results[label]["decode_vs_fp32"] < 0.25
                    else "not run: same kernels as a setting above"
                )
                continue
            greedy_rate = statistics.median(e2e[label]["greedy"])
            spec_rate = statistics.median(e2e[label]["spec"])
            results[label]["e2e"] = {
                "identical": f"{sum(identical[label])}/{len(identical[label])}",
                "greedy_tok_s": greedy_rate,
                "spec_tok_s": spec_rate,
                "greedy_vs_fp32": greedy_rate / base,
                "spec_vs_fp32_greedy": spec_rate / base,
            }
    return [results[label] for label, _, _ in engines]


def table(rows: list[dict], real: bool, max_tokens: int = 0) -> list[str]:
    lines = [
        "| setting | drift (logits) | exact | decode step | decode speed vs fp32 | verify(4)/decode | "
        "verify(8)/decode | prefill speed vs fp32 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        exact = "yes" if r["drift"] <= DRIFT_WARNING_THRESHOLD else "no"
        lines.append(
            f"| {r['label']} | {r['drift']:.2g} | {exact} | {r['decode_ms']:.1f} ms | {r['decode_vs_fp32']:.2f}x | "
            f"{r['verify4']:.2f} | {r['verify8']:.2f} | {r['prefill_vs_fp32']:.2f}x |"
        )
    if real:
        lines += [
            "",
            f"End to end (chat prompts, {max_tokens} new tokens, EOS ignored, tokens/s including prefill; "
            "medians over prompts; "
            "speculative = prompt lookup with the cost-aware width):",
            "",
            "| setting | speculative == greedy | greedy tok/s | speculative tok/s | greedy vs fp32 greedy | "
            "speculative vs fp32 greedy |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            e = r.get("e2e")
            if not e:
                lines.append(f"| {r['label']} | {r.get('e2e_skipped', 'not run')} | | | | |")
                continue
            lines.append(
                f"| {r['label']} | {e['identical']} | {e['greedy_tok_s']:.1f} | {e['spec_tok_s']:.1f} | "
                f"{e['greedy_vs_fp32']:.2f}x | {e['spec_vs_fp32_greedy']:.2f}x |"
            )
    return lines


def run_settings(args: argparse.Namespace) -> int:
    """``settings``: every quantized setting's drift and speed (module docstring); writes ``--out``."""

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    import onnxruntime

    started = time.perf_counter()
    lines = [
        "# Quantized settings: exactness and speed (measured)",
        "",
        "Written by `python -m bench.quantization settings` (do not edit by hand) on "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or platform.platform()}, "
        f"{args.threads} intra-op threads; onnxruntime {onnxruntime.__version__}. *drift*: the largest |logit| "
        "difference between verify passes and one-token decodes (3 windows of 9 tokens after each of several "
        f"contexts: {DRIFT_CONTEXTS[True]} tokens on SmolLM2, {DRIFT_CONTEXTS[False]} on the tiny model); *exact*: "
        f"drift <= {DRIFT_WARNING_THRESHOLD:g}. Speeds ({args.rounds} rounds; {args.prompts} prompts end to end): "
        "each round measures every setting in turn; "
        "speed vs fp32 is fp32's time over the setting's in the same round (higher is faster), median over rounds; "
        "verify(K)/decode is a pass over 1 + K tokens divided by a decode step of the same setting "
        "(`measure_pass_costs`), median over rounds. `ortspec convert --precision int4|int8` "
        f"builds level {EXACT_ACCURACY_LEVEL}.",
        "",
    ]
    tiny = measure(setting_list(tiny_folders(say), all_levels=True), args, real=False, say=say)
    lines += ["## Tiny random Llama (hidden 256, 2 layers, vocabulary 384; 120-token context)", ""]
    lines += table(tiny, real=False) + [""]
    if not args.skip_real:
        real = measure(setting_list(real_folders(say), all_levels=False), args, real=True, say=say)
        lines += ["## SmolLM2-135M-Instruct (256-token context)", ""]
        lines += table(real, real=True, max_tokens=args.max_tokens) + [""]
    lines.append(f"Run time: {time.perf_counter() - started:.0f} s.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


# ``precision``


def folder(precision: str) -> Path:
    """The default model's folder at ``precision`` (converted now if it is not yet)."""
    path = default_model_dir(precision)
    if not is_complete(path):
        convert_smollm2(path, precision, progress=lambda m: print(m, file=sys.stderr))
    return path


def token_log_probs(engine: Engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For ``ids`` folded in from position 0 in one pass: the log-probability of each of ``ids[1:]`` given the
    tokens before it, and the most likely next token at each of those positions (both ``[len(ids) - 1]``)."""
    engine.backend.reset()
    logits = engine.backend.decode_verify(ids, 0)[:-1].astype(np.float64)
    engine.backend.reset()
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    targets = np.asarray(ids[1:])
    return shifted[np.arange(len(targets)), targets] - log_z, logits.argmax(axis=1)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_precision(args: argparse.Namespace) -> int:
    """``precision``: int4 against fp32 in quality, and the choice (module docstring); writes ``--out`` and its
    JSON."""
    records = json.loads(DATASET.read_text(encoding="utf-8"))["records"][: args.prompts]
    config = BackendConfig(threads=args.threads)
    engines = {p: Engine.from_dir(folder(p), config, drafter=False) for p in PRECISIONS}
    nll = {p: [] for p in PRECISIONS}
    agree = positions = 0
    for record in records:
        ids = engines["fp32"].prompt_ids(record["messages"])[: args.tokens]
        lp = {p: token_log_probs(e, ids) for p, e in engines.items()}
        for p in PRECISIONS:
            nll[p].extend((-lp[p][0]).tolist())
        agree += int((lp["fp32"][1] == lp["int4"][1]).sum())
        positions += len(ids) - 1
    ppl = {p: math.exp(float(np.mean(nll[p]))) for p in PRECISIONS}
    identical, firsts = 0, []
    for record in records[: args.generate]:
        outs = {
            p: e.generate(record["messages"], max_tokens=args.new_tokens, ignore_eos=True, speculative=None).token_ids
            for p, e in engines.items()
        }
        at = first_difference(list(outs["fp32"]), list(outs["int4"]))
        identical += at is None
        if at is not None:
            firsts.append(at)
    speed = json.loads(THROUGHPUT.read_text(encoding="utf-8"))["fastest_precision"]
    fastest = speed["precision"]
    ratio = ppl["int4"] / ppl["fp32"]
    choice = fastest if fastest == "fp32" or ratio <= args.max_ppl_ratio else "fp32"
    result = {
        "command": "python -m bench.quantization precision",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "prompts": len(records),
        "tokens_per_prompt": args.tokens,
        "scored_positions": positions,
        "perplexity": ppl,
        "perplexity_ratio_int4": ratio,
        "top1_agreement": agree / positions,
        "greedy": {
            "prompts": args.generate,
            "new_tokens": args.new_tokens,
            "identical": identical,
            "mean_first_difference": float(np.mean(firsts)) if firsts else None,
        },
        "throughput": speed["by"],
        "max_ppl_ratio": args.max_ppl_ratio,
        "choice": choice,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    args.out.write_text(report(result), encoding="utf-8")
    print(report(result))
    return 0


def report(r: dict) -> str:
    """The markdown page for the measured ``r``."""
    tp = r["throughput"]
    g = r["greedy"]
    first = f"{g['mean_first_difference']:.1f}" if g["mean_first_difference"] is not None else "-"
    return "\n".join(
        [
            "# The default precision: int4 (MatMulNBits accuracy level 1) or fp32",
            "",
            f"Measured {r['date_utc']} by `{r['command']}` on {r['machine'].get('cpu')} "
            f"({r['machine'].get('cores', {}).get('usable')} usable cores). Quality on the throughput dataset's "
            f"{r['prompts']} chat prompts "
            f"(first {r['tokens_per_prompt']} tokens each, {r['scored_positions']} scored positions); speed from "
            "docs/throughput.json (`python -m bench.throughput`, the same prompts).",
            "",
            "| | fp32 | int4 level 1 | int4 ÷ fp32 |",
            "| --- | --: | --: | --: |",
            f"| perplexity | {r['perplexity']['fp32']:.3f} | {r['perplexity']['int4']:.3f} | "
            f"{r['perplexity_ratio_int4']:.4f} |",
            f"| ortspec batched, plain: tok/s | {tp['fp32']['tokens_per_s']:.1f} | {tp['int4']['tokens_per_s']:.1f} | "
            f"{tp['int4']['tokens_per_s'] / tp['fp32']['tokens_per_s']:.2f} |",
            "",
            f"int4's most likely next token is fp32's at {100 * r['top1_agreement']:.1f}% of the positions. Greedy "
            f"continuations ({g['new_tokens']} tokens, EOS ignored): {g['identical']}/{g['prompts']} identical; where "
            f"they differ, the first difference is at token {first} on average.",
            "",
            f"**Choice: {r['choice']}** (the faster precision by batched throughput, unless its perplexity is more "
            f"than {r['max_ppl_ratio']}x fp32's).",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("settings", help="every quantized setting: exactness (drift) and speed")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds (default 5)")
    s.add_argument("--prompts", type=int, default=4, help="end-to-end prompts (default 4)")
    s.add_argument("--max-tokens", type=int, default=96)
    s.add_argument("--skip-real", action="store_true", help="tiny models only")
    q = sub.add_parser("precision", help="int4 against fp32 in quality, and the default precision")
    q.add_argument("--prompts", type=int, default=64)
    q.add_argument("--tokens", type=int, default=512)
    q.add_argument("--generate", type=int, default=16)
    q.add_argument("--new-tokens", type=int, default=64)
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--max-ppl-ratio", type=float, default=1.03)
    for command, p in (("settings", s), ("precision", q)):
        p.add_argument("--out", type=Path, default=OUT[command], help=f"the report (default {OUT[command]})")
    args = parser.parse_args(argv)
    return run_settings(args) if args.command == "settings" else run_precision(args)


if __name__ == "__main__":
    raise SystemExit(main())
