"""Replay the greedy outputs of a suite results file under other proposers and width policies, without the model.

Greedy output is fixed, so whether a draft is accepted depends only on the context and the proposer: the replay
runs the real driver (``ortspec.generate``) on a backend whose "model" is the recorded greedy continuation, and
prices every pass with the measured verify cost curve. It estimates tokens per pass and the decode speedup over
greedy for any proposer setting in seconds, so settings can be compared before the slow suite measures them.

    python -m bench.replay [--results docs/bench/results-fp32.json] [--costs 1,1.0,1.04,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.workloads import build_workloads, encode_chat
from ortspec import Options, generate
from ortspec.adapters.tokenizer import Tokenizer
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import ModelFolder
from ortspec.core import AdditiveWidth, CostAwareWidth, PromptLookup


class ReplayBackend:
    """A backend whose argmax after ``prompt + greedy[:i]`` is ``greedy[i]`` (one-hot logits), pricing each pass."""

    def __init__(self, prompt: Sequence[int], greedy: Sequence[int], vocab: int, costs: Sequence[float]) -> None:
        self.sequence = list(prompt) + list(greedy)
        self.prompt_len = len(prompt)
        self.vocab = vocab
        self.costs = costs
        self.cost = 0.0
        self._len = 0

    vocab_size = property(lambda self: self.vocab)
    max_length = property(lambda self: len(self.sequence) + 64)

    def reset(self) -> None:
        self._len = 0

    def current_len(self) -> int:
        return self._len

    def rewind(self, length: int) -> None:
        self._len = length

    def _rows(self, tokens: Sequence[int], position: int) -> np.ndarray:
        if position != self._len:
            raise BackendError("position mismatch")
        rows = np.zeros((len(tokens), self.vocab), np.float32)
        for i in range(len(tokens)):
            nxt = position + i + 1  # the position this row predicts
            target = self.sequence[nxt] if nxt < len(self.sequence) else 0
            rows[i, target] = 1.0
        self._len += len(tokens)
        return rows

    def decode(self, tokens, past):
        if past > 0 or len(tokens) == 1:
            self.cost += self.costs[0]
        return self._rows(tokens, past)[-1]

    def decode_verify(self, tokens, base):
        self.cost += self.costs[min(len(tokens) - 1, len(self.costs) - 1)]
        return self._rows(tokens, base)


def replay(records, prompts, settings, costs, vocab):
    """Decode-phase speedup over greedy (greedy = one cost-1 pass per token) for each setting."""
    out = {}
    for name, (proposer, width) in settings.items():
        per_prompt, per_pass = [], []
        for rec in records:
            prompt, greedy = prompts[rec["workload"]], rec["token_ids"]
            if len(greedy) < 2:
                continue
            backend = ReplayBackend(prompt, greedy, vocab, costs)
            r = generate(backend, prompt, Options(max_new_tokens=len(greedy)), proposer, draft_width=width)
            assert list(r.token_ids) == list(greedy)
            steps_after_prefill = r.stats.steps - 1
            per_prompt.append((len(greedy) - 1) / backend.cost)
            per_pass.append((len(greedy) - 1) / max(steps_after_prefill, 1))
        out[name] = (statistics.median(per_prompt), statistics.median(per_pass))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="docs/bench/results-fp32.json")
    p.add_argument("--costs", default=None, help="comma-separated verify(K)/decode for K = 0.. (default: the file's)")
    p.add_argument("--category", action="append", help="only these categories")
    args = p.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    folder = data["config"]["model_dir"]
    tok = Tokenizer.from_folder(folder)
    workloads = build_workloads(data["config"]["n_per_category"], data["config"]["max_prompt_tokens"], tok)
    prompts = {w.name: encode_chat(w.messages, tok) for w in workloads}
    costs = [float(c) for c in args.costs.split(",")] if args.costs else list(data["cost_curve"]["curve"])
    records = [
        r
        for r in data["runs"]
        if r["engine"] == "ortspec-greedy" and (not args.category or r["category"] in args.category)
    ]
    vocab = ModelFolder.load(folder).vocab_size
    settings = {
        "lookup n3 w4": (PromptLookup(3, 4), 4),
        "lookup n3 w8": (PromptLookup(3, 8), 8),
        "lookup n3 w16": (PromptLookup(3, 16), 16),
        "lookup n3 min2 w8": (PromptLookup(3, 8, min_ngram=2), 8),
        "lookup n3 min3 w8": (PromptLookup(3, 8, min_ngram=3), 8),
        "lookup n4 min2 w8": (PromptLookup(4, 8, min_ngram=2), 8),
        "lookup n3 w16 cost-aware": (PromptLookup(3, 16), CostAwareWidth(costs)),
        "lookup n3 w16 additive": (PromptLookup(3, 16), AdditiveWidth(maximum=16)),
    }
    print(f"{len(records)} greedy outputs; costs {', '.join(f'{c:.2f}' for c in costs)}")
    for name, (speedup, per_pass) in replay(records, prompts, settings, costs, vocab).items():
        print(f"{name:28s} decode speedup {speedup:5.2f}x   tokens/pass {per_pass:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
