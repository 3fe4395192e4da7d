"""Acceptance under seeded sampling, the shared-KV drafter alone: argmax drafting (before) against coupled drafting
(the draft model picks with the target's own rule: core.sampling.DraftPicker), on open-ended prompts.

    python scripts/coupled_drafting.py --drafter DIR [--model DIR] [--prompts 6] [--max-tokens 96]
                                       [--temperatures 0.7 1.0] [--threads 2] [--out docs/coupled-drafting.md]

Each prompt (the benchmark's open-ended chat prompts, bench/workloads.py, which the drafter's training data does not
contain) is generated, seeded (seed 1000 + its number), by plain sampled decoding and by speculative decoding with
the drafter at a fixed width (``--width``, the drafter's ``num_speculative_tokens``) and with the cost-aware width
policy the Engine gives ``speculative="shared-kv"`` (the same policy value for both draftings), each drafting:
argmax (the drafter behind an object that is not ``Couplable``, as every sampled request drafted before) and coupled
(the Engine's drafter itself). Reported per temperature and drafting: accepted draft tokens per draft (per verify
pass with a draft), the acceptance rate, tokens per target pass, tok/s over plain's, and whether every output is
plain decoding's (tokens, text, finish reason). The runs of a prompt are interleaved, so a change in the machine's
load falls on all of them alike; the load average is printed at the start and the end.

A second table isolates the coupling from the width policies: one more speculative run per prompt at width 1, where
at every position the drafter drafts both ways (``Agreement``) and the coupled token is verified; the tokens
committed are the target's picks, so each position says whether the argmax draft and the coupled draft would have
been accepted as the first token of a draft.

A third table shows what coupling gives as the draft distribution nears the target's, on the real model: the
target's own rows along each prompt's plain sampled output (one-token decodes, as plain decoding makes them),
perturbed (Gaussian noise of a few logits, or a head hotter or colder than the target), each drafted both ways at
every position, against the target's pick from the unperturbed row.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.workloads import build_workloads  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.core import CostAwareWidth, FixedWidth, WidthPolicy  # noqa: E402
from ortspec.core.sampling import DraftPicker, Sampling, StepContext  # noqa: E402

DEFAULT_MODEL = Path("~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32").expanduser()


class ArgmaxDrafts:
    """The drafter as every sampled request used it before coupling: its ``propose`` only (not ``Couplable``), so
    its drafts are its argmax."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        return self.drafter.propose(context_tokens, width)


