"""From the shared options a command parsed (:mod:`ortspec.adapters.cli.options`) to what it runs: the model
folder (the default model is converted on first use), the Engine, the proposer, the generation keywords, and the
one-line statistics a command prints for a result."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ortspec.adapters.engine.options import speculative_value
from ortspec.adapters.engine.surfaces import SAMPLING_OPTIONS, flag_values
from ortspec.core import MAX_DRAFT, PromptLookup


def model_dir(args: argparse.Namespace) -> Path:
    """``--model``, or the default model's folder, converted now (progress on stderr) if it is not yet."""
    from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete

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


def backend_config(args: argparse.Namespace, *, threads: int | None):
    """The ``BackendConfig`` the ``model`` option group describes (the one place a command builds one), with
    ``threads`` intra-op threads (None: the backend's default). ``ValueError`` names the flag for a bad
    combination (``--cuda-graphs`` without ``--provider cuda``)."""
    from ortspec.backends.onnx import BackendConfig

    return BackendConfig(
        provider=args.provider,
        threads=threads,
        max_length=args.max_length,
        static_shapes=args.static_shapes,
        cuda_graphs=args.cuda_graphs,
        sliding_window=getattr(args, "sliding_window", "config"),
        matmul_accuracy_level=getattr(args, "matmul_accuracy_level", None),
    )


def engine(args: argparse.Namespace):
    """The Engine the ``model`` option group describes."""
    from ortspec.adapters.engine import Engine

    config = backend_config(args, threads=args.threads)
    return Engine.from_dir(
        model_dir(args),
        config,
        drafter=drafter(args),
        draft_model=draft_model(args),
        tree_branches=args.tree_branches,
    )


def drafter(args: argparse.Namespace) -> str | bool | None:
    """``--drafter``: a folder, ``False`` for ``none``, or None (the one found for the model, if any)."""
    return False if args.drafter == "none" else args.drafter


def draft_model(args: argparse.Namespace) -> str | None:
    """``--draft-model``: a draft model folder, or None (none)."""
    return getattr(args, "draft_model", None)


def speculative(args: argparse.Namespace):
    """``--speculative`` as the Engine takes it: the name itself (``core.speculative``'s one table, resolved by the
    Engine as on every other surface; ``none`` is None), or, with prompt lookup's own settings (``--ngram``,
    ``--min-ngram``, ``--max-draft``), a ``PromptLookup`` with them. ``ValueError`` for those settings with another
    name."""
    name = speculative_value(args.speculative)
    lookup = {k: v for k in ("ngram", "min_ngram", "max_draft") if (v := getattr(args, k, None)) is not None}
    if not lookup:
        return name
    if name != "prompt-lookup":
        flags = ", ".join("--" + k.replace("_", "-") for k in lookup)
        raise ValueError(f"{flags}: prompt lookup's settings need --speculative prompt-lookup (got {args.speculative})")
    return PromptLookup(**{"ngram": 3, "max_draft": MAX_DRAFT, "min_ngram": 1, **lookup})


def generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine's generation keywords from the ``generation``, ``speculation`` and ``sampling`` groups."""
    return dict(
        max_tokens=args.max_tokens,
        stop=args.stop or None,
        chat=args.chat,
        draft_width=args.draft_width,
        tie_margin=args.tie_margin,
        ignore_eos=args.ignore_eos,
        **flag_values(args, (*SAMPLING_OPTIONS, "response_format", "tools", "tool_choice")),
    )


def stats_line(result, label: str) -> str:
    """One line about a ``GenerateResult``: tokens, time, speeds, first token, passes, finish, acceptance, seed."""
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
