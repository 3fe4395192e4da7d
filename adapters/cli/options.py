"""What the ``ortspec`` commands share on the parser side: the argument types (checked ints, floats, widths,
ports; each refuses a bad value at parse time with a message that says what was expected), the option groups
(model, speculation, generation and sampling), the subcommand constructor, and the one table that turns the
Python names in an Engine or core error back into the flags the user typed (:func:`speak_flags`).

A command module declares its own options and calls the groups here for the shared ones; no flag is declared twice.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from ortspec.adapters.engine.options import DEFAULT_SPECULATIVE, SPECULATIVE_CHOICES, GenerationOptions
from ortspec.adapters.engine.surfaces import SAMPLING_OPTIONS, add_flags, flag
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET
from ortspec.core import MAX_DRAFT, options_of

# -- argument types --------------------------------------------------------------------------------------------


def int_in(text: str, low: int, high: int | None = None, expected: str | None = None) -> int:
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


def width(text: str) -> int | str:
    """A draft width: ``auto`` or an int >= 1."""
    return text if text == "auto" else int_in(text, 1, expected="'auto' or an int >= 1")


def positive_int(text: str) -> int:
    return int_in(text, 1)


def nonnegative_int(text: str) -> int:
    return int_in(text, 0)


def port(text: str) -> int:
    return int_in(text, 0, 65535, expected="a port number 0-65535 (0: any free port)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def margin(text: str) -> float:
    """A tie margin in logits: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (logits), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (logits), got {text!r}")
    return value


def margins(text: str) -> list[float]:
    """Comma-separated tie margins (``bench``)."""
    return [margin(part.strip()) for part in text.split(",")]


def prefill_budget(text: str) -> int | None:
    """A batched pass's prompt-token budget: ``none`` (unbounded) or an int >= 1."""
    return None if text == "none" else int_in(text, 1, expected="'none' or an int >= 1")


def stop_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


# -- flags in error messages -----------------------------------------------------------------------------------

# Python keyword and option names that can appear in an error message -> the flag the user typed.
# Option names that are also plain words ("a stop string", "a chat template") are not replaced inside prose; a
# message about ``stop`` starts with it (speak_flags).
_PLAIN_WORDS = frozenset({"stop", "chat", "system", "speculative"})

FLAGS = {
    **{f.name: flag(f.name) for f, _ in options_of(GenerationOptions) if f.name not in _PLAIN_WORDS},
    "max_length": "--max-length",
    "max_context": "--max-length",
    "threads": "--threads",
    "min_ngram": "--min-ngram",
    "ngram": "--ngram",
    "max_draft": "--max-draft",
    "provider": "--provider",
    "static_shapes": "--static-shapes",
    "cuda_graphs": "--cuda-graphs",
    "prefill_budget": "--prefill-budget",
}
_FLAG_WORDS = re.compile(r"\b(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")\b")


def speak_flags(message: str) -> str:
    """``message`` with the Python names of options replaced by the command-line flags that set them (an error
    from the Engine or the core about ``max_new_tokens`` is about ``--max-tokens`` here); a message about ``stop``
    is about ``--stop``."""
    message = _FLAG_WORDS.sub(lambda m: FLAGS[m.group(1)], message)
    return re.sub(r"^stop\b", "--stop", message)


# -- subcommands and option groups -----------------------------------------------------------------------------


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks (the examples)."""


def add_command(sub: Any, name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand parser of ``sub`` (the ``ortspec`` parser's subparsers) whose epilog keeps its line breaks."""
    return sub.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=_HelpFormatter)