class Agreement:
    """A proposer that records, at every position of a sampled generation, the drafter's argmax first token and its
    coupled first token (``coupled``: the driver couples it; it drafts the coupled token). ``records``: ``(index of
    the position among the generated tokens, argmax token, coupled token)``, None where a drafting stopped."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.records: list[tuple[int, int | None, int | None]] = []

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        return ()  # greedy requests: not measured

    def coupled(self, picker: DraftPicker) -> BothDrafts:
        return BothDrafts(self, picker)


class BothDrafts:
    def __init__(self, owner: Agreement, picker: DraftPicker) -> None:
        self.owner, self.picker = owner, picker

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        argmax = self.owner.drafter.propose(context_tokens, 1)
        coupled = self.owner.drafter.propose(context_tokens, 1, self.picker)
        index = len(context_tokens) - self.picker.prompt_len
        self.owner.records.append((index, argmax[0] if argmax else None, coupled[0] if coupled else None))
        return coupled


def agreement(engine: Engine, chat, sampling: dict) -> tuple[int, int, int]:
    """(positions, argmax first tokens that equal the target's pick, coupled ones that do) over one prompt."""
    recorder = Agreement(engine.drafter)
    result = engine.generate(chat, speculative=recorder, draft_width=FixedWidth(1), **sampling)
    picks = result.token_ids
    seen = [(picks[i], a, c) for i, a, c in recorder.records if i < len(picks)]
    return len(seen), sum(a == p for p, a, _ in seen), sum(c == p for p, _, c in seen)


# The perturbations of the target's own row (``sensitivity``): a name and row -> drafted row (``rng`` per position).
PERTURBATIONS = {
    "the target's row": lambda row, rng: row,
    "+ noise 0.5 logit": lambda row, rng: row + rng.normal(0.0, 0.5, row.shape).astype(np.float32),
    "+ noise 1 logit": lambda row, rng: row + rng.normal(0.0, 1.0, row.shape).astype(np.float32),
    "+ noise 2 logits": lambda row, rng: row + rng.normal(0.0, 2.0, row.shape).astype(np.float32),
    "x 0.8 (hotter)": lambda row, rng: row * np.float32(0.8),
    "x 1.25 (colder)": lambda row, rng: row * np.float32(1.25),
}


def sensitivity(engine: Engine, chat, sampling: dict) -> dict[str, tuple[int, int, int]]:
    """Per perturbation: (positions, argmax drafts equal to the target's pick, coupled drafts equal to it) along the
    prompt's plain sampled output, from the target's own rows perturbed (module docstring)."""
    out = engine.generate(chat, **sampling).token_ids
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(chat))
    options = Sampling(temperature=sampling["temperature"], seed=sampling["seed"])
    backend = engine.backend
    backend.reset()
    row = backend.decode(prompt, 0)
    counts = {name: [0, 0, 0] for name in PERTURBATIONS}
    for j, token in enumerate(out):
        context = [*prompt, *out[:j]]
        pick = StepContext(options, prompt, out[:j]).pick(row, 0, (), margin=False, top_n=0).token
        picks = DraftPicker(options, len(prompt)).after(context)
        for k, (name, perturb) in enumerate(PERTURBATIONS.items()):
            drafted = perturb(np.array(row, np.float32), np.random.default_rng([sampling["seed"], j, k]))
            coupled = picks.pick(drafted, ())
            tally = counts[name]
            tally[0] += 1
            tally[1] += int(np.argmax(drafted)) == pick
            tally[2] += coupled is not None and coupled.token == pick
        if j + 1 < len(out):
            row = backend.decode([token], len(context))
    backend.reset()
    return {name: (n, a, c) for name, (n, a, c) in counts.items()}


class Tally:
    """One drafting's totals over the prompts of one temperature."""

    def __init__(self) -> None:
        self.tokens = self.passes = self.drafts = self.proposed = self.accepted = 0
        self.seconds = 0.0
        self.identical = 0

    def add(self, result, seconds: float, same: bool) -> None:
        s = result.stats
        self.tokens += len(result.token_ids)
        self.passes += s.steps
        self.drafts += s.verification_steps
        self.proposed += s.proposed_tokens
        self.accepted += s.accepted_tokens
        self.seconds += seconds
        self.identical += int(same)


def timed(engine: Engine, prompt, **options):
    t0 = time.perf_counter()
    result = engine.generate(prompt, **options)
    return result, time.perf_counter() - t0


def prompts(n: int) -> list[list[dict]]:
    return [w.messages for w in build_workloads(n, tokenizer=None, categories=["open_ended"])]


