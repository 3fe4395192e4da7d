"""Replay the greedy outputs of a suite results file under other proposers and width policies, without the model.

Greedy output is fixed, so whether a draft is accepted depends only on the context and the proposer: the replay
runs the real driver (``ortspec.generate``) on a backend whose "model" is the recorded greedy continuation, and
prices every pass with the measured verify cost curve. It estimates tokens per pass and the decode speedup over
greedy for any proposer setting in seconds, so settings can be compared before the slow suite measures them.

    python -m bench.replay [--results bench/data/suite-results-fp32.json] [--costs 1,1.0,1.04,...]
    python -m bench.replay --export bench/data/replay-fp32.json      # the inputs, without model or tokenizer

The replay needs each prompt's token ids, which come from the workloads (built from this Python's standard library)
and the model's tokenizer. ``--export`` writes them once, with the recorded greedy outputs, into a small JSON file
(:func:`export_inputs`), so that :func:`price` can replay on a machine that has neither, such as a GPU machine with
another Python (``bench.gpu`` prices speculation on the device's own cost curve with it). The default results
file, ``bench/data/suite-results-fp32.json``, is the suite run those inputs were exported from (``python -m
bench.suite --precision fp32``, 2026-11-29: four categories x 8 prompts); tests/test_gpu_bench.py checks that they
agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.workloads import build_workloads, encode_chat
from ortspec import Options, generate
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import ModelFolder
from ortspec.core import AdditiveWidth, CostAwareWidth, PromptLookup


class ReplayBackend:
    """A backend whose argmax after ``prompt + greedy[:i]`` is ``greedy[i]`` (one-hot logits), pricing each pass.

    ``picks=True`` makes it a device-picks backend (``picks_on_device``): the driver then asks ``verify_picks`` for
    the picks and margins of every pass, as it does on CUDA, and no logits rows are built. ``cost`` adds up
    ``costs[K]`` per pass after the prompt, ``passes`` counts those passes and ``seconds`` the wall time spent in
    this backend's methods (so that a caller can tell the driver's own time from the stand-in passes')."""

    def __init__(
        self, prompt: Sequence[int], greedy: Sequence[int], vocab: int, costs: Sequence[float], picks: bool = False
    ) -> None:
        self.sequence = list(prompt) + list(greedy)
        self.prompt_len = len(prompt)
        self.vocab = vocab
        self.costs = costs
        self.cost = 0.0
        self.passes = 0
        self.widths: list[int] = []  # K (draft tokens) of each pass after the prompt
        self.seconds = 0.0
        self.picks_on_device = picks
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
        t0 = time.perf_counter()
        if past > 0 or len(tokens) == 1:
            self.cost += self.costs[0]
            self.passes += 1
            self.widths.append(len(tokens) - 1)
        row = self._rows(tokens, past)[-1]
        self.seconds += time.perf_counter() - t0
        return row

    def decode_verify(self, tokens, base):
        t0 = time.perf_counter()
        self.cost += self.costs[min(len(tokens) - 1, len(self.costs) - 1)]
        self.passes += 1
        self.widths.append(len(tokens) - 1)
        rows = self._rows(tokens, base)
        self.seconds += time.perf_counter() - t0
        return rows

    def verify_picks(self, tokens, base):
        """The picks of a pass over ``tokens`` at ``base`` (the recorded continuation), margins 1 (one-hot rows)."""
        t0 = time.perf_counter()
        if base != self._len:
            raise BackendError("position mismatch")
        self.cost += self.costs[min(len(tokens) - 1, len(self.costs) - 1)]
        self.passes += 1
        self.widths.append(len(tokens) - 1)
        picks = np.array(
            [self.sequence[i] if i < len(self.sequence) else 0 for i in range(base + 1, base + len(tokens) + 1)],
            np.int64,
        )
        self._len += len(tokens)
        self.seconds += time.perf_counter() - t0
        return picks, np.ones(len(tokens), np.float32)


