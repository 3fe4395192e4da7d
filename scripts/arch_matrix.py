"""Every architecture the onnxruntime-genai 0.18 builder writes, at every precision, through ortspec.

    python scripts/arch_matrix.py                      # the whole matrix (31 s on 2 cores, builds included)
    python scripts/arch_matrix.py --archs llama,lfm2 --settings fp32,int4 --out /tmp/m.md

For each architecture of ``tests.support.architectures.ARCHITECTURES`` it builds a tiny random-weight model
(hidden size 256, so that the quantized MatMulNBits kernels take the same paths as real models'; built once and
cached under ``~/.cache/ortspec/arch/``) at each precision, and for each setting runs
``tests.support.conformance.check_folder``: the folder loads as is, greedy equals ONNX Runtime GenAI's greedy
search on the same folder (and, for fp32, transformers' greedy decoding of the checkpoint it came from),
speculative decoding equals greedy decoding (drafts replaying the greedy continuation, all right and every third
wrong, and prompt lookup), and the verify drift. A setting is *exact* when every speculative run equals greedy
and the verify passes along the greedy continuation drift at most ``Engine``'s warning threshold (1e-3 logits)
from one-token decodes. It writes ``docs/architectures.md``, and a whole-matrix run (the default arguments) also
writes its summary table into README.md; it prints each row as it goes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from pathlib import Path

import attrs

sys.path.append(str(Path(__file__).resolve().parent.parent))  # the repository root, for tests.support

from ortspec.adapters.engine.cache import cache_root
from ortspec.adapters.engine.options import DRIFT_WARNING_THRESHOLD
from tests.support.architectures import ARCHITECTURES, make_tiny_arch_model
from tests.support.conformance import FolderReport, check_folder

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "architectures.md"
README = ROOT / "README.md"
# the README's copy of the summary table sits between these lines (tests/test_architectures.py compares the two)
README_BEGIN = "<!-- scripts/arch_matrix.py writes this table -->"
README_END = "<!-- end of the table -->"
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
    """The useful line of an error: onnxruntime's "Status Message: ..." when there is one, else the first line."""
    text = text.strip()
    if "Status Message:" in text:
        text = text.split("Status Message:", 1)[1].strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


@attrs.frozen
class Row:
    """One line of the table: the cells, and the short verdicts for the summary table."""

    arch: str
    setting: str
    label: str
    greedy: str
    speculative: str
    drift: float | None
    why: str
    greedy_ok: bool
    spec_state: str  # "exact", "drift", "no"
    cuda_only: bool = False  # refused because an operator's CPU kernel lacks a feature the CUDA one has


def verdict(arch: str, setting: str, label: str, report: FolderReport) -> Row:
    """The table row for one report. Speculation is *exact* when every speculative run equalled greedy, the
    drift along the greedy continuation is at most the warning threshold, and no MatMulNBits node runs at level 4
    (int8 activations: batch-dependent, so a clean run on one prompt proves nothing for others)."""
    if report.load_error or report.run_error:
        what = "load" if report.load_error else "run"
        error = report.load_error or report.run_error or ""
        why = f"{what}: " + first_line(error)
        return Row(arch, setting, label, "no", "no", None, why, False, "no", cuda_only="only on the CUDA" in error)
    notes = []
    if report.genai_agree is not None:
        agree, total = report.genai_agree
        greedy = (
            f"yes, = ORT GenAI ({agree}/{total})" if agree == total else f"yes; ORT GenAI differs at {agree}/{total}"
        )
        if agree != total and 4 in report.matmul_levels:
            notes.append("level-4 kernels are batch-dependent and ORT GenAI's passes differ from ortspec's here")
    else:
        greedy = "yes; ORT GenAI fails on this folder"
        notes.append("ORT GenAI: " + first_line(report.genai_error or "", 110))
    if report.hf_agree is not None and report.hf_agree[0] != report.hf_agree[1]:
        notes.append(f"the graph differs from transformers (greedy agrees {report.hf_agree[0]}/{report.hf_agree[1]})")
    drift = report.drift if report.drift is not None else float("nan")
    identical = bool(report.speculative_exact)
    level4 = 4 in report.matmul_levels
    if identical and drift <= DRIFT_WARNING_THRESHOLD and not level4:
        spec, state = "exact", "exact"
    elif identical:
        spec, state = "= greedy here, not guaranteed", "drift"
    else:
        wrong = [run.proposer for run in report.speculative if not run.identical]
        spec, state = "differs from greedy", "drift"
        notes.append("speculative != greedy with drafts from: " + " / ".join(wrong))
    if level4:
        notes.append("MatMulNBits level 4 (int8 activations): verify passes round differently from decodes")
    elif drift > DRIFT_WARNING_THRESHOLD and setting == "fp16":
        notes.append("float16 kernels: verify passes round differently from decodes")
    if report.rewrites:
        notes.append("load-time rewrite: " + "; ".join(sorted({r.split(" on ")[0] for r in report.rewrites})))
    if report.stateful:
        notes.append("recurrent state: snapshot and replay on rewind")
    return Row(arch, setting, label, greedy, spec, report.drift, "; ".join(notes), True, state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHITECTURES), help="comma-separated (default: all)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated of {list(SETTINGS)}")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny models (default 256)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/ortspec/arch)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.split(",") if a]
    settings = [s for s in args.settings.split(",") if s]
    unknown = [a for a in archs if a not in ARCHITECTURES] + [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown architectures or settings: {unknown}")
    cache = (args.cache or cache_root() / "arch") / f"h{args.hidden}"
    started = time.perf_counter()
    rows: list[Row] = []
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
                why = "build: " + first_line(str(exc))
                rows.append(Row(spec.label, setting, label, "no", "no", None, why, False, "no"))
                print(f"{arch:17s} {setting:8s} {why}", flush=True)
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
                rows.append(Row(spec.label, setting, label, "?", "?", None, "check crashed", False, "no"))
                continue
            row = verdict(spec.label, setting, label, report)
            if spec.note and setting == "fp32":
                row = attrs.evolve(row, why=spec.note + ("; " + row.why if row.why else ""))
            rows.append(row)
            print(
                f"{arch:17s} {setting:8s} {time.perf_counter() - t0:5.1f}s  greedy: {row.greedy} | speculative: "
                f"{row.speculative} | drift {row.drift} | {row.why}",
                flush=True,
            )
    write_markdown(args, rows, time.perf_counter() - started)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f}s)")
    if args.out == DEFAULT_OUT and archs == list(ARCHITECTURES) and settings == list(SETTINGS):
        update_readme(summary_table(rows, settings), time.strftime("%Y-%m-%d"))
        print(f"updated the table in {README}")
    return 0


