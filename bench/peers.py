"""Runners for the peer engines ortspec is compared against, each optional.

Every runner has the same interface::

    runner.run(prompt, max_new_tokens, seed=None) -> PeerRun

where ``prompt`` is the rendered prompt text or its token ids (a list of ints),
``seed`` the sampler's seed (sampling runners only), and ``bench.peer_base.PeerRun`` holds
the new token ids, their text, time to first token, total time and decode-only
tokens/s. :func:`make_peer` returns ``(runner, None)`` or ``(None, reason)``
when a peer package cannot be imported or the model cannot be loaded: a missing
peer is reported as missing, never faked.

Peers (names accepted by :func:`make_peer`):

``ortgenai``
    ONNX Runtime GenAI (``onnxruntime_genai``) greedy search on the model folder.
``ortgenai-ngram``
    The same with its built-in n-gram (prompt lookup) speculation
    (``GeneratorParams.set_speculative_options(ngram_size=, max_draft_tokens=)``).
``ortgenai-sampled``, ``ortgenai-ngram-sampled``
    The same two, sampling (``do_sample=True``, ``temperature``, ``top_p``, ``top_k``,
    ``random_seed``: see ``bench.peer_ortgenai.OrtGenAIRunner``). ORT GenAI's RNG is not ortspec's:
    at the same seed they draw different tokens from the same distribution.
``ortgenai-draft-model``
    ``ortgenai`` with its draft-model speculation: a second model folder of the target's vocabulary drafts
    (``model.draft`` in an overlay of the folder; ``bench.genai_draft_model``).
``onnx_genai``
    ``onnx_genai.Engine`` greedy (``temperature=0``) on a patched copy of the folder
    whose symbolic KV-cache dimension is made concrete.
``llamacpp``
    llama.cpp (``llama-cpp-python``) greedy on the model's own GGUF, at its native precision
    (``bench.llamacpp``).

Timing is the same for all peers: the clock starts once the prompt (text or
ids) is in hand, ``ttft_s`` is the time until the first new token is available,
``total_s`` the time until generation ends, and ``decode_tok_s`` is
``ortspec.driver.decode_rate`` of them. Thread counts are pinned (intra-op
threads = ``threads``; sessions run sequentially). The end-of-sequence token is
not part of ``token_ids``/``new_tokens``; ``finish_reason`` is OpenAI's word, as
``FinishReason.openai`` gives it for ortspec: ``"stop"`` (EOS) or ``"length"``
(each runner turns its peer's own report into it).
Prompt text is tokenized and token ids are decoded with ortspec's ``Tokenizer``
for the model folder; its facts (EOS ids, graph file, head size) come from
``ModelFolder.load``.

The original model folder is never modified: configuration changes go into a
temporary or cache folder holding edited copies of the config files and hard
links to (or, across file systems, copies of) the other files.

Layout: this module is the list of peers, :func:`make_peer` and the command line smoke test
(``python -m bench.peers``); ``bench.peer_base`` holds what every runner shares (``PeerRun``, ``BatchRun``,
``PeerRunner``, the folder helpers), ``bench.peer_ortgenai`` the ONNX Runtime GenAI runner, ``bench.peer_onnx_genai``
the onnx_genai runner and its patched folder; ``bench.genai_draft_model`` and ``bench.llamacpp`` the other two peers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from bench.peer_base import PeerRunner
from bench.peer_onnx_genai import OnnxGenAIRunner
from bench.peer_ortgenai import OrtGenAIRunner
from ortspec.adapters.engine.tokenizer import Tokenizer

PEER_NAMES = (
    "ortgenai",
    "ortgenai-ngram",
    "onnx_genai",
    "ortgenai-sampled",
    "ortgenai-ngram-sampled",
    "llamacpp",
    "ortgenai-draft-model",
)
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9}  # the sampled peers' options unless given (the suite's)


# --------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------


def make_peer(
    name: str, model_dir: str | os.PathLike, threads: int = 2, **options
) -> tuple[PeerRunner | None, str | None]:
    """Build a peer runner, or return ``(None, reason)`` when it is unavailable.

    ``options`` go to the runner: ``ngram_size`` / ``max_draft_tokens`` for
    ``ortgenai-ngram`` and ``ortgenai-ngram-sampled`` (defaults 3 and 8),
    ``sampling`` for the sampled peers (default ``DEFAULT_SAMPLING``),
    ``fresh_engine`` / ``ttft`` / ``cache_root`` for ``onnx_genai``, ``draft_model`` (the draft folder; without
    it the peer is missing) / ``draft_tokens`` (default 4) for ``ortgenai-draft-model``.
    """
    if name not in PEER_NAMES:
        return None, f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}"
    module = {"onnx_genai": "onnx_genai", "llamacpp": "llama_cpp"}.get(name, "onnxruntime_genai")
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a broken native library
        return None, f"{module} is not importable: {type(exc).__name__}: {exc}"
    try:
        sampling = (options.get("sampling") or DEFAULT_SAMPLING) if name.endswith("-sampled") else None
        if name == "llamacpp":
            from bench.llamacpp import LlamaCppRunner

            return LlamaCppRunner(model_dir, threads=threads, gguf=options.get("gguf")), None
        if name in ("ortgenai", "ortgenai-sampled"):
            return OrtGenAIRunner(model_dir, threads=threads, sampling=sampling), None
        if name == "ortgenai-draft-model":
            from bench.genai_draft_model import draft_model_peer

            return draft_model_peer(model_dir, threads, options.get("draft_model"), options.get("draft_tokens"))
        if name in ("ortgenai-ngram", "ortgenai-ngram-sampled"):
            return OrtGenAIRunner(
                model_dir,
                threads=threads,
                ngram_size=options.get("ngram_size", 3),
                max_draft_tokens=options.get("max_draft_tokens", 8),
                sampling=sampling,
            ), None
        return OnnxGenAIRunner(
            model_dir,
            threads=threads,
            fresh_engine=options.get("fresh_engine", "always"),
            ttft=options.get("ttft", "probe"),
            cache_root=options.get("cache_root"),
        ), None
    except Exception as exc:
        return None, f"{name} could not load {model_dir}: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------
# Command line smoke test
# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import sys

    from bench.workloads import build_workloads, encode_chat

    ap = argparse.ArgumentParser(description="Run the peer engines on a few workloads.")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default=",".join(PEER_NAMES))
    ap.add_argument("--categories", default="code_edit,open_ended")
    ap.add_argument("--n", type=int, default=1, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--max-draft-tokens", type=int, default=8)
    ap.add_argument("--draft-model", help="the draft model folder of ortgenai-draft-model")
    ap.add_argument("--seed", type=int, default=0, help="the sampled peers' seed (default 0)")
    ap.add_argument("--text", action="store_true", help="include generated text")
    args = ap.parse_args(argv)

    tok = Tokenizer.from_folder(args.model_dir)
    cats = [c for c in args.categories.split(",") if c]
    wls = build_workloads(args.n, 1500, tok, categories=cats)
    prompts = [(w.name, encode_chat(w.messages, tok)) for w in wls]
    report: dict[str, Any] = {"threads": args.threads, "peers": {}, "missing": {}}
    outputs: dict[str, dict[str, list[int]]] = {}
    for name in [p for p in args.peers.split(",") if p]:
        runner, why = make_peer(
            name,
            args.model_dir,
            threads=args.threads,
            ngram_size=args.ngram_size,
            max_draft_tokens=args.max_draft_tokens,
            draft_model=args.draft_model,
        )
        if runner is None:
            report["missing"][name] = why
            continue
        runner.warmup()
        runs = {}
        for wname, ids in prompts:
            seed = args.seed if name.endswith("-sampled") else None
            r = runner.run(ids, args.max_new_tokens, seed=seed)
            d = r.to_dict()
            d.pop("token_ids")
            if not args.text:
                d.pop("text")
            d["extra"] = {k: v for k, v in d["extra"].items() if k != "speculative_stats"} | (
                {"acceptance_rate": r.extra["speculative_stats"].get("acceptance_rate")}
                if "speculative_stats" in r.extra
                else {}
            )
            runs[wname] = d
            outputs.setdefault(wname, {})[name] = r.token_ids
        report["peers"][name] = {"describe": runner.describe(), "runs": runs}
        runner.close()
    # greedy peers should agree with each other; each sampled peer with its own family only
    report["same_tokens"] = {
        w: len({tuple(v) for k, v in o.items() if not k.endswith("-sampled")}) <= 1 for w, o in outputs.items()
    }
    report["same_tokens_sampled"] = {
        w: len({tuple(v) for k, v in o.items() if k.endswith("-sampled")}) <= 1 for w, o in outputs.items()
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