def run(args: argparse.Namespace) -> str:
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads), drafter=args.drafter)
    drafter = engine.drafter
    assert drafter is not None, "no drafter"
    limit = int(drafter.max_draft)
    load_start = os.getloadavg()
    policies: dict[str, WidthPolicy] = {
        f"width {args.width}": FixedWidth(args.width),
        "cost-aware width": CostAwareWidth(engine.pass_costs()[: limit + 1], draft_cost=engine.draft_cost()),
    }
    draftings = {"argmax": ArgmaxDrafts(drafter), "coupled": drafter}
    chats = prompts(args.prompts)
    for speculative in (None, drafter):  # warm-up: the first runs of a session are slower
        engine.generate(chats[0], speculative=speculative, draft_width=args.width, max_tokens=16)
    rows = []
    for temperature in args.temperatures:
        plain = Tally()
        tallies = {(p, d): Tally() for p in policies for d in draftings}
        agreed = [0, 0, 0]
        nearer = {name: (0, 0, 0) for name in PERTURBATIONS}
        for i, chat in enumerate(chats):
            sampling = {"temperature": temperature, "seed": 1000 + i, "max_tokens": args.max_tokens}
            want, seconds = timed(engine, chat, **sampling)
            plain.add(want, seconds, True)
            for (policy_name, drafting), tally in tallies.items():
                got, seconds = timed(engine, chat, speculative=draftings[drafting],
                                     draft_width=policies[policy_name], **sampling)  # fmt: skip
                same = (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
                tally.add(got, seconds, same)
            agreed = [a + b for a, b in zip(agreed, agreement(engine, chat, sampling), strict=True)]
            for name, counts in sensitivity(engine, chat, sampling).items():
                nearer[name] = tuple(a + b for a, b in zip(nearer[name], counts, strict=True))  # type: ignore[assignment]
            print(f"T {temperature} prompt {i}: {len(want.token_ids)} tokens", flush=True)
        rows.append((temperature, plain, tallies, agreed, nearer))
    load_end = os.getloadavg()
    return report(args, rows, load_start, load_end, len(chats))


def report(args, rows, load_start, load_end, n_prompts: int) -> str:
    loads = " ".join(f"{x:.2f}" for x in load_start), " ".join(f"{x:.2f}" for x in load_end)
    lines = [
        "# Drafting under sampling: argmax against coupled (scripts/coupled_drafting.py)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, onnxruntime threads {args.threads}",
        f"- load average (1, 5, 15 min) at the start: {loads[0]}; at the end: {loads[1]}",
        f"- target: {Path(args.model).name}; drafter: {args.drafter}",
        f"- {n_prompts} open-ended chat prompts (bench/workloads.py), {args.max_tokens} new tokens at most, seed "
        "1000 + prompt number; speculative runs use the drafter alone (speculative = the drafter)",
        "",
        "| T | width | drafting | accepted / draft | acceptance | tokens / pass | tok/s ÷ plain | identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for temperature, plain, tallies, _, _ in rows:
        plain_rate = plain.tokens / plain.seconds
        lines.append(
            f"| {temperature:g} | plain | - | - | - | {plain.tokens / plain.passes:.2f} | 1.00 "
            f"({plain_rate:.1f} tok/s) | - |"
        )
        for (policy, drafting), t in tallies.items():
            per_draft = t.accepted / t.drafts if t.drafts else 0.0
            rate = t.accepted / t.proposed if t.proposed else 0.0
            lines.append(
                f"| {temperature:g} | {policy} | {drafting} | {per_draft:.2f} | {rate:.0%} | "
                f"{t.tokens / t.passes:.2f} | {t.tokens / t.seconds / plain_rate:.2f} | {t.identical}/{n_prompts} |"
            )
    lines += [
        "",
        "First draft token against the target's sampled pick, at every position of each prompt's output (width 1; "
        "the same positions for both draftings):",
        "",
        "| T | positions | argmax draft = pick | coupled draft = pick |",
        "| --- | --- | --- | --- |",
    ]
    for temperature, _, _, (positions, argmax, coupled), _ in rows:
        lines.append(
            f"| {temperature:g} | {positions} | {argmax / positions:.1%} ({argmax}) | {coupled / positions:.1%} "
            f"({coupled}) |"
        )
    lines += [
        "",
        "The target's own rows along each prompt's plain sampled output, perturbed, drafted both ways (the first draft "
        "token against the target's pick from the unperturbed row):",
        "",
        "| T | draft row | positions | argmax draft = pick | coupled draft = pick |",
        "| --- | --- | --- | --- | --- |",
    ]
    for temperature, _, _, _, nearer in rows:
        for name, (positions, argmax, coupled) in nearer.items():
            lines.append(
                f"| {temperature:g} | {name} | {positions} | {argmax / positions:.1%} | {coupled / positions:.1%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--drafter", required=True, help="the drafter folder")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the report (markdown) here too")
    args = parser.parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