def update_readme(table: list[str], date: str) -> None:
    """Put the summary table of a whole-matrix run between the README's markers (only a whole run does)."""
    text = README.read_text(encoding="utf-8")
    head, rest = text.split(README_BEGIN, 1)
    _old, tail = rest.split(README_END, 1)
    body = [f"Measured by `python scripts/arch_matrix.py` on {date} (greedy / speculative):", "", *table]
    README.write_text(head + README_BEGIN + "\n" + "\n".join(body) + "\n" + README_END + tail, encoding="utf-8")


SUMMARY_CELLS = {"exact": "yes / exact", "drift": "yes / not exact", "no": "no"}


def summary_table(rows: list[Row], settings: list[str]) -> list[str]:
    """Architecture x setting: greedy / speculative, one cell each (the README copies this table)."""
    lines = [
        "| architecture | " + " | ".join(SETTINGS[s][2] for s in settings) + " |",
        "| --- |" + " --- |" * len(settings),
    ]
    by_arch: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_arch.setdefault(row.arch, {})[row.setting] = row

    def cell(row: Row) -> str:
        if row.spec_state != "no":
            return SUMMARY_CELLS[row.spec_state]
        if row.cuda_only:
            return "no: a CUDA-only operator feature"
        return "no (see details)"

    for arch, cells in by_arch.items():
        lines.append(f"| {arch} | " + " | ".join(cell(cells[s]) if s in cells else "" for s in settings) + " |")
    return lines


def write_markdown(args: argparse.Namespace, rows: list[Row], seconds: float) -> None:
    import onnxruntime
    import onnxruntime_genai
    import transformers

    settings = [s for s in SETTINGS if any(row.setting == s for row in rows)]
    lines = [
        "# Architectures x precisions",
        "",
        "Written by `python scripts/arch_matrix.py` (do not edit by hand) on "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or platform.platform()}, "
        f"{args.threads} thread(s); onnxruntime {onnxruntime.__version__}, onnxruntime-genai "
        f"{onnxruntime_genai.__version__}, transformers {transformers.__version__}; {seconds:.0f} s.",
        "",
        f"Tiny random-weight models (hidden size {args.hidden}) built from each architecture's transformers config "
        "by the onnxruntime-genai builder (`tests.support.architectures`), checked by "
        "`tests.support.conformance.check_folder` with a prompt of about 75 tokens and up to "
        f"{args.max_new_tokens} new tokens.",
        "",
        "* **greedy**: ortspec serves the folder as the builder wrote it, and its greedy output is compared with "
        "ONNX Runtime GenAI's greedy search on the same folder (matching tokens / tokens).",
        "* **speculative**: *exact* when speculative output equalled greedy output with drafts replaying the greedy "
        "continuation (all right; every third wrong) and with prompt lookup, verify passes (7 tokens) along the "
        f"greedy continuation drift at most {DRIFT_WARNING_THRESHOLD:g} logits from one-token decodes, and no "
        "MatMulNBits node runs at accuracy level 4; *= greedy here, not guaranteed* when the outputs matched on "
        "this prompt but one of those does not hold (other prompts can differ: on SmolLM2-135M level 4 drifts "
        "0.7 logits, see [bench/quantization-settings.md](bench/quantization-settings.md)).",
        "* **level 4 / level 1**: the MatMulNBits `accuracy_level` the folder was built with (4: int8 activations, "
        "the builder's CPU default; 1: float32 compute, what `ortspec convert --precision int4|int8` builds; "
        "`matmul_accuracy_level=1` sets it at load). **fp16**: the builder's CUDA float16 target, run here on the "
        "CPU execution provider.",
        "",
        "## Summary: greedy / speculative",
        "",
        *summary_table(rows, settings),
        "",
        "## Details",
        "",
        "| architecture | precision | greedy | speculative | drift | notes / why not |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    for row in rows:
        drift_cell = "" if row.drift is None else f"{row.drift:.1e}"
        why = row.why.replace("|", "/")
        lines.append(f"| {row.arch} | {row.label} | {row.greedy} | {row.speculative} | {drift_cell} | {why} |")
    lines.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
