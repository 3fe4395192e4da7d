"""Show that the tests catch a broken core, driver, server queue or batch runner: apply one deliberate bug (a
mutant) at a time to a staged copy of the package, run the unit tests (``tests/``) and the property suite
(``property_tests/``) against it, and report which test caught it (every one must be).

    python scripts/mutation_check.py            # every mutant
    python scripts/mutation_check.py --list     # names, files and the tests each one runs
    python scripts/mutation_check.py tie-guard-off lookup-oldest-match

A mutant is caught when any test fails. For each one, pytest runs with ``-x`` over the unit test files of the
mutated module (``UNIT_TESTS``, the fast targeted ones first), then, for the core and the driver, the property
suite, all under the quick Hypothesis profile (5% of the examples); a core or driver mutant that survives runs the
property suite again with the ci profile's example counts (shrinking off: only the verdict matters). So a caught
mutant costs seconds. Before the mutants, the same tests run once on the unmodified copy (``--no-baseline`` skips
it): a test that fails there would "catch" every mutant. Exit status 0 only if every mutant was caught. The
working tree is never modified. CI runs this after the test suite (``.ci/run``).

The table is data: each mutant names a file, an exact snippet found once in it (one line where possible) and its
replacement. When code moves, re-point the file (and ``UNIT_TESTS``); when a snippet changes, re-cut the mutant.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent

PROPERTY_TESTS = ("property_tests/test_prompt_lookup.py", "property_tests/test_equivalence.py")

# The unit test files that exercise each module, the fastest and most targeted first; a mutant may name its own.
# Modules of the core and the driver are also checked by the property suite (PROPERTY_CHECKED).
UNIT_TESTS: dict[str, tuple[str, ...]] = {
    "core/state.py": ("tests/test_commit_rules.py", "tests/test_core_rules.py", "tests/test_driver.py"),
    "core/tree.py": (
        "tests/test_tree.py",
        "tests/test_core_rules.py",
        "tests/test_driver.py",
        "property_tests/test_trees.py",
    ),
    "core/text.py": ("tests/test_commit_rules.py", "tests/test_core_rules.py", "tests/test_driver.py"),
    "core/sampling.py": ("tests/test_sampling_rules.py", "tests/test_sampling.py", "tests/test_core_rules.py"),
    "core/proposers.py": ("tests/test_draft_context.py", "tests/test_proposers.py"),
    "core/speculative.py": ("tests/test_speculative.py",),
    "backends/draft_model.py": ("property_tests/test_draft_model.py",),
    "adapters/engine/scheduler.py": ("tests/test_scheduler.py",),
    "ortspec/speculation.py": ("tests/test_draft_context.py", "tests/test_driver.py", "tests/test_batch_driver.py"),
    "ortspec/sequence.py": (
        "tests/test_draft_context.py",
        "tests/test_batch_driver.py",
        "tests/test_driver.py",
        "property_tests/test_batching.py",
    ),
    "ortspec/batch_driver.py": (
        "tests/test_batch_driver.py",
        "tests/test_driver.py",
        "property_tests/test_batching.py",
    ),
    "adapters/serve/jobs.py": ("tests/test_server.py",),
    # moves to adapters/batch/ (issue 18): re-point the batch-resume-* mutants with it
    "adapters/batch/run.py": ("tests/test_batch_resume.py", "tests/test_batch.py"),
    "adapters/batch/output.py": ("tests/test_batch_resume.py", "tests/test_batch.py"),
    "adapters/batch/records.py": ("tests/test_batch_resume.py", "tests/test_batch.py"),
    "adapters/batch/worker.py": ("tests/test_batch_slots.py",),
    "adapters/batch/local.py": ("tests/test_batch.py::test_a_record_that_kills_its_worker_is_an_error_line",),
    "core/suffix.py": (
        "tests/test_suffix.py::test_a_snapshot_is_unchanged_by_what_is_added_after_it",
        "tests/test_suffix.py",
    ),
    "core/tokens.py": ("tests/test_shared_sequence.py", "tests/test_proposers.py"),
    "core/prefix.py": ("tests/test_batch_driver.py", "tests/test_driver.py"),
}
PROPERTY_CHECKED = ("core/", "ortspec/")


class Mutant(NamedTuple):
    """One deliberate bug: in ``file`` (a path in the repository), ``old`` (found exactly once) becomes ``new``.
    ``tests``: the unit test paths to run (default: ``UNIT_TESTS[file]``)."""

    file: str
    old: str
    new: str
    tests: tuple[str, ...] = ()

    @property
    def unit_tests(self) -> tuple[str, ...]:
        return self.tests or UNIT_TESTS[self.file]

    @property
    def property_tests(self) -> tuple[str, ...]:
        return PROPERTY_TESTS if self.file.startswith(PROPERTY_CHECKED) else ()


# Each one a bug that other engines have shipped, or that an earlier version of the tests let through.
MUTANTS: dict[str, Mutant] = {
    # -- accepting draft tokens, the KV length, the draft budget --------------------------------------------------
    "accept-without-check": Mutant(
        "core/tree.py",
        "candidates[-1] == draft[len(candidates) - 1]",
        "candidates[-1] >= 0",
    ),
    "rewind-off-by-one": Mutant(
        "core/state.py",
        "return StepOutcome(new_state, tuple(commits), new_state.kv_len, committed_draft, kept)",
        "return StepOutcome(new_state, tuple(commits), new_state.kv_len + 1, committed_draft, kept)",
    ),
    "budget-overshoot": Mutant(
        "core/state.py",
        "budget = state.options.max_tokens - len(state.generated_tokens) - 1",
        "budget = state.options.max_tokens - len(state.generated_tokens)",
    ),
    "ties-to-highest-id": Mutant(
        "core/sampling.py",
        "best = int(np.argmax(z))",
        "best = int(len(z) - 1 - np.argmax(z[::-1]))",
    ),
    # -- token-tree drafts (core/tree.py; property_tests/test_trees.py) ------------------------------------------
    "tree-mask-sees-every-earlier-node": Mutant(
        "core/tree.py",
        "mask = np.eye(n + 1, dtype=bool)",
        "mask = np.tri(n + 1, dtype=bool)",
        ("tests/test_tree.py", "property_tests/test_trees.py"),
    ),
    "tree-walk-takes-the-highest-index-twin": Mutant(
        "core/tree.py",
        "return next((c for c in self._children[node + 1] if tokens[c] == token), None)",
        "return next((c for c in reversed(self._children[node + 1]) if tokens[c] == token), None)",
        ("tests/test_tree.py", "property_tests/test_trees.py"),
    ),
    "tree-pick-index-is-the-row-not-the-depth": Mutant(
        "core/state.py",
        "index = len(drafted)  # the pick's index among the generated tokens, after the step's first",
        "index = i",
        ("tests/test_tree.py", "property_tests/test_trees.py"),
    ),
    "tree-driver-skips-compaction": Mutant(
        "ortspec/sequence.py",
        "            backend.keep_path(self._slot, row.position, kept)\n",
        "            pass\n",
        ("tests/test_tree.py", "property_tests/test_trees.py"),
    ),
    "tree-budget-learns-the-whole-tree-as-its-first-branch": Mutant(
        "ortspec/speculation.py",
        "learned, chain_accepted = tuple(draft.tokens[j] for j in first), min(accepted, agreed)",
        "learned, chain_accepted = tuple(draft.tokens[j] for j in first), min(accepted, len(first))",
        ("tests/test_tree_budget.py",),
    ),
    "tree-siblings-lengthen-the-chain": Mutant(
        "core/tree.py",
        "for d, listed in enumerate(siblings[:depth])",
        "for d, listed in enumerate(siblings[: depth + 1])",
        ("tests/test_tree.py",),
    ),
    "drafter-siblings-ignore-the-chance-of-reaching-them": Mutant(
        "backends/onnx/drafter.py",
        "siblings.append([(token, reach * p) for token, p in ranked])",
        "siblings.append([(token, p) for token, p in ranked])",
        ("tests/test_drafter.py",),
    ),
    "auto-teaches-the-lookups-tree-budget-what-the-drafter-drafted": Mutant(
        "core/lookup_or_draft.py",
        '"drafted_by": name,',
        '"drafted_by": "lookup_policy",',
        ("tests/test_tree.py",),
    ),
    "suffix-tree-puts-the-best-path-last": Mutant(
        "core/suffix.py",
        "tree = DraftTree.merged([best.draft, *ranked], budget)",
        "tree = DraftTree.merged([*ranked, best.draft], budget)",
        ("tests/test_suffix.py",),
    ),
    # -- coupled drafting: a draft model's picks under sampling (property_tests/test_coupled_drafting.py) ---------
    "coupled-draft-index-off-by-one": Mutant(
        "core/sampling.py",
        "return self._context.pick(row, len(drafted), drafted, margin=False, top_n=0)",
        "return self._context.pick(row, len(drafted) + 1, drafted, margin=False, top_n=0)",
        ("property_tests/test_coupled_drafting.py",),
    ),
    "coupled-draft-penalties-ignore-the-draft": Mutant(
        "core/sampling.py",
        "return self._context.pick(row, len(drafted), drafted, margin=False, top_n=0)",
        "return self._context.pick(row, len(drafted), (), margin=False, top_n=0)",
        ("property_tests/test_coupled_drafting.py",),
    ),
    "coupled-draft-counts-the-prompt-as-generated": Mutant(
        "core/sampling.py",
        "prompt, generated = context_tokens[: self.prompt_len], context_tokens[self.prompt_len :]",
        "prompt, generated = context_tokens[: self.prompt_len - 1], context_tokens[self.prompt_len - 1 :]",
        ("property_tests/test_coupled_drafting.py",),
    ),
    "driver-never-couples": Mutant(
        "ortspec/speculation.py",
        "picker = DraftPicker(sampling, len(state.prompt_tokens)) if sampling.temperature > 0.0 else None",
        "picker = None",
        ("property_tests/test_coupled_drafting.py",),
    ),
    # -- a separate draft model's own KV (backends/draft_model.py; property_tests/test_draft_model.py) -------------
    "draft-model-rewinds-past-the-common-prefix": Mutant(
        "backends/draft_model.py",
        "keep = min(common_prefix_length(held, tokens), len(tokens) - 1)",
        "keep = max(0, min(common_prefix_length(held, tokens), len(tokens) - 1) - 1)",
        ("property_tests/test_draft_model.py",),
    ),
    "draft-model-keys-on-the-target-slot": Mutant(
        "backends/draft_model.py",
        "key = context.sequence if context.sequence is not None else context.slot",
        "key = context.slot",
        ("property_tests/test_draft_model.py",),
    ),
    "tie-guard-off": Mutant(
        "core/state.py",
        "if k and opts.tie_margin > 0:",
        "if False:",
    ),
    # -- EOS and the token budget ---------------------------------------------------------------------------------
    "commit-past-eos": Mutant(
        "core/state.py",
        "        if finish is not None:\n            break\n",
        "        if finish is not None and finish is not FinishReason.EOS_TOKEN:\n            break\n",
    ),
    "eos-does-not-end": Mutant(
        "core/state.py",
        "        if eos:\n            finish = FinishReason.EOS_TOKEN\n",
        "        if eos and False:\n            finish = FinishReason.EOS_TOKEN\n",
    ),
    "max-tokens-overshoot": Mutant(
        "core/state.py",
        "if len(generated) >= opts.max_tokens:",
        "if len(generated) > opts.max_tokens:",
    ),
    # -- stop token sequences (checked after EOS, before stop strings; the first listed that matches) ------------
    "stop-sequence-outranks-eos": Mutant(
        "core/state.py",
        "eos = token in opts.eos_token_ids\n",
        "eos = token in opts.eos_token_ids and not _matched_stop_sequence(generated, opts.stop_token_sequences)\n",
    ),
    "stop-sequence-needs-a-longer-output": Mutant(
        "core/state.py",
        "if len(generated) >= n and tuple(generated[-n:]) == seq:",
        "if len(generated) > n and tuple(generated[-n:]) == seq:",
    ),
    "stop-sequence-spans-the-prompt": Mutant(
        "core/state.py",
        "_matched_stop_sequence(generated, opts.stop_token_sequences)",
        "_matched_stop_sequence(generated.with_head(state.prompt_tokens), opts.stop_token_sequences)",
    ),
    "stop-sequence-last-listed-wins": Mutant(
        "core/state.py",
        "    for seq in sequences:\n",
        "    for seq in reversed(sequences):\n",
    ),
    "stop-sequence-only-at-block-end": Mutant(
        "core/state.py",
        "seq = None if eos else _matched_stop_sequence(",
        "seq = None if eos or i < len(candidates) - 1 else _matched_stop_sequence(",
    ),
    # -- stop strings ---------------------------------------------------------------------------------------------
    "stop-only-at-block-end": Mutant(
        "core/state.py",
        "        elif (stop := text.find_stop()) is not None:",
        "        elif i == len(candidates) - 1 and (stop := text.find_stop()) is not None:",
    ),
    "first-listed-stop-string-wins": Mutant(
        "core/text.py",
        "if at >= 0 and (best is None or (at + len(s), at) < best[:2]):",
        "if at >= 0 and best is None:",
    ),
    "stop-string-search-misses-token-boundaries": Mutant(
        "core/text.py",
        "start = max(0, self.checked - self.longest_stop + 1)",
        "start = self.checked",
    ),
    # -- streamed text: hold-back, partial characters, the final flush --------------------------------------------
    "stream-no-hold-back": Mutant(
        "core/text.py",
        "end = len(self.text) if final else len(self.text) - self._held_back()",
        "end = len(self.text)",
    ),
    "stream-held-back-text-never-released": Mutant(
        "core/text.py",
        "end = len(self.text) if final else len(self.text) - self._held_back()",
        "end = len(self.text) - self._held_back()",
    ),
    "stream-hold-back-only-first-stop-string": Mutant(
        "core/text.py",
        "        for s in self.stop_strings:\n            for n in range(",
        "        for s in self.stop_strings[:1]:\n            for n in range(",
    ),
    "stream-hold-back-shortest-prefix": Mutant(
        "core/text.py",
        "for n in range(min(len(s) - 1, len(tail)), best, -1):",
        "for n in range(best + 1, min(len(s) - 1, len(tail)) + 1):",
    ),
    "partial-character-not-waited-for": Mutant(
        "core/text.py",
        "if len(full) > len(prefix) and (flush or not full.endswith(_REPLACEMENT_CHAR)):",
        "if len(full) > len(prefix):",
    ),
    "partial-character-dropped-at-finish": Mutant(
        "core/state.py",
        "text.add(generated, flush=eos or seq is not None or grammar_done or bound is not None)",
        "text.add(generated, flush=False)",
    ),
    "detokenize-without-left-context": Mutant(
        "core/text.py",
        "self.detok_start, self.detok_end = self.detok_end, len(generated)",
        "self.detok_start, self.detok_end = len(generated), len(generated)",
    ),
    "partial-text-includes-undelivered": Mutant(
        "core/state.py",
        "        text=state.text[:streamed],\n",
        "        text=state.text,\n",
    ),
    # -- the context limit (max_context or the KV capacity, whichever is smaller) ---------------------------------
    "context-limit-ignored-mid-block": Mutant(
        "core/state.py",
        "budget = min(budget, limit - state.context_len - 1)",
        "budget = min(budget, limit - state.context_len + 1)",
    ),
    "context-full-one-token-late": Mutant(
        "core/state.py",
        "elif limit is not None and len(state.prompt_tokens) + len(generated) >= limit:",
        "elif limit is not None and len(state.prompt_tokens) + len(generated) > limit:",
    ),
    "context-full-counts-only-generated": Mutant(
        "core/state.py",
        "elif limit is not None and len(state.prompt_tokens) + len(generated) >= limit:",
        "elif limit is not None and len(generated) >= limit:",
    ),
    "context-limit-ignores-capacity": Mutant(
        "core/state.py",
        "bounds = [b for b in (self.options.max_context, self.capacity) if b is not None]",
        "bounds = [b for b in (self.options.max_context,) if b is not None]",
    ),
    "draft-budget-ignores-capacity": Mutant(
        "core/state.py",
        "    limit = state.context_limit\n    if limit is not None:\n        budget = min(",
        "    limit = state.options.max_context\n    if limit is not None:\n        budget = min(",
    ),
    # -- structured outputs (core/constraint.py) ------------------------------------------------------------------
    "grammar-mask-ignores-the-draft-prefix": Mutant(
        "core/state.py",
        "constraint.allowed(generated, drafted, eos_ids)",
        "constraint.allowed(generated, (), eos_ids)",
        ("tests/test_structured.py", "property_tests/test_grammar.py"),
    ),
    "grammar-allows-eos-anywhere": Mutant(
        "core/constraint.py",
        "mask[eos] = self._matcher.accepting()",
        "mask[eos] = True",
        ("tests/test_structured.py", "property_tests/test_grammar.py"),
    ),
    "grammar-never-completes": Mutant(
        "core/state.py",
        "grammar_done = not eos and seq is None and constraint is not None and constraint.complete(generated)",
        "grammar_done = False",
        ("tests/test_structured.py", "property_tests/test_grammar.py"),
    ),
    # -- tools (adapters/engine/tool_format.py) -------------------------------------------------------------------
    "tool-call-reader-ignores-escapes": Mutant(
        "adapters/engine/tool_format.py",
        'elif ch == "\\\\":',
        "elif False:",
        ("tests/test_tools.py",),
    ),
    # -- logprobs -------------------------------------------------------------------------------------------------
    "logprob-alternatives-at-minus-inf": Mutant(
        "core/sampling.py",
        "cand = np.nonzero((x >= x[cand].min()) & (x > -math.inf))[0]",
        "cand = np.nonzero(x >= x[cand].min())[0]",
        ("tests/test_structured.py",),
    ),
    "logprobs-not-normalised": Mutant(
        "core/sampling.py",
        "return float(x[token] - lse), tuple(",
        "return float(x[token] - m), tuple(",
    ),
    # -- sampling: the draw, the filters, temperature -------------------------------------------------------------
    "sampling-same-position-for-every-row": Mutant(
        "core/sampling.py",
        "uniform(_seed(s), self.first_index + i)",
        "uniform(_seed(s), self.first_index)",
    ),
    "temperature-multiplies": Mutant(
        "core/sampling.py",
        "p = np.exp((z[ids] - zmax) / np.float32(t))",
        "p = np.exp((z[ids] - zmax) * np.float32(t))",
    ),
    "top-k-keeps-one-more": Mutant(
        "core/sampling.py",
        "chosen = order[:k]",
        "chosen = order[: k + 1]",
    ),
    "top-k-ties-to-highest-id": Mutant(
        "core/sampling.py",
        "order = cand[np.lexsort((cand, -z[cand]))]",
        "order = cand[np.lexsort((-cand, -z[cand]))]",
    ),
    "top-p-drops-the-crossing-token": Mutant(
        "core/sampling.py",
        'n = min(int(np.searchsorted(running, goal, side="left")) + 1, len(order))',
        'n = max(1, min(int(np.searchsorted(running, goal, side="left")), len(order)))',
    ),
    "top-p-of-unnormalised-mass": Mutant(
        "core/sampling.py",
        "goal = top_p * total",
        "goal = top_p",
    ),
    "min-p-of-normalised-probability": Mutant(
        "core/sampling.py",
        "keep = p >= s.min_p",
        "keep = p / p.sum() >= s.min_p",
    ),
    # -- penalties and logit bias ---------------------------------------------------------------------------------
    "penalties-ignore-the-draft-prefix": Mutant(
        "core/sampling.py",
        "z = self.processed(row, drafted) if s.processes else np.asarray(row)",
        "z = self.processed(row, ()) if s.processes else np.asarray(row)",
    ),
    "repetition-penalty-divides-negative-logits": Mutant(
        "core/sampling.py",
        "z[ids] = _saturated(np.where(v > 0, v / rp, v * rp), v)",
        "z[ids] = _saturated(v / rp, v)",
    ),
    "repetition-penalty-ignores-the-prompt": Mutant(
        "core/sampling.py",
        "self._rep_ids = np.unique(np.asarray([*prompt, *generated], dtype=np.int64))",
        "self._rep_ids = np.unique(np.asarray([*generated], dtype=np.int64))",
    ),
    "presence-penalty-per-occurrence": Mutant(
        "core/sampling.py",
        "penalty = counts.astype(np.float32) * _f32(s.frequency_penalty) + _f32(s.presence_penalty)",
        "penalty = counts.astype(np.float32) * _f32(s.frequency_penalty + s.presence_penalty)",
    ),
    "frequency-penalty-counts-the-prompt": Mutant(
        "core/sampling.py",
        "np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)",
        "np.unique(np.asarray([*prompt, *generated], dtype=np.int64), return_counts=True)",
    ),
    "logit-bias-replaces-the-logit": Mutant(
        "core/sampling.py",
        "z[self._bias_ids] = _saturated(v + self._bias, v)",
        "z[self._bias_ids] = _saturated(self._bias, v)",
    ),
    "logit-bias-alone-is-plain-greedy": Mutant(
        "core/sampling.py",
        "            or bool(self.logit_bias)\n",
        "",
    ),
    # -- prompt lookup --------------------------------------------------------------------------------------------
    # -- the suffix cache: a request drafts from its snapshot alone; the corpus stays under its cap --------------
    "suffix-snapshot-sees-later-outputs": Mutant(
        "core/suffix.py",
        "found = _best(corpus_tokens, cache.index(), len(cache), tail, limit, self.rule, context_end=None)",
        "found = _best(corpus_tokens, cache.index(), len(corpus_tokens), tail, limit, self.rule, context_end=None)",
    ),
    "suffix-cache-never-evicts": Mutant(
        "core/suffix.py",
        "kept = [*self.corpus[cut:], *doc, SEPARATOR]",
        "kept = [*self.corpus, *doc, SEPARATOR]",
    ),
    "lookup-oldest-match": Mutant(
        "core/proposers.py",
        "while len(found) < count and (at := data.rfind(needle, 0, end)) >= 0:",
        "while len(found) < count and (at := data.find(needle, 0, end)) >= 0:",
    ),
    "lookup-unaligned-match": Mutant(
        "core/proposers.py",
        "if at % 4 == 0:",
        "if True:",
    ),
    "lookup-index-keeps-oldest": Mutant(
        "core/proposers.py",
        "return positions[max(end - count, 0) : end][::-1]",
        "return positions[:end][:count][::-1]",
    ),
    "lookup-index-includes-last-token": Mutant(
        "core/proposers.py",
        "end = bisect_right(positions, context_len - 1)",
        "end = bisect_right(positions, context_len)",
    ),
    "shared-extends-an-older-value-in-place": Mutant(
        "core/tokens.py",
        "if len(store.items) == n:  # nobody appended past this value: append in place",
        "if True:",
    ),
    # -- the driver -----------------------------------------------------------------------------------------------
    "driver-wrong-width-feedback": Mutant(
        "ortspec/speculation.py",
        "policy = self.policy.observe(len(learned), chain_accepted)",
        "policy = self.policy.observe(len(learned), len(learned))",
    ),
    # -- what speculative means (core/speculative.py) and the scheduler's hand-over of its slots -----------------
    "speculative-auto-without-a-drafter-is-prompt-lookup": Mutant(
        "core/speculative.py",
        "        speculative = AUTO_LOOKUP\n",
        '        speculative = "prompt-lookup"\n',
    ),
    "speculative-an-int-width-does-not-cap-auto": Mutant(
        "core/speculative.py",
        "        return priced, FixedWidth(draft_width)\n",
        "        return priced, FixedWidth(len(prices.pass_costs) - 1)\n",
    ),
    "scheduler-trusts-the-slots-after-a-measurement": Mutant(
        "adapters/engine/scheduler.py",
        "        self._parked = False\n        self._driver.forget()\n",
        "        self._parked = False\n",
    ),
    "driver-drops-device-margins": Mutant(
        "ortspec/sequence.py",
        "outcome = step_from_picks(state, logits.ids, self._draft, vocab_size=vocab, margins=logits.margins)",
        "outcome = step_from_picks(state, logits.ids, self._draft, vocab_size=vocab, margins=None)",
    ),
    "one-slot-verifies-plain-steps": Mutant(
        "backends/base.py",
        "        if row.logits_rows == 1:\n",
        "        if False:\n",
        ("tests/test_driver.py",),
    ),
    # -- the batch driver (continuous batching) ---------------------------------------------------------------
    "batch-driver-skips-rewind": Mutant(
        "ortspec/sequence.py",
        "        backend.rewind(self._slot, outcome.rewind_to)\n",
        "",
    ),
    # (a prompt chunk now asks for its last row only, so "the first row of the last chunk" is that row: the bug
    # class moved to the backend that cuts the rows out)
    "batch-backend-forgets-the-rows-it-did-not-compute": Mutant(
        "backends/onnx/batch.py",
        "skipped = width - inputs.kept  # positions before the first with logits",
        "skipped = 0  # positions before the first with logits",
        ("tests/test_ort_batch.py",),
    ),
    # -- the shared-KV drafter in batches: each sequence's drafter reads its own slot ------------------------------
    "slot-drafter-reads-slot-0s-kv": Mutant(
        "backends/onnx/batch.py",
        'return int((self.keys if which == "key" else self.values)[layer][slot, head].ctypes.data)',
        'return int((self.keys if which == "key" else self.values)[layer][0, head].ctypes.data)',
        ("tests/test_batch_drafter.py::test_each_slots_drafter_reads_its_own_slot",),
    ),
    "slot-drafter-reads-another-slots-hidden-state": Mutant(
        "backends/onnx/batch.py",
        "first, rows = self._hidden.get(slot, (0, np.empty((0, 0))))",
        "first, rows = self._hidden.get(min(self._hidden, default=slot), (0, np.empty((0, 0))))",
        ("tests/test_batch_drafter.py",),
    ),
    "draft-context-after-keeps-the-slot": Mutant(
        "core/proposers.py",
        "return attrs.evolve(self, tokens=(*self.tokens, *drafted), width=self.width - n, slot=None, nodes=nodes)",
        "return attrs.evolve(self, tokens=(*self.tokens, *drafted), width=self.width - n, nodes=nodes)",
    ),
    "auto-lets-the-drafter-draft-without-target-state": Mutant(
        "core/lookup_or_draft.py",
        "if draft and (context.slot is None or _rate(policy) >= _rate(getattr(self, _POLICY[model]))):",
        "if draft and _rate(policy) >= _rate(getattr(self, _POLICY[model])):",
        ("tests/test_draft_context.py",),
    ),
    "probes-ignore-the-catch-up": Mutant(
        "core/width.py",
        "cost = self.pass_costs[width] + width * self.draft_cost + self.catch_up()",
        "cost = self.pass_costs[width] + width * self.draft_cost",
        ("tests/test_proposers.py",),
    ),
    "the-draft-model-starts-with-nothing-unread": Mutant(
        "core/speculative.py",
        "unread=sources.context_tokens,",
        "unread=0,",
        ("tests/test_speculative.py",),
    ),
    "auto-forgets-what-the-draft-model-did-not-read": Mutant(
        "core/lookup_or_draft.py",
        'changes["draft_model_policy"] = learned.draft_model_policy.behind(accepted + 1)',
        "pass",
        ("tests/test_proposers.py",),
    ),
    "auto-never-drafts-with-the-draft-model-beside-a-drafter": Mutant(
        "core/lookup_or_draft.py",
        "if self.draft_model is not None and _rate(self.draft_model_policy) > _rate(self.drafter_policy):",
        "if False:",
        ("tests/test_proposers.py",),
    ),
    "speculation-drafts-without-the-slot": Mutant(
        "ortspec/speculation.py",
        "context = DraftContext(tokens, width, plain_cost, slot, self.picker, nodes, slot, token_cost)",
        "context = DraftContext(tokens, width, plain_cost, None, self.picker, nodes, slot, token_cost)",
    ),
    "batch-slots-floor-each-workers-share": Mutant(
        "adapters/batch/worker.py",
        "share = -(-tasks // max(workers, 1))",
        "share = tasks // max(workers, 1)",
    ),
    "batch-kv-forgets-max-tokens": Mutant(
        "adapters/batch/worker.py",
        "needs.append(len(ids) + options.max_tokens)",
        "needs.append(len(ids))",
    ),
    "batch-driver-drafts-in-slot-0": Mutant(
        "ortspec/sequence.py",
        "self._context, self._draft = self._speculation.draft(state, vocab_size, plain_cost, self._slot, token_cost)",
        "self._context, self._draft = self._speculation.draft(state, vocab_size, plain_cost, 0, token_cost)",
        ("tests/test_batch_drafter.py",),
    ),
    "batch-driver-rows-to-the-wrong-sequence": Mutant(
        "ortspec/batch_driver.py",
        "for (sequence, row), logits in zip(batch, outputs, strict=True):",
        "for (sequence, row), logits in zip(batch, outputs[::-1], strict=True):",
    ),
    "batch-driver-delivers-after-cancel": Mutant(
        "ortspec/sequence.py",
        "        while self._undelivered and not self._cancelled:\n            commit = self._undelivered.popleft()",
        "        while self._undelivered:\n            commit = self._undelivered.popleft()",
    ),
    "batch-driver-prices-every-step-as-alone": Mutant(
        "ortspec/batch_driver.py",
        "return mean_row_cost(self.decode_costs, sum(s.phase is Phase.DECODING for s in self._running))",
        "return 1.0",
    ),
    "batch-driver-prices-by-the-slots-not-the-load": Mutant(
        "ortspec/batch_driver.py",
        "return mean_row_cost(self.decode_costs, sum(s.phase is Phase.DECODING for s in self._running))",
        "return mean_row_cost(self.decode_costs, self._backend.slots)",
    ),
    "width-prices-batched-drafts-as-alone": Mutant(
        "core/width.py",
        "return min(pass_costs[k], plain_cost + k * token_cost)",
        "return pass_costs[k]",
        ("tests/test_batch_driver.py",),
    ),
    "batch-driver-prices-batched-drafts-as-alone": Mutant(
        "ortspec/batch_driver.py",
        "if not self.batched_drafts or self.decode_costs is None:",
        "if True:",
    ),
    # -- the ragged batch backend: rows of any lengths in one session run ------------------------------------------
    "ragged-pass-writes-padding-as-tokens": Mutant(
        "backends/onnx/pass_inputs.py",
        "filled = starts + (width if valid is None else valid)",
        "filled = starts + width",
        ("tests/test_ort_batch.py",),
    ),
    "ragged-groups-ignore-the-capacity": Mutant(
        "backends/onnx/pass_inputs.py",
        "if furthest + width > max_length:",
        "if False:",
        ("tests/test_ort_batch.py",),
    ),
    "ragged-tree-bias-lands-on-the-first-row": Mutant(
        "backends/onnx/pass_inputs.py",
        "self.tree_bias[b, 0, : n + 1, start : start + n + 1][hidden] = -np.inf",
        "self.tree_bias[0, 0, : n + 1, start : start + n + 1][hidden] = -np.inf",
        ("tests/test_ort_tree_rows.py",),
    ),
    "one-sequence-tree-keeps-no-path": Mutant(
        "backends/onnx/backend.py",
        "self.kv.move_positions(moves)",
        "self.kv.move_positions([])",
        ("tests/test_ort_tree_rows.py",),
    ),
    "tree-budget-prices-batched-nodes-as-alone": Mutant(
        "core/width.py",
        "return (chain + gain * (n - width)) / pass_cost(self.pass_costs, n, plain_cost, token_cost), -n",
        "return (chain + gain * (n - width)) / self.pass_costs[n], -n",
        ("tests/test_tree_budget.py",),
    ),
    # -- the batch driver's prompt-token budget per pass ------------------------------------------------------------
    "batch-driver-ignores-the-prefill-budget": Mutant(
        "ortspec/batch_driver.py",
        "budget = _PromptBudget(self.prefill_budget)",
        "budget = _PromptBudget(None)",
    ),
    "batch-driver-leaves-decoding-rows-out-once-the-budget-is-spent": Mutant(
        "ortspec/batch_driver.py",
        "if sequence.phase is Phase.PREFILL and chunk == 0:",
        "if chunk == 0 and (sequence.phase is Phase.PREFILL or budget.take(1) == 0):",
    ),
    "batch-driver-decoding-rows-spend-the-prefill-budget": Mutant(
        "ortspec/batch_driver.py",
        "chunk = budget.take(min(self.prefill_chunk, sequence._prompt_left))",
        "chunk = budget.take(min(self.prefill_chunk, sequence._prompt_left or 1))",
    ),
    # -- the batch driver's prefix reuse per slot -----------------------------------------------------------------
    "batch-driver-reuses-one-token-too-many": Mutant(
        "ortspec/sequence.py",
        "state = reusing(self.state, common_prefix_length(resident, self.state.prompt_tokens))",
        "state = reusing(self.state, common_prefix_length(resident, self.state.prompt_tokens) + 1)",
    ),
    "reuse-the-whole-prompt": Mutant(
        "core/prefix.py",
        'return min(check_int("cached_prefix", cached_prefix, 0), prompt_len - 1)',
        'return min(check_int("cached_prefix", cached_prefix, 0), prompt_len)',
    ),
    "batch-driver-routes-to-the-lowest-free-slot": Mutant(
        "ortspec/batch_driver.py",
        "return max(self._free, key=lambda s: (reuse_score(self._resident[s], prompt), -self._released_at[s], -s))",
        "return min(self._free)",
    ),
    "batch-driver-most-recently-released-on-ties": Mutant(
        "ortspec/batch_driver.py",
        "(reuse_score(self._resident[s], prompt), -self._released_at[s], -s)",
        "(reuse_score(self._resident[s], prompt), self._released_at[s], -s)",
    ),
    "batch-driver-trusts-a-slot-after-a-foreign-failure": Mutant(
        "ortspec/batch_driver.py",
        "self._resident[slot] = self._held_by(sequence) if known else ()",
        "self._resident[slot] = self._held_by(sequence)",
    ),
    # -- the server's queue limit (adapters/serve/jobs.py: every pool's) -------------------------------------------
    "serve-queue-admits-one-too-many": Mutant(
        "adapters/serve/jobs.py",
        "return len(self._jobs) >= self.parallel + self.max_queue",
        "return len(self._jobs) > self.parallel + self.max_queue",
        ("tests/test_server.py::test_full_queue_is_a_429_with_retry_after",),
    ),
    # -- the routing score the batch driver uses to pick a slot (core/prefix.py) --------------------------------
    "prefix-score-ignores-the-shared-prefix": Mutant(
        "core/prefix.py",
        "return 2 * common_prefix_length(resident, prompt) - len(resident)",
        "return -len(resident)",
    ),
    "prefix-score-ignores-the-kv-it-drops": Mutant(
        "core/prefix.py",
        "return 2 * common_prefix_length(resident, prompt) - len(resident)",
        "return common_prefix_length(resident, prompt)",
    ),
    # -- the batch runner's resume (adapters/batch/) ------------------------------------------------------------
    "batch-resume-reruns-done-records": Mutant(
        "adapters/batch/run.py",
        "todo = [t for t in tasks if t.key not in state.done]",
        "todo = list(tasks)",
    ),
    "batch-resume-rewrites-bad-input-lines": Mutant(
        "adapters/batch/run.py",
        'bad_todo = [e for e in bad if record_key(e["id"], e["line"]) not in state.done]',
        "bad_todo = list(bad)",
    ),
    "batch-resume-keeps-a-partial-line": Mutant(
        "adapters/batch/output.py",
        "if tail or (retry_errors and state.errors):",
        "if retry_errors and state.errors:",
    ),
    "batch-resume-retries-errors-unasked": Mutant(
        "adapters/batch/run.py",
        "state = prepare_output(job.output_path, retry_errors=job.retry_errors)",
        "state = prepare_output(job.output_path, retry_errors=True)",
    ),
    "batch-resume-confuses-1-and-quoted-1": Mutant(
        "adapters/batch/records.py",
        'return f"#line {line}" if record_id is None else json.dumps(record_id, ensure_ascii=False)',
        'return f"#line {line}" if record_id is None else str(record_id)',
    ),
    # -- the batch runner's workers on the batch driver (adapters/batch/) -----------------------------------------
    "batch-slots-defaults-override-the-record": Mutant(
        "adapters/batch/worker.py",
        "return GenerationOptions(**{**defaults, **task.options})",
        "return GenerationOptions(**{**task.options, **defaults})",
        ("tests/test_batch_slots.py::test_a_records_own_fields_beat_the_jobs_defaults",),
    ),
    "batch-opens-the-drafter-for-no-record": Mutant(
        "adapters/batch/worker.py",
        "drafter = job.drafter if needs_drafter(defaults, tasks) else False",
        "drafter = job.drafter",
        ("tests/test_batch.py::test_the_drafter_is_opened_only_when_a_record_drafts_with_it",),
    ),
    "batch-one-worker-runs-in-a-worker-process": Mutant(
        "adapters/batch/local.py",
        "if workers == 1:",
        "if workers == 0:",
        ("tests/test_batch.py::test_one_worker_runs_in_this_process",),
    ),
    "batch-slots-dead-worker-blames-the-first-of-several": Mutant(
        "adapters/batch/local.py",
        "if len(held) == 1:",
        "if held:",
    ),
    # -- train-drafter: the head copies layer L as the target computes it, and refuses what it cannot -------------
    "drafter-window-counts-the-query-twice": Mutant(
        "backends/onnx/drafter_support.py",
        "window=max(window - 1, 0),  # GroupQueryAttention's window counts the query's own position",
        "window=max(window, 0),",
        ("tests/test_drafter_architectures.py::test_the_copied_layer_is_the_targets",),
    ),
    "drafter-reads-a-layer-without-kv": Mutant(
        "backends/onnx/drafter_support.py",
        "if layer not in target.kv_layers:",
        "if False:",
        ("tests/test_drafter_architectures.py",),
    ),
}


def stage(tmp: Path, mutant: Mutant | None) -> Path:
    """A copy of the package laid out as installed (ortspec/, ortspec/core, ...) with ``mutant`` applied (none for
    the baseline), and the tests beside it. Returns the folder to put on PYTHONPATH."""
    site = tmp / "site"
    pkg = site / "ortspec"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "ortspec", pkg, ignore=ignore)
    for sub in ("core", "backends", "adapters"):
        shutil.copytree(ROOT / sub, pkg / sub, ignore=ignore)
    for sub in ("tests", "property_tests", "bench"):  # some tests drive bench/ scripts
        shutil.copytree(ROOT / sub, tmp / sub, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")  # markers and pytest options
    if mutant is not None:
        path = site / mutant.file if mutant.file.startswith("ortspec/") else pkg / mutant.file
        text = path.read_text()
        if text.count(mutant.old) != 1:
            raise SystemExit(f"mutation anchor not found exactly once in {mutant.file}: {mutant.old!r}")
        path.write_text(text.replace(mutant.old, mutant.new))
    return site


class Verdict(NamedTuple):
    caught_by: str | None  # the first failing test (node id), or None
    summary: str  # pytest's last line


def run_tests(tmp: Path, site: Path, paths: tuple[str, ...], profile: str) -> Verdict:
    """Run ``paths`` with ``-x`` against the staged package under Hypothesis ``profile``."""
    env = dict(os.environ, PYTHONPATH=str(site), HYPOTHESIS_PROFILE=profile)
    probe = subprocess.run(
        [sys.executable, "-c", "import ortspec.core.state as s; print(s.__file__)"],
        cwd=tmp, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if not probe.stdout.strip().startswith(str(site)):  # the editable install must not shadow the staged copy
        raise SystemExit(f"staged package not imported first: {probe.stdout or probe.stderr}")
    missing = [p for p in paths if not (tmp / p.split("::")[0]).exists()]
    if missing:
        raise SystemExit(f"test paths not found: {missing}; re-point UNIT_TESTS or the mutant")
    # The real model's tests are left out: minutes each, and the fake and tiny models reach every rule.
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "not real_model", *paths]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    if failed is None and proc.returncode not in (0, 5):  # 5: nothing collected
        summary = f"exit status {proc.returncode}: {summary}"
    return Verdict(failed.group(1) if failed else None, summary)


def check(name: str, mutant: Mutant, *, full: bool = True) -> tuple[Verdict, str]:
    """Stage ``mutant`` and run its tests: the unit tests and (core, driver) the property suite under the quick
    profile, then, if nothing failed and ``full``, the property suite with the full example counts. Returns the
    verdict and the round that decided it."""
    with tempfile.TemporaryDirectory(prefix=f"ortspec-mutant-{name}-") as tmp_str:
        tmp = Path(tmp_str)
        site = stage(tmp, mutant)
        verdict = run_tests(tmp, site, (*mutant.unit_tests, *mutant.property_tests), "quick")
        if verdict.caught_by or not mutant.property_tests or not full:
            return verdict, "quick"
        return run_tests(tmp, site, mutant.property_tests, "mutation"), "full"


def baseline(names: list[str]) -> Verdict:
    """The selected mutants' tests on the unmodified package, quick profile: every one must pass."""
    paths = list(dict.fromkeys(p for n in names for p in MUTANTS[n].unit_tests))
    paths += list(dict.fromkeys(p for n in names for p in MUTANTS[n].property_tests))
    with tempfile.TemporaryDirectory(prefix="ortspec-mutant-baseline-") as tmp_str:
        tmp = Path(tmp_str)
        return run_tests(tmp, stage(tmp, None), tuple(paths), "quick")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified package")
    parser.add_argument("--quick", action="store_true", help="the quick round only (a survivor there is missed)")
    parser.add_argument("mutants", nargs="*", help="names (default: all)")
    args = parser.parse_args()
    if args.list:
        for name, m in MUTANTS.items():
            print(f"{name:48s} {m.file:20s} {' '.join(m.unit_tests + m.property_tests)}")
        return 0
    names = args.mutants or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise SystemExit(f"unknown mutants: {unknown}; --list shows them")
    t_all = time.perf_counter()
    if not args.no_baseline:
        t0 = time.perf_counter()
        base = baseline(names)
        print(f"baseline (no mutant) {time.perf_counter() - t0:6.1f} s  {base.summary}", flush=True)
        if base.caught_by or "passed" not in base.summary:
            print(f"the tests fail without a mutant ({base.caught_by or base.summary}): fix them first")
            return 2
    missed = []
    for name in names:
        t0 = time.perf_counter()
        verdict, round_ = check(name, MUTANTS[name], full=not args.quick)
        if verdict.caught_by:
            outcome = f"CAUGHT  {name:48s} {time.perf_counter() - t0:6.1f} s  by {verdict.caught_by} ({round_} run)"
        else:
            outcome = f"MISSED  {name:48s} {time.perf_counter() - t0:6.1f} s  ({verdict.summary})"
            missed.append(name)
        print(outcome, flush=True)
    print(f"{len(names) - len(missed)}/{len(names)} mutants caught by the unit tests and the property suite "
          f"in {time.perf_counter() - t_all:.0f} s" + (f"; missed: {', '.join(missed)}" if missed else ""))  # fmt: skip
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