def replay_prompt(
    prompt: Sequence[int],
    greedy: Sequence[int],
    vocab: int,
    costs: Sequence[float],
    proposer=None,
    width=8,
    picks: bool = True,
) -> dict[str, Any]:
    """Run the driver over one recorded greedy output (``proposer`` None: plain greedy steps) and return ``tokens``
    (committed after the first), ``passes`` (after the prompt pass), ``widths`` (K of each of them), ``cost`` (sum
    of ``costs[K]`` over them) and ``host_s`` (the wall time of the generation outside the stand-in backend:
    driver, core and proposer, measured on this machine). The output is checked to be the recorded one."""
    backend = ReplayBackend(prompt, greedy, vocab, costs, picks=picks)
    t0 = time.perf_counter()
    r = generate(backend, prompt, Options(max_tokens=len(greedy)), proposer, draft_width=width)
    wall = time.perf_counter() - t0
    assert list(r.token_ids) == list(greedy)
    return {
        "tokens": len(greedy) - 1,
        "passes": backend.passes,
        "widths": backend.widths,
        "cost": backend.cost,
        "host_s": wall - backend.seconds,
    }


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
            r = generate(backend, prompt, Options(max_tokens=len(greedy)), proposer, draft_width=width)
            assert list(r.token_ids) == list(greedy)
            steps_after_prefill = r.stats.steps - 1
            per_prompt.append((len(greedy) - 1) / backend.cost)
            per_pass.append((len(greedy) - 1) / max(steps_after_prefill, 1))
        out[name] = (statistics.median(per_prompt), statistics.median(per_pass))
    return out


INPUTS_FORMAT = "ortspec-replay-inputs/1"
# The settings bench.gpu prices: the suite's headline setting (cost-aware width up to 16) and a fixed width of 8.
PRICED_SETTINGS = ("lookup n3 w16 cost-aware", "lookup n3 w8")


