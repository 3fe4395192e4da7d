"""How fast could speculation be on a suite run's own outputs? The ceilings of copying drafters, from a results file.

    python -m bench.ceiling docs/bench/results-evaluation.json [--out docs/bench/ceiling-evaluation.md]

A **perfect copier** drafts, at every pass, the longest continuation of the output so far that occurs verbatim in
the text a copying proposer can see (``copy_passes``): the prompt, the output so far and, in the ``repetitive``
stream, the outputs of the stream's earlier requests (what the suffix cache holds; a match never spans two of those
texts). Every draft it makes is right, at most ``max_draft`` (16, the suite's ``KMAX``) tokens per pass, and drafting
costs nothing. So no prompt lookup or suffix cache, however clever, can beat it on these outputs: its speed is the
ceiling of every copying proposer. **Anchored** (``anchor=1``), it must also continue an occurrence of the token
before the draft, the one any lookup keys on: the ceiling of a lookup that always picks the right one of the places
that token occurs. A **perfect drafter** (any drafter: every pass drafts ``max_draft`` right tokens)
is the ceiling of speculation itself at this pass cost. Beside them, the **suffix lookup, replayed**
(``lookup_passes``): ``auto``'s own lookup (``core.suffix.SuffixProposer`` with the default rule, the stream's
earlier outputs in a ``SuffixCache`` as an Engine records them) drafting every pass, up to ``max_draft`` tokens,
for free, its drafts checked against the output: what the lookup does on these outputs without a drafter, a width
policy or a drafting cost, so its gap to the anchored copier is the lookup's choice among a match's occurrences
and where its drafts stop. The **suffix lookup's trees, replayed** (``lookup_passes`` with ``nodes``): the same lookup
drafting trees of a match's other occurrences too (``DraftRule(branches=3)``, the first branch as deep as the
chain's, the other branches in the rest of ``max_draft`` nodes), each pass priced by its node count: how much of
that gap verifying several occurrences at once buys at this pass cost.

Everything else is the run's own measurement, nothing is re-timed:

* the outputs: ``ortspec-greedy``'s tokens on each prompt (every greedy setting produced the same, the suite checks);
* the time of a plain decode step on each prompt: ``ortspec-greedy``'s ``(total - TTFT) / (new tokens - 1)``, and
  its TTFT, which a ceiling keeps (speculation does not shorten the prompt's pass);
* a pass of ``K`` drafts costs ``curve[K]`` decode steps: the run's verify cost curve (``cost_curve``, measured at
  its ``context_tokens``; wider contexts make wide passes relatively a little cheaper, so this errs low);
* the peers' and ``ortspec-auto``'s totals on the same prompt, for the ratios (medians of per-prompt ratios, the
  suite's rule).

A ceiling's total on a prompt is ``TTFT + step * sum(curve[K] over its passes)``; a ratio is a peer's total over
it. The prompt ids are rebuilt with ``bench.workloads`` and must match the file's digest.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.engines import BASELINE, KMAX, NGRAM_PEER, REFERENCE, TREE_BRANCHES
from bench.workloads import STREAM_CATEGORIES, build_workloads, encode_chat, workloads_digest
from ortspec.adapters.engine.suffix_cache import SuffixCache
from ortspec.core import DraftContext, DraftRule, Proposer, SuffixProposer
from ortspec.core.tree import DraftTree, walk

AUTO = "ortspec-auto"
CATEGORIES = ("code_edit", "repetitive")


def _occurs(texts: Sequence[tuple[int, ...]], needle: tuple[int, ...]) -> bool:
    n, first = len(needle), needle[0]
    for text in texts:
        for i in range(len(text) - n + 1):
            if text[i] == first and text[i : i + n] == needle:
                return True
    return False


def copy_passes(
    earlier: Sequence[Sequence[int]],
    prompt: Sequence[int],
    output: Sequence[int],
    max_draft: int = KMAX,
    anchor: int = 0,
) -> list[int]:
    """The drafts (token counts) of the perfect copier's passes over ``output`` after ``prompt``: ``output[0]``
    comes from the prompt's pass; a pass at ``j`` (``output[:j]`` known) drafts the longest ``output[j : j + K]``,
    ``K <= max_draft``, found verbatim in one of ``earlier`` or in ``prompt + output[:j]``, and yields ``K + 1``
    tokens (the last token is always a pass's own pick, never a draft). ``anchor``: the draft must also continue an
    occurrence of the last ``anchor`` tokens before it (1: of the token a lookup keys on). Pure;
    ``O(len(output) * visible * K)``."""
    out = tuple(int(t) for t in output)
    docs = [tuple(int(t) for t in d) for d in earlier]
    passes, j = [], 1
    while j < len(out):
        seen = tuple(int(t) for t in prompt) + out[:j]
        visible = [*docs, seen]
        before = seen[len(seen) - min(anchor, len(seen)) :]
        k = 0
        while k < max_draft and j + k + 1 < len(out) and _occurs(visible, before + out[j : j + k + 1]):
            k += 1
        passes.append(k)
        j += k + 1
    return passes


def lookup_passes(
    proposer: Proposer, prompt: Sequence[int], output: Sequence[int], max_draft: int = KMAX, nodes: int | None = None
) -> list[int]:
    """The rows verified (draft tokens, or a tree's nodes) by ``proposer``'s passes over ``output`` after
    ``prompt``, greedy: a pass at ``j`` verifies ``proposer.propose(DraftContext(prompt + output[:j], K, nodes=N))``,
    ``K = min(max_draft, tokens left - 1)``, ``N = min(nodes, tokens left - 1)`` (``nodes`` None: no trees, the
    proposal cut to a chain of ``K``), commits the path the output follows (``core.tree.walk`` with the output as the
    target's picks; a chain's prefix that agrees with it) and then the pass's own pick. Costs the proposer's calls."""
    out, passes, j = [int(t) for t in output], [], 1
    while j < len(out):
        left = len(out) - j - 1
        k = min(max_draft, left)
        n = None if nodes is None else min(nodes, left)
        proposal = proposer.propose(DraftContext([*prompt, *out[:j]], k, nodes=n)) if k > 0 else ()
        tree = proposal if isinstance(proposal, DraftTree) else DraftTree.chain(tuple(proposal)[:k])
        tree = tree.within(max(n or k, k), k)
        path = walk(tree, functools.partial(_output_pick, out, j, tree.depths)).path
        passes.append(len(tree))
        j += len(path) + 1
    return passes


def _output_pick(out: Sequence[int], j: int, depths: Sequence[int], row: int) -> int:
    """The target's pick from verify row ``row`` of a pass at ``j`` when it produces ``out``: row 0 picks ``out[j]``,
    node ``row - 1`` (at depth ``depths[row - 1]``) the token after it."""
    return out[j + (depths[row - 1] + 1 if row else 0)]


def perfect_passes(new_tokens: int, max_draft: int = KMAX) -> list[int]:
    """A perfect drafter's passes: ``max_draft`` right drafts each, after the prompt's pass made the first token."""
    passes, j = [], 1
    while j < new_tokens:
        k = min(max_draft, new_tokens - j - 1)
        passes.append(k)
        j += k + 1
    return passes


# The speculators a report compares: measured ``ortspec-auto``, its lookup replayed, then the ceilings.
LOOKUP = "suffix lookup, replayed"
# The same lookup drafting trees (``DraftRule(branches=TREE_BRANCHES)``), its first branch ``TREE_WIDTH`` deep (the
# chain's depth) and at most ``KMAX`` nodes in all: what hindsight among a match's occurrences buys when every
# verified node is priced.
TREE_WIDTH = KMAX
TREE = f"suffix lookup, {TREE_BRANCHES}-branch trees, replayed"
COPIER, ANCHORED, DRAFTER = "perfect copier", "perfect copier, anchored", "perfect drafter"
SPECULATORS = (AUTO, LOOKUP, TREE, ANCHORED, COPIER, DRAFTER)


@attrs.frozen
class PromptCeiling:
    """One prompt: the measured totals (seconds, end to end) of every engine that ran it, and per speculator
    (``SPECULATORS``) its total and tokens per pass (measured for ``ortspec-auto``, computed for the ceilings)."""

    workload: str
    category: str
    totals: Mapping[str, float]
    tokens_per_pass: Mapping[str, float]


def prompt_ceiling(
    runs: Mapping[str, Mapping[str, Any]], passes: Mapping[str, list[int]], curve: Sequence[float]
) -> PromptCeiling:
    """``runs``: engine -> its record on the prompt (``ortspec-greedy``'s is the reference); ``passes``: ceiling ->
    the drafts of its passes; ``curve``: decode steps per pass of ``K`` drafts."""
    ref = runs[REFERENCE]
    n, ttft = int(ref["new_tokens"]), float(ref["ttft_s"])
    step = (float(ref["total_s"]) - ttft) / max(n - 1, 1)
    totals = {e: float(r["total_s"]) for e, r in runs.items()}
    per_pass = {AUTO: runs[AUTO]["tokens_per_step"]} if AUTO in runs else {}
    for name, ks in passes.items():
        totals[name] = ttft + step * sum(curve[k] for k in ks)
        per_pass[name] = (n - 1) / max(len(ks), 1)
    return PromptCeiling(workload=ref["workload"], category=ref["category"], totals=totals, tokens_per_pass=per_pass)


def ceilings(result: Mapping[str, Any], categories: Sequence[str] = CATEGORIES) -> list[PromptCeiling]:
    """Every prompt of ``categories`` in a suite results file (the parsed JSON), in the run's order."""
    from ortspec.adapters.engine.tokenizer import Tokenizer

    cfg = result["config"]
    tokenizer = Tokenizer.from_folder(cfg["model_dir"])
    split = cfg.get("split", "all")  # a run from before the splits took every prompt
    workloads = build_workloads(cfg["n_per_category"], cfg["max_prompt_tokens"], tokenizer,
                                max_new_tokens=cfg["max_new_tokens"], categories=cfg["categories"],
                                split=None if split == "all" else split)  # fmt: skip
    if workloads_digest(workloads) != result["workloads"]["digest"]:
        raise ValueError("the prompts rebuilt here differ from the run's (workloads digest); use the run's checkout")
    runs: dict[str, dict[str, dict]] = {}
    for r in result["runs"]:
        if r.get("repeat", 0) == 0 and r.get("error") is None:
            runs.setdefault(r["workload"], {})[r["engine"]] = r
    curve = result["cost_curve"]["curve"]
    out, earlier, caches = [], {}, {}  # category -> the stream's earlier outputs, and its lookup's SuffixCache
    for w in workloads:
        mine = runs.get(w.name, {})
        if w.category not in categories or REFERENCE not in mine:
            continue
        tokens = mine[REFERENCE]["token_ids"]
        prompt = encode_chat(w.messages, tokenizer)
        seen = earlier.setdefault(w.category, [])
        stream = w.category in STREAM_CATEGORIES
        cache = caches.setdefault(w.category, SuffixCache()) if stream else SuffixCache()
        passes = {
            LOOKUP: lookup_passes(SuffixProposer(cache=cache.snapshot()), prompt, tokens),
            TREE: lookup_passes(
                SuffixProposer(DraftRule(branches=TREE_BRANCHES), cache=cache.snapshot()),
                prompt,
                tokens,
                TREE_WIDTH,
                KMAX,
            ),
            ANCHORED: copy_passes(seen if stream else [], prompt, tokens, anchor=1),
            COPIER: copy_passes(seen if stream else [], prompt, tokens),
            DRAFTER: perfect_passes(len(tokens)),
        }
        seen.append(tokens)
        cache.add(prompt, tokens)
        out.append(prompt_ceiling(mine, passes, curve))
    return out


def _median(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "—"


def _cores(machine: Mapping[str, Any]) -> Any:
    cores = machine.get("cores")
    return cores.get("usable", cores) if isinstance(cores, Mapping) else cores


def report(result: Mapping[str, Any], rows: Sequence[PromptCeiling], source: str) -> str:
    """The markdown report: per category, measured ``ortspec-auto`` against the ceilings."""
    cc = result["cost_curve"]
    lines = [
        f"# Ceilings of speculation on {source} (bench/ceiling.py)",
        "",
        f"- command: `python -m bench.ceiling {source}`; the run: {result['date_utc']}, commit "
        f"{str(result.get('git_commit'))[:10]}, {_cores(result['machine'])} cores, "
        f"{result['config']['threads']} threads",
        f"- pass cost curve (decode steps per pass of K drafts, at {cc['context_tokens']} context tokens): "
        + ", ".join(f"K={k} {c:.2f}" for k, c in enumerate(cc["curve"]) if k in (0, 1, 2, 4, 8, 16)),
        f"- {COPIER}: every pass drafts the longest continuation found verbatim in what a copying proposer sees "
        f"(all right, drafting free); {ANCHORED}: the same, continuing an occurrence of the token before the draft; "
        f"{DRAFTER}: {KMAX} right drafts every pass; {LOOKUP}: auto's suffix lookup alone drafting up to {KMAX} "
        "tokens every pass, free, checked against the output (no drafter, no width policy); "
        f"{TREE}: the same lookup drafting trees {TREE_WIDTH} deep, at most {KMAX} nodes, each pass priced by "
        "its node count",
        "",
        "Medians over prompts of tokens per pass and of per-prompt ratios of end-to-end totals (TTFT + decode).",
        "",
        "| category | speculator | tokens / pass | ÷ ORT GenAI greedy | ÷ ORT GenAI n-gram | ÷ ortspec greedy |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for cat in dict.fromkeys(p.category for p in rows):
        sel = [p for p in rows if p.category == cat]
        for name in SPECULATORS:
            mine = [p for p in sel if name in p.totals]
            cells = [_median([p.tokens_per_pass[name] for p in mine if name in p.tokens_per_pass])]
            for over in (BASELINE, NGRAM_PEER, REFERENCE):
                ratios = [p.totals[over] / p.totals[name] for p in mine if over in p.totals]
                cells.append(_median(ratios) + ("x" if ratios else ""))
            lines.append(f"| {cat} ({len(mine)}) | {name} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a suite results file (docs/bench/results-*.json)")
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES))
    parser.add_argument("--out", default=None, help="write the report (markdown) here too")
    args = parser.parse_args(argv)
    result = json.loads(Path(args.results).read_text(encoding="utf-8"))
    text = report(result, ceilings(result, args.categories), args.results)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
