"""Every architecture the onnxruntime-genai 0.18 builder writes, at every precision, through ortspec.

    python scripts/arch_matrix.py                      # the whole matrix (about 10 minutes on 2 cores)
    python scripts/arch_matrix.py --archs llama,lfm2 --settings fp32,int4 --out /tmp/m.md

For each architecture of ``ortspec.adapters.architectures.ARCHITECTURES`` it builds a tiny random-weight model
(hidden size 256, so that the quantized MatMulNBits kernels take the same paths as real models'; built once and
cached under ``~/.cache/ortspec/arch/``) at each precision, and for each setting runs
``ortspec.adapters.conformance.check_folder``: the folder loads as is, greedy equals ONNX Runtime GenAI's greedy
search on the same folder (and, for fp32, transformers' greedy decoding of the checkpoint it came from),
speculative decoding equals greedy decoding (drafts replaying the greedy continuation, all right and every third
wrong, and prompt lookup), and the verify drift. A setting is *exact* when every speculative run equals greedy
and the verify passes along the greedy continuation drift at most ``Engine``'s warning threshold (1e-3 logits)
from one-token decodes. It writes ``docs/architectures.md`` (the
README's table is copied from it) and prints each row as it goes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from pathlib import Path

from ortspec.adapters.architectures import ARCHITECTURES, make_tiny_arch_model
from ortspec.adapters.cache import cache_root
from ortspec.adapters.conformance import FolderReport, check_folder
from ortspec.adapters.engine import DRIFT_WARNING_THRESHOLD

ROOT = Path(__file__).resolve().parent.parent
# setting -> (precision built, OrtBackend.from_folder options, label)
# setting -> (precision built, MatMulNBits accuracy level built (None: the builder's), label)
SETTINGS: dict[str, tuple[str, int | None, str]] = {
    "fp32": ("fp32", None, "fp32"),
    "fp16": ("fp16", None, "fp16 (CUDA build, CPU EP)"),
    "int8": ("int8", None, "int8, level 4 (builder default)"),
    "int8-l1": ("int8", 1, "int8, level 1"),
    "int4": ("int4", None, "int4, level 4 (builder default)"),
    "int4-l1": ("int4", 1, "int4, level 1"),
}
PROMPT_TEXT = "def merge(a, b):\n    return sorted(a + b)\n\n" * 3


def first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def verdict(report: FolderReport) -> tuple[str, str, str]:
    """(greedy cell, speculative cell, why-not cell) for one report."""
    if report.load_error:
        return "no", "no", "load: " + first_line(report.load_error)
    if report.run_error:
        return "no", "no", "run: " + first_line(report.run_error)
    notes = []
    if report.genai_agree is not None:
        agree, total = report.genai_agree
        greedy = (
            f"yes, = ORT GenAI ({agree}/{total})" if agree == total else f"yes; ORT GenAI differs at {agree}/{total}"
        )
    else:
        greedy = "yes; ORT GenAI fails: " + first_line(report.genai_error or "", 90)
    if report.hf_agree is not None and report.hf_agree[0] != report.hf_agree[1]:
        notes.append(f"graph != transformers (agree {report.hf_agree[0]}/{report.hf_agree[1]})")
    drift = report.drift if report.drift is not None else float("nan")
    identical = bool(report.speculative_exact)
    if identical and drift <= DRIFT_WARNING_THRESHOLD:
        spec = "exact" + ("" if report.drafts_accepted else " (no multi-token accept)")
    elif identical:
        spec = f"not guaranteed (drift {drift:.2g})"
        notes.append(f"verify rows drift {drift:.2g} logits from one-token decodes (> {DRIFT_WARNING_THRESHOLD:g})")
    else:
        wrong = [run.proposer for run in report.speculative if not run.identical]
        spec = f"no (drift {drift:.2g})"
        notes.append("speculative != greedy with " + ", ".join(wrong))
    if report.rewrites:
        notes.append("load-time rewrite: " + "; ".join(sorted({r.split(" on ")[0] for r in report.rewrites})))
    if report.stateful:
        notes.append("recurrent state: snapshot/replay on rewind")
    return greedy, spec, "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHITECTURES), help="comma-separated (default: all)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated of {list(SETTINGS)}")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny models (default 256)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/ortspec/arch)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.split(",") if a]
    settings = [s for s in args.settings.split(",") if s]
    unknown = [a for a in archs if a not in ARCHITECTURES] + [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown architectures or settings: {unknown}")
    cache = (args.cache or cache_root() / "arch") / f"h{args.hidden}"
    started = time.perf_counter()
    rows = []
    for arch in archs:
        spec = ARCHITECTURES[arch]
        hf_dir = cache / f"hf-{arch}"
        for setting in settings:
            precision, level, label = SETTINGS[setting]
            t0 = time.perf_counter()
            try:
                folder = make_tiny_arch_model(
                    cache / f"{arch}-{setting}",
                    arch,
                    precision,
                    hidden=args.hidden,
                    hf_dir=hf_dir,
                    accuracy_level=level,
                )
            except Exception as exc:  # noqa: BLE001 - the table says why
                rows.append((spec.label, label, "no", "no", "build: " + first_line(str(exc)), 0.0))
                print(f"{arch:17s} {setting:11s} build failed: {first_line(str(exc))}", flush=True)
                continue
            from tokenizers import Tokenizer

            prompt = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT_TEXT).ids
            try:
                report = check_folder(
                    folder,
                    prompt,
                    max_new_tokens=args.max_new_tokens,
                    threads=args.threads,
                    hf_dir=hf_dir if precision == "fp32" else None,
                )
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                rows.append((spec.label, label, "?", "?", "check crashed (see the log)", 0.0))
                continue
            greedy, speculative, why = verdict(report)
            if spec.note and setting == "fp32":
                why = spec.note + ("; " + why if why else "")
            rows.append((spec.label, label, greedy, speculative, why, report.drift))
            print(
                f"{arch:17s} {setting:11s} {time.perf_counter() - t0:5.1f}s  greedy: {greedy} | speculative: "
                f"{speculative} | {why}",
                flush=True,
            )
    write_markdown(args, rows, time.perf_counter() - started)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f}s)")
    return 0


def write_markdown(args: argparse.Namespace, rows: list, seconds: float) -> None:
    import onnxruntime
    import onnxruntime_genai
    import transformers

    lines = [
        "# Architectures x precisions",
        "",
        "Written by `python scripts/arch_matrix.py` (do not edit by hand) on "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or platform.platform()}, "
        f"{args.threads} thread(s); onnxruntime {onnxruntime.__version__}, onnxruntime-genai "
        f"{onnxruntime_genai.__version__}, transformers {transformers.__version__}; {seconds:.0f} s.",
        "",
        f"Tiny random-weight models (hidden size {args.hidden}) built from each architecture's transformers config "
        "by the onnxruntime-genai builder (`ortspec.adapters.architectures`), checked by "
        "`ortspec.adapters.conformance.check_folder` with a 75-token prompt and up to "
        f"{args.max_new_tokens} new tokens. **greedy**: ortspec's greedy output, compared with ONNX Runtime "
        "GenAI's greedy search on the same folder (matching tokens / tokens). **speculative**: *exact* when "
        "speculative output equalled greedy output with drafts replaying the greedy continuation (all right; "
        "every third wrong) and with prompt lookup, and a verify pass drifts at most "
        f"{DRIFT_WARNING_THRESHOLD:g} logits from one-token decodes; *not guaranteed* when the outputs matched "
        "here but the drift is larger (other prompts can differ). Level 1 / level 4: the MatMulNBits "
        "`accuracy_level` the folder was built with (4: int8 activations, the builder's CPU default; 1: float32 "
        "compute, what `ortspec convert --precision int4|int8` builds; `matmul_accuracy_level=1` sets it at "
        "load). *drift*: the largest |logit| difference between verify passes (7 tokens) and one-token decodes "
        "along the greedy continuation.",
        "",
        "| architecture | precision | greedy | speculative | drift | notes / why not |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    for arch, label, greedy, speculative, why, drift in rows:
        drift_cell = "" if drift is None or greedy == "no" else f"{drift:.1e}"
        lines.append(f"| {arch} | {label} | {greedy} | {speculative} | {drift_cell} | {why.replace('|', '/')} |")
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