def export_inputs(results_path: str | Path, out_path: str | Path) -> dict:
    """Write the greedy records of a suite results file with their prompts' token ids (rebuilt from the workloads
    and the tokenizer of the results' model folder, and checked against the recorded prompt lengths) to
    ``out_path`` as JSON; return what was written."""
    data = json.loads(Path(results_path).read_text())
    folder = data["config"]["model_dir"]
    tok = Tokenizer.from_folder(folder)
    workloads = build_workloads(data["config"]["n_per_category"], data["config"]["max_prompt_tokens"], tok)
    prompts = {w.name: encode_chat(w.messages, tok) for w in workloads}
    records = []
    for r in data["runs"]:
        if r["engine"] != "ortspec-greedy":
            continue
        prompt = [int(t) for t in prompts[r["workload"]]]
        if len(prompt) != r["prompt_tokens"]:
            raise ValueError(
                f"{r['workload']}: the rebuilt prompt has {len(prompt)} tokens, the run had {r['prompt_tokens']} "
                "(another Python's standard library, or another tokenizer?)"
            )
        records.append(
            {
                "workload": r["workload"],
                "category": r["category"],
                "prompt_ids": prompt,
                "token_ids": [int(t) for t in r["token_ids"]],
            }
        )
    out = {
        "format": INPUTS_FORMAT,
        "source": str(results_path),
        "source_date_utc": data.get("date_utc"),
        "source_git_commit": data.get("git_commit"),
        "model": Path(folder).name,
        "vocab_size": ModelFolder.load(folder).vocab_size,
        "cpu_cost_curve": list(data["cost_curve"]["curve"]),
        "workloads_python": data.get("workloads", {}).get("python"),
        "records": records,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return out


def load_inputs(path: str | Path) -> dict:
    """Read a file written by :func:`export_inputs`."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != INPUTS_FORMAT:
        raise ValueError(f"{path} is not an {INPUTS_FORMAT} file")
    return data


def price(
    inputs: dict,
    costs: Sequence[float],
    settings: Sequence[str] = PRICED_SETTINGS,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
    pass_s: Sequence[float] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Replay the recorded greedy outputs of ``inputs`` under each named setting with the cost curve ``costs``
    (verify(K)/decode for K = 0..), through the driver on the device-picks path. Per category and setting, medians
    over prompts of ``decode_speedup`` (greedy passes / priced passes: the pass costs alone) and
    ``tokens_per_pass``.

    With ``pass_s`` (the absolute seconds of a pass for K = 0.., e.g. ``measure_pass_costs(...)["pass_s"]``) each
    prompt is also priced in seconds: its passes' ``pass_s`` plus the driver's, core's and proposer's own host time
    measured in the replay on this machine. Then ``expected_tok_s`` (decode phase), the greedy prediction
    ``greedy_expected_tok_s`` (one K = 0 pass and the plain loop's host time per token) and ``speedup_with_host``
    (their ratio) are medians over prompts too, and the category gets a ``greedy`` entry. ``limit``: at most that
    many prompts per category."""
    all_settings = _settings(list(costs))
    chosen = {name: all_settings[name] for name in settings}
    by_category: dict[str, list[dict]] = {}
    for rec in inputs["records"]:
        by_category.setdefault(rec["category"], []).append(rec)
    vocab = inputs["vocab_size"]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for category, records in by_category.items():
        if categories is not None and category not in categories:
            continue
        records = [r for r in (records[:limit] if limit else records) if len(r["token_ids"]) >= 2]
        greedy_runs = [replay_prompt(r["prompt_ids"], r["token_ids"], vocab, costs) for r in records]
        entry: dict[str, dict[str, Any]] = {}
        if pass_s is not None:
            entry["greedy"] = {
                "expected_tok_s": statistics.median(
                    g["tokens"] / (g["passes"] * pass_s[0] + g["host_s"]) for g in greedy_runs
                ),
                "host_us_per_pass": 1e6 * statistics.median(g["host_s"] / g["passes"] for g in greedy_runs),
                "prompts": len(records),
            }
        for name, (proposer, width) in chosen.items():
            speedups, per_pass, expected, with_host, host_per_pass = [], [], [], [], []
            for rec, g in zip(records, greedy_runs, strict=True):
                run = replay_prompt(rec["prompt_ids"], rec["token_ids"], vocab, costs, proposer, width)
                speedups.append(run["tokens"] / run["cost"])
                per_pass.append(run["tokens"] / max(run["passes"], 1))
                if pass_s is not None:
                    seconds = sum(pass_s[min(k, len(pass_s) - 1)] for k in run["widths"]) + run["host_s"]
                    greedy_s = g["passes"] * pass_s[0] + g["host_s"]
                    expected.append(run["tokens"] / seconds)
                    with_host.append(greedy_s / seconds)
                    host_per_pass.append(run["host_s"] / max(run["passes"], 1))
            item = {
                "decode_speedup": statistics.median(speedups),
                "tokens_per_pass": statistics.median(per_pass),
                "prompts": len(records),
            }
            if pass_s is not None:
                item["expected_tok_s"] = statistics.median(expected)
                item["speedup_with_host"] = statistics.median(with_host)
                item["host_us_per_pass"] = 1e6 * statistics.median(host_per_pass)
            entry[name] = item
        out[category] = entry
    return out


def _settings(costs: list[float]) -> dict:
    return {
        "lookup n3 w4": (PromptLookup(3, 4), 4),
        "lookup n3 w8": (PromptLookup(3, 8), 8),
        "lookup n3 w16": (PromptLookup(3, 16), 16),
        "lookup n3 min2 w8": (PromptLookup(3, 8, min_ngram=2), 8),
        "lookup n3 min3 w8": (PromptLookup(3, 8, min_ngram=3), 8),
        "lookup n4 min2 w8": (PromptLookup(4, 8, min_ngram=2), 8),
        "lookup n3 w16 cost-aware": (PromptLookup(3, 16), CostAwareWidth(costs)),
        "lookup n3 w16 additive": (PromptLookup(3, 16), AdditiveWidth(maximum=16)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="bench/data/suite-results-fp32.json")
    p.add_argument("--costs", default=None, help="comma-separated verify(K)/decode for K = 0.. (default: the file's)")
    p.add_argument("--category", action="append", help="only these categories")
    p.add_argument("--export", metavar="JSON", help="write the replay inputs (prompt ids + greedy outputs) and stop")
    args = p.parse_args(argv)
    if args.export:
        out = export_inputs(args.results, args.export)
        print(f"wrote {args.export}: {len(out['records'])} greedy records of {out['model']}")
        return 0
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
    settings = _settings(costs)
    print(f"{len(records)} greedy outputs; costs {', '.join(f'{c:.2f}' for c in costs)}")
    for name, (speedup, per_pass) in replay(records, prompts, settings, costs, vocab).items():
        print(f"{name:28s} decode speedup {speedup:5.2f}x   tokens/pass {per_pass:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