def model_options(
    p: argparse.ArgumentParser,
    threads_help: str = "intra-op threads (default: physical cores)",
    load_rewrites: bool = True,
    drafter: bool = False,
) -> None:
    """The ``model`` group: ``--model``, ``--provider``, ``--threads``, ``--max-length``, the fast CUDA path's
    ``--static-shapes`` and ``--cuda-graphs``; with ``load_rewrites``
    also ``--matmul-accuracy-level`` and ``--sliding-window``, and with ``drafter`` (only then) ``--drafter``,
    ``--draft-model`` and ``--tree-branches``."""
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
        type=positive_int,
        default=None,
        metavar="N",
        help=threads_help,
    )
    g.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="KV capacity in tokens: prompt + output (default: the model's context length; for each slot of a "
        "batched engine, at most 2048)",
    )
    g.add_argument(
        "--static-shapes",
        action="store_true",
        help="bind every pass at fixed shapes (the fast CUDA path's binding; see docs/gpu.md)",
    )
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --provider cuda: capture one CUDA graph per pass width and replay it (implies --static-shapes)",
    )
    if drafter:
        g.add_argument(
            "--drafter",
            metavar="DIR|none",
            default=None,
            help="shared-KV drafter folder (default: the one found for the model: its own, the one `ortspec "
            "train-drafter` made, or the one shipped for it, if any); none = no drafter",
        )
        g.add_argument(
            "--draft-model",
            metavar="DIR",
            default=None,
            help="a smaller model folder of the same vocabulary to draft with (--speculative draft-model; its "
            "tokenizer must map every token to the same id)",
        )
        g.add_argument(
            "--tree-branches",
            type=positive_int,
            default=1,
            metavar="N",
            help="draft token trees of up to N candidates at a point, from the suffix lookup's matches and the "
            "drafter's runner-up tokens, each verified in one pass where its price pays (default 1: chains; "
            "docs/tree-attention.md); the output is the same either way",
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


def default_proposer_option(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--speculative`` of the commands that run many requests (``serve``, ``batch``): their default proposer,
    ``DEFAULT_SPECULATIVE`` (every surface's) unless it says otherwise."""
    g.add_argument(
        "--speculative",
        default=DEFAULT_SPECULATIVE,
        choices=(*SPECULATIVE_CHOICES, "none"),
        help="default proposer (default %(default)s); prompt-lookup = the request's own context only; suffix = "
        "the context and the Engine's earlier outputs; auto = per draft, the suffix lookup or the shared-KV "
        "drafter; shared-kv = the drafter alone (needs one: --drafter); draft-model = the draft model (needs one: "
        "--draft-model); none = plain decoding",
    )


def prefill_budget_option(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--prefill-budget`` (``ortspec serve``, ``ortspec batch``): the batched Engine's ``prefill_budget``."""
    p.add_argument(
        "--prefill-budget",
        type=prefill_budget,
        default=DEFAULT_PREFILL_BUDGET,
        metavar="N|none",
        help="batched: the most prompt tokens one pass folds in, over every prompt being prefilled, first come "
        "first (default %(default)s); none: every prompt's next chunk in the same pass",
    )


def lookup_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``speculation`` group: prompt lookup's ``--ngram``, ``--min-ngram``, ``--max-draft`` and the
    ``--draft-width``; returned so a command can add its own speculation flags to it."""
    d = p.add_argument_group("speculation")
    d.add_argument(
        "--ngram", type=positive_int, default=None, metavar="N",
        help="with --speculative prompt-lookup: longest suffix matched (default 3)",
    )  # fmt: skip
    d.add_argument(
        "--min-ngram", type=positive_int, default=None, metavar="N",
        help="with --speculative prompt-lookup: shortest suffix tried (default 1)",
    )  # fmt: skip
    d.add_argument(
        "--max-draft", type=positive_int, default=None, metavar="N",
        help=f"with --speculative prompt-lookup: most tokens proposed (default {MAX_DRAFT})",
    )  # fmt: skip
    d.add_argument(
        "--draft-width",
        type=width,
        default="auto",
        metavar="auto|N",
        help="draft tokens verified per pass: N >= 1, or auto (default): the cost-aware policy on this machine's "
        "measured verify cost curve",
    )
    return d


def generation_options(p: argparse.ArgumentParser, default_tokens: int = 128, margins_list: bool = False) -> None:
    """The ``generation``, ``speculation`` and ``sampling`` groups of ``demo``, ``generate`` and ``bench``.
    ``margins_list``: ``--tie-margin`` takes a comma-separated list (``bench``: one run per margin)."""
    g = p.add_argument_group("generation")
    g.add_argument(
        "--max-tokens", type=positive_int, default=default_tokens, metavar="N",
        help="most new tokens (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--stop", action="append", type=stop_text, metavar="TEXT",
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
        default=DEFAULT_SPECULATIVE,
        choices=(*SPECULATIVE_CHOICES, "none"),
        help="draft proposer: auto (default) = per draft, the suffix lookup or the shared-KV drafter, whichever "
        "has earned more (the suffix lookup alone without a drafter); prompt-lookup = 3-gram lookup in the context; "
        "shared-kv = the drafter alone; draft-model = the draft model (--draft-model); suffix = the longest "
        "suffix match in the context and the Engine's earlier outputs; none = plain decoding. The output is the "
        "same either way",
    )
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")
    # --response-format JSON (structured outputs); --tools JSON, --tool-choice CHOICE (function calling, with --chat)
    add_flags(g, ("response_format", "tools", "tool_choice"))
    d = lookup_options(p)
    if margins_list:
        d.add_argument(
            "--tie-margin",
            type=margins,
            default=[0.0, 0.05],
            metavar="M[,M...]",
            help="near-tie guard margins in logits: one speculative run per margin, each checked against greedy "
            "(default 0,0.05; 0 = off)",
        )
    else:
        d.add_argument(
            "--tie-margin",
            type=margin,
            default=0.0,
            metavar="M",
            help="near-tie guard: do not accept a verified pick whose top-2 logit gap is below M (default 0 = off)",
        )
    _sampling_options(p)


def _sampling_options(p: argparse.ArgumentParser) -> None:
    """The ``sampling`` group: one flag per sampling option, built from its declaration (``core/sampling.py``)."""
    s = p.add_argument_group(
        "sampling", "exact seeded sampling: with the same --seed, speculative output equals plain output"
    )
    add_flags(s, SAMPLING_OPTIONS)
