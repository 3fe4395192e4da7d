"""The side-by-side benchmark: ortspec (greedy, speculative, sampled) against ONNX Runtime GenAI and onnx_genai.

``python -m bench.suite`` regenerates everything: it runs every engine on the same model folder, the same
prompts (as the same token ids) and the same thread count, interleaved prompt by prompt, and writes

* ``docs/bench/results-<precision>.json``: everything (machine, versions, workloads digest, every run),
* ``docs/bench/results-<precision>.md``: tables per category, ratios, the verify cost curve, memory
  bandwidth and the achieved fraction of it, the driver overhead,
* ``docs/bench/tokens_per_second-<precision>.png``: tokens/s by engine and category.

Engines (``--engines``, comma separated):

``ortspec-greedy``            ``Engine.generate(ids, speculative=None)``
``ortspec-lookup-w8``         ``PromptLookup(ngram=3, max_draft=8)``, ``draft_width=8``
``ortspec-lookup-w4``         the same proposer, ``draft_width=4``
``ortspec-lookup-adaptive``   ``PromptLookup(ngram=3, max_draft=16)``, ``CostAwareWidth(pass_costs=curve)``
                              where ``curve`` is the verify cost curve measured in this run (K = 0..16)
``ortspec-lookup-additive``   ``PromptLookup(ngram=3, max_draft=16)``, ``AdditiveWidth()`` (+2 / -1, 1..16)
``ortspec-suffix``            ``speculative="suffix"``, ``draft_width="auto"``: the suffix lookup (the context and
                              this setting's own suffix cache of its earlier outputs in this run)
``ortspec-shared-kv``         ``speculative="shared-kv"``, ``draft_width="auto"``: the Engine's drafter alone
``ortspec-auto``              ``speculative="auto"``, ``draft_width="auto"``: per draft, the suffix lookup or the
                              drafter (what ``ortspec demo`` / ``generate`` use by default)
``ortspec-sampled``           ``ortspec-greedy`` sampling: temperature 0.7, top_p 0.9, the prompt's seed
``ortspec-lookup-adaptive-sampled``  ``ortspec-lookup-adaptive`` sampling the same way, at the same seed
``ortspec-auto-sampled``      ``ortspec-auto`` sampling the same way, at the same seed
``ortgenai``                  ONNX Runtime GenAI greedy
``ortgenai-ngram``            ONNX Runtime GenAI n-gram speculation (``--ngram SIZE,DRAFT``, default 3,8)
``ortgenai-draft-model``      ONNX Runtime GenAI draft-model speculation: the ``--draft-model`` folder drafts
                              (``model.draft`` in an overlay of the model folder; ``--genai-draft-tokens K``,
                              default 4; ``bench.genai_draft_model``); missing without ``--draft-model``
``onnx_genai``                onnx_genai greedy, a fresh engine per run (no prefix-cache hits)
``ortgenai-sampled``          ONNX Runtime GenAI sampling (do_sample, temperature 0.7, top_p 0.9, top_k = the
                              vocabulary, i.e. no cut; random_seed = the prompt's seed)
``ortgenai-ngram-sampled``    the same with its n-gram speculation (the same ``--ngram``)
``llamacpp``                  llama.cpp greedy on the model's own Q4_1 GGUF (``bench.llamacpp``; optional: needs
                              ``llama-cpp-python``)

A peer that cannot be imported or loaded is listed under ``missing`` with the reason; nothing is faked.

Prompts (``--split``): each category's evaluation half by default (``bench.workloads.half``), so constants
chosen on the tuning half are reported on prompts they were not chosen on; ``--n-per-category`` counts the
prompts in the half.

Categories (``--categories``): the four of independent prompts (``bench.workloads.CATEGORIES``), and
``repetitive``, the repetitive stream (``bench.repetitive``): requests of three task shapes whose answers share
text that is not in the prompts, measured in order. Every ortspec setting keeps its own suffix cache across the
whole run (``OrtspecEngine.suffix_cache``: it learns from that setting's outputs only; warm-ups record nothing; a
prompt measured again starts from the cache its first run saw), so request ``i`` of the stream may draft from the
outputs of the requests before it, never from its own.

Layout: this module is the command line (``parse_args``, ``main``); ``bench.suite_config`` holds the run's
settings (``SuiteConfig``) and its prompts, ``bench.suite_runs`` the order of the measurements (``run``) and the
interleaved runs, ``bench.suite_measurements`` the machine's state, the verify cost curve, the drafter's step and
the driver overhead; ``bench.engines`` holds the engines under test, ``bench.report`` the summaries and the result
files, ``bench.limits`` the physical limits of a decode step.

Every engine gets the prompt as the token ids of ``bench.workloads.encode_chat`` (the chat rendered and encoded
by ortspec's ``Tokenizer``; ORT GenAI takes the ids; onnx_genai takes text only, so it gets the decoded ids, and
the suite checks that its own tokenizer turns that text back into exactly the same ids). Identity is token for
token against ``ortspec-greedy`` on the same prompt, after removing a final EOS token from both sides (the peers
drop it, ortspec keeps it); new-token counts exclude that EOS for every engine.

Sampled column: every sampled engine gets the prompt's seed (``bench.engines.prompt_seed``, from the workload's
name; all seeds are recorded under ``sampling`` in the results). Identity of a sampled setting is checked against
the plain sampled run of its own family on the same prompt and seed: ``ortspec-lookup-adaptive-sampled`` against
``ortspec-sampled`` (ortspec's exactness claim), ``ortgenai-ngram-sampled`` against ``ortgenai-sampled`` (reported
as a fact about ORT GenAI). ORT GenAI's RNG is not ortspec's, so its sampled tokens differ from ortspec's at the
same seed: that is expected and never checked. The report's sampled section prices sampled speculation against
plain sampling and against ORT GenAI's sampled n-gram speculation, with the issue's targets.

Timing, for every engine: the clock starts with the prompt ids in hand; ``ttft`` is the time to the first new
token (prefill included); ``tok/s e2e`` = new tokens / total time; ``decode tok/s`` = (new - 1) / (total -
ttft) (``ortspec.driver.decode_rate``). Per engine and category the tables show medians over prompts (each
prompt's value being the median over ``--repeat`` runs). Ratios are medians of per-prompt ratios (the engines
ran back to back on each prompt, so the pairs share the machine's state). ``CpuContention`` is recorded around
every run; a run during which other processes used more than ``--contention-threshold`` cores on average is
flagged ``disturbed``.

``--quick`` checks that the suite works (not speed): a tiny random-weight model made on the fly, with a random
shared-KV drafter beside it (so the drafter settings run; their drafts are mostly wrong), 2 prompts per category,
16 new tokens, results in ``--out`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.engines import ALL_ENGINES, DEFAULT_GENAI_DRAFT_TOKENS, DEFAULT_NGRAM
from bench.report import round_float
from bench.suite_config import SuiteConfig
from bench.suite_runs import run
from bench.workloads import SPLITS, SUITE_CATEGORIES

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"

# --quick: what it changes unless the option is given explicitly
QUICK_DEFAULTS = {
    "max_new_tokens": 16,
    "cost_repeat": 3,
    "overhead_prompts": 1,
    "max_prompt_tokens": 400,
    "wait_quiet": 0.0,
    "retry_disturbed": 0,
}


def _ngram_setting(text: str) -> tuple[int, int]:
    """``SIZE,DRAFT`` as two positive ints; ``argparse.ArgumentTypeError`` naming the problem otherwise."""
    try:
        size, draft = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIZE,DRAFT (two integers), got {text!r}") from None
    if size < 1 or draft < 1:
        raise argparse.ArgumentTypeError(f"ngram size and draft length must be >= 1, got {text!r}")
    return size, draft


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="model folder (default: the cached SmolLM2 folder of --precision)")
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8"),
        help="picks the default cached folder and names the output files (default fp32; int8 is built at the "
        "builder's default MatMulNBits accuracy level 4, as in the committed results)",
    )
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine (default 2)")
    ap.add_argument("--categories", default=",".join(SUITE_CATEGORIES))
    ap.add_argument(
        "--split",
        choices=(*SPLITS, "all"),
        default="evaluation",
        help="the prompts' half: tuning (to choose constants on), evaluation (to report; the default), or all",
    )
    ap.add_argument("--n-per-category", type=int, default=8, help="prompts per category (in the chosen half)")
    ap.add_argument(
        "--ngram",
        type=_ngram_setting,
        default=DEFAULT_NGRAM,
        help="the ORT GenAI n-gram peers' setting SIZE,DRAFT (ngram_size, max_draft_tokens; default "
        f"{DEFAULT_NGRAM[0]},{DEFAULT_NGRAM[1]}; python -m bench.ngram_grid chooses one on the tuning split)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma-separated engine names")
    ap.add_argument("--repeat", type=int, default=1, help="runs per prompt and engine (default 1)")
    ap.add_argument("--cost-repeat", type=int, default=15, help="samples per verify cost point (default 15)")
    ap.add_argument(
        "--cost-attempts",
        type=int,
        default=3,
        help="re-measure the cost curve up to this many times while it is disturbed (default 3)",
    )
    ap.add_argument(
        "--overhead-prompts",
        type=int,
        default=2,
        help="prompts per category for the driver-overhead runs (0 = skip; default 2)",
    )
    ap.add_argument(
        "--contention-threshold",
        type=float,
        default=0.3,
        help="a run is flagged disturbed when other processes used more cores than this on average",
    )
    ap.add_argument(
        "--retry-disturbed",
        type=int,
        default=1,
        help="re-run a prompt's whole engine group up to N times while any of its runs is disturbed",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=30.0,
        help="before each prompt's engine group (and the cost curve), wait up to this many seconds for "
        "other processes to use fewer than --contention-threshold cores (default 30; 0 = never)",
    )
    ap.add_argument("--max-length", type=int, default=None, help="ortspec KV capacity (default: the model's)")
    ap.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="a model folder of the same vocabulary: the draft-model settings (ortspec-draft-model, "
        "ortspec-auto-draft-model) run on a second Engine that drafts with it",
    )
    ap.add_argument(
        "--genai-draft-tokens",
        type=int,
        choices=range(1, 17),
        default=DEFAULT_GENAI_DRAFT_TOKENS,
        metavar="K",
        help="ortgenai-draft-model's draft length (ORT GenAI's max_draft_tokens, 1..16; default "
        f"{DEFAULT_GENAI_DRAFT_TOKENS}, GenAI's own)",
    )
    ap.add_argument("--out", help="output folder (default docs/bench/; --quick: a temporary folder)")
    ap.add_argument("--label", help="names the output files (default: --precision, or 'quick')")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="check the suite works on a tiny random model: 2 prompts/category, 16 tokens",
    )
    ap.add_argument("--no-progress", action="store_true")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    given = list(argv or [])
    if args.quick:
        args.n_per_category = min(args.n_per_category, 2) if "--n-per-category" in given else 2
        for key, value in QUICK_DEFAULTS.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    return args


def _resolve_model(args: argparse.Namespace, workdir: Path) -> Path:
    if args.quick and not args.model_dir:
        from tests.support.drafters import make_random_drafter
        from tests.support.models import make_tiny_model

        model = Path(make_tiny_model(workdir / "tiny-model", context=1024))
        # a random shared-KV drafter beside it (Engine.from_dir finds <model>/drafter), so the drafter settings run
        make_random_drafter(model, model / "drafter", seed=0)
        if not args.draft_model:  # and the model drafts for itself (the same vocabulary), so the draft model's run
            args.draft_model = str(model)
        return model
    if args.model_dir:
        return Path(args.model_dir).expanduser().resolve()
    from ortspec.adapters.tools.convert import BUILDER_ACCURACY_LEVEL, convert_smollm2, default_model_dir, is_complete

    # int8 as ONNX Runtime GenAI users run it: the builder's default MatMulNBits level (4), as in the committed
    # results (ortspec convert builds level 1, the exact one; see docs/bench/quantization-settings.md)
    level = BUILDER_ACCURACY_LEVEL if args.precision == "int8" else None
    folder = default_model_dir(args.precision, level)
    if not is_complete(folder):
        print(f"bench.suite: converting the {args.precision} model into {folder} (first use)", file=sys.stderr)
        convert_smollm2(folder, args.precision, accuracy_level=level)
    return folder


@contextlib.contextmanager
def _workspace(args: argparse.Namespace) -> Iterator[tuple[Path, Path]]:
    """(scratch folder, output folder): with --quick a temporary folder, removed at exit, which also holds the
    output unless --out says otherwise."""
    with tempfile.TemporaryDirectory(prefix="ortspec-suite-") if args.quick else contextlib.nullcontext() as tmp:
        workdir = Path(tmp) if tmp else Path(tempfile.gettempdir())
        out_dir = Path(args.out) if args.out else (workdir / "out" if args.quick else DEFAULT_OUT)
        if args.quick and not args.out:
            print(f"bench.suite: --quick without --out writes into {out_dir} (removed at exit)", file=sys.stderr)
        out_dir.mkdir(parents=True, exist_ok=True)
        yield workdir, out_dir


def run_suite(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    with _workspace(args) as (workdir, out_dir):
        model_dir = _resolve_model(args, workdir)
        cfg = SuiteConfig.from_args(args, argv, model_dir=model_dir, workdir=workdir, out_dir=out_dir)
        result = run(cfg)
        if args.quick and not args.out:
            print(json.dumps(_headline(result), indent=2))
        return result


def _headline(result: dict[str, Any]) -> dict[str, Any]:
    t = result["summary"]["table"]
    return {cat: {e: round_float(v.get("e2e_tok_s"), 1) for e, v in rows.items()} for cat, rows in t.items()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run_suite(args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
