"""Every rule of speculative decoding (greedy or seeded sampling), in one place, with no I/O.

Rule 1: everything that decides what is committed lives in this file: which draft tokens are accepted, which
candidates are committed and in what order the stop rules see them, when a generation ends and why, how many
draft tokens a step may verify, how much KV the backend keeps, what text is released to the stream, and what a
partly delivered generation reports. The driver, the backends and the Engine only carry these decisions out.
Four pieces of arithmetic are kept apart, each called from here: a single pick (processors, filters, the seeded
draw; ``core/sampling.py``, a pure function of one row), the walk down a draft, chain or tree, that yields the
candidates (``core/tree.py``), a step's text (incremental detokenization, the stop-string search and hold-back;
``core/text.py``), and a grammar's position and mask (``core/constraint.py``).

Theory of operation
-------------------
A generation is a ``DecodeState``: the prompt, the tokens committed so far, their text, and (once it ends) why
it ended. The state is frozen; ``step`` returns a new one. Nothing here touches a device: a backend computes
logits, this module decides what they mean.

The context limit is fixed when the generation starts: the smaller of ``Options.max_context`` and the backend's
KV ``capacity``. A prompt longer than the limit is refused; a prompt that fills it ends at once with
``CONTEXT_FULL`` and no token.

The KV cache trails the committed tokens by exactly one. Between steps the backend holds the KV of
``prompt + generated[:-1]`` (``state.kv_len`` positions) and the last committed token is *pending*. One step is
one target pass over ``(pending, *draft)``: row 0 of that pass (``base_logits``) predicts the first uncommitted
position, and row ``i + 1`` (``rows[i]``) predicts the position after ``draft[i]``. Plain decoding is the
same step with an empty draft.

From the K + 1 rows the step takes the target's picks: the argmax (lowest id on ties) when decoding greedily, or
a seeded draw that is a pure function of (the processed row, the seed, the token's index) when sampling, so a
verify row yields exactly the token plain decoding would pick at that position. ``picks[0]`` is what plain
decoding would emit next; ``picks[i]`` for ``i >= 1`` is what it would emit after ``draft[:i]``, so the step may
use it only while ``draft[:i]`` equals ``picks[:i]``. The committed candidates are therefore
``picks[0 .. accepted]``: the accepted draft tokens followed by one free *bonus* token. A device backend may make
the picks itself (``step_from_picks``); the rules after the picks are the same code.

Each candidate then passes the commit rules, one token at a time and in this order, even in the middle of a
block: EOS (the EOS token is kept), stop token sequences, stop strings (the earliest completion in the text wins
and the text is cut before it), a grammar that is complete (``GRAMMAR_COMPLETE``), ``max_tokens``
(``MAX_TOKENS``), the context limit (``CONTEXT_FULL``). The
first rule that fires ends the generation, and no candidate after that token is ever committed. Because the
rules see the same tokens in the same order whatever the draft was, speculative and plain runs end identically.

A draft may hold at most ``draft_budget(state)`` tokens: every one of them, and the bonus token, could still be
committed within ``max_tokens`` and the context limit. So no pass writes a KV position past either bound.

Trees (``core/tree.py``). A draft may also be a ``DraftTree``: candidate continuations sharing prefixes, verified in
one pass over ``(pending, *tree.tokens)`` where each row sees only the context, itself and its ancestors
(``tree_mask``) at the position of its depth, so ``rows[j]`` predicts the position after node ``j``'s path. The
accept rule walks down from the base row: while the current node has a child whose token equals the last pick (the
lowest-index such child), move to it and pick from its row, with that node's path as the draft prefix (the seeded
draw's index is its depth, the grammar's mask is after its path), exactly as a chain picks row ``i`` after
``draft[:i]``. The picks along that path are the candidates, and every rule after acceptance is the chain's. Its
node count is bounded by ``draft_budget`` (every position it writes stays in bounds). The accepted path's KV was
written at ``kv_len + 1 + node``; ``StepOutcome.kept_nodes`` names the nodes to move to ``kv_len + 1 + depth``
before the rewind (for a chain, nothing moves).

The step returns ``rewind_to``, the KV length the backend must keep: ``kv_len`` of the new state. The pass left
``kv_len + 1 + K`` positions; the committed ones stay, and the last committed token becomes the next pending
token (it is re-fed, so its KV entry is recomputed by the next pass).

Structured outputs (``Options.grammar``). Every row is masked by the grammar's state after the tokens before that
row (``generated + draft[:i]``): the picks are plain constrained decoding's, and a draft the grammar forbids is
simply not accepted. EOS is allowed only where the grammar accepts. The rules are in ``core/constraint.py``.

Near ties (opt-in, ``Options.tie_margin``). A K-token pass can round differently from a 1-token pass and flip an
argmax whose top two logits almost tie. With the guard on, a pick from a multi-token pass whose margin is below
the threshold is not committed: the step ends before it, and when that is the very first pick the state asks for
a plain step next (``draft_budget`` is 0), whose 1-token pass decides it exactly as plain decoding would.

Non-finite rows. A pick whose row is not finite there (a NaN anywhere, a top of +inf, every logit -inf) is never
turned into a token. A plain step raises ``ValueError``. In a multi-token pass the block ends before such a row
(the picks before it are committed) and the next step is plain, so the error is raised exactly where plain
decoding raises it, after the same tokens.

Text. With a ``detokenize`` function (ids -> str), text is decoded incrementally over a sliding window of
tokens, so each token's text delta costs O(window); a delta ending in U+FFFD (a partial UTF-8 character) waits
for the next token. Text that could still become part of a stop string is held back from the stream until it
cannot. Every commit carries the text it releases; the concatenated deltas always equal ``state.text``. A
consumer that stops reading in the middle of a step has seen less than the state holds: ``delivered`` says what.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import attrs
import numpy as np

from .checks import ArgumentError, check_int, ids_in_vocab, token_ids
from .constraint import Constraint
from .options import Options
from .prefix import reused_length
from .sampling import NonFiniteRow, Pick, StepContext
from .text import TextTracker
from .tokens import Shared
from .tree import Draft, DraftTree, walk, walk_chain
from .width import acceptance_rate

Detokenize = Callable[[Sequence[int]], str]


class FinishReason(enum.StrEnum):
    """Why a generation ended. ``openai`` is the OpenAI API's word for it (the one place they are mapped)."""

    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"  # a stop token sequence or a stop string
    MAX_TOKENS = "max_tokens"  # Options.max_tokens tokens were generated
    CONTEXT_FULL = "context_full"  # prompt + generated tokens reached the context limit
    GRAMMAR_COMPLETE = "grammar_complete"  # the output is a complete match of Options.grammar that nothing extends

    @property
    def openai(self) -> str:
        """``"stop"`` (EOS, a stop sequence, a complete grammar) or ``"length"`` (a token or context limit)."""
        return "length" if self in (FinishReason.MAX_TOKENS, FinishReason.CONTEXT_FULL) else "stop"


@attrs.frozen
class Stats:
    """Counters of one generation. Every step is exactly one target pass (the driver's prompt pass is the first
    step), so ``steps`` counts target passes. A verification step is a step with a non-empty draft."""

    steps: int = 0
    verification_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    multi_token_accepts: int = 0
    tie_guard_stops: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ proposed draft tokens (0.0 when nothing was proposed)."""
        return acceptance_rate(self.accepted_tokens, self.proposed_tokens)


class StepOutcome(NamedTuple):
    """What one step decided: the new ``state``; the ``commits`` it released, in order; ``rewind_to``, the KV length
    the backend must keep; ``accepted``, how many draft tokens were committed (the bonus token not counted);
    ``kept_nodes``, the draft nodes whose KV stays, in depth order: the accepted path's nodes below ``rewind_to``
    (for a chain ``0, 1, ...``, already in place). Before rewinding to ``rewind_to``, the backend moves KV position
    ``kv_len + 1 + kept_nodes[d]`` to ``kv_len + 1 + d`` (``kv_len`` of the state stepped from) for each ``d``
    where the two differ."""

    state: DecodeState
    commits: tuple[Commit, ...]
    rewind_to: int
    accepted: int
    kept_nodes: tuple[int, ...] = ()


@attrs.frozen
class TokenLogprob:
    """A committed token's log-probability under the row that produced it, and the ``top`` alternatives as
    ``(token_id, logprob)`` pairs, most likely first (lowest id first on ties)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class Commit:
    """One committed token and the text it releases to the stream (often '' while text is held back)."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None


def _shared_ids(value: Iterable[int]) -> Shared[int]:
    return Shared.of(value)


def _shared_logprobs(value: Iterable[TokenLogprob]) -> Shared[TokenLogprob]:
    return Shared.of(value)


@attrs.frozen
class DecodeState:
    """One generation's decisions so far. Build it with ``DecodeState.start``; advance it with ``step``.

    ``text`` is the generated text decoded so far (cut before the stop string once one matched);
    ``streamed_chars`` of it have been released through commits. ``finish_reason`` is None while running;
    ``stop_matched`` names the stop string or token sequence that ended it. ``capacity`` is the backend's KV
    capacity in positions (None: unbounded).
    """

    prompt_tokens: tuple[int, ...]
    options: Options
    detokenize: Detokenize | None = attrs.field(default=None, eq=False, repr=False)
    capacity: int | None = None
    cached_prefix: int = 0  # leading prompt tokens whose KV the prompt pass reuses (see ``start``)
    # Shared sequences (core/tokens.py): a step extends them in O(1) instead of copying the whole history.
    generated_tokens: Shared[int] = attrs.field(factory=Shared, converter=_shared_ids)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_matched: str | tuple[int, ...] | None = None
    stats: Stats = Stats()
    logprobs: Shared[TokenLogprob] = attrs.field(factory=Shared, converter=_shared_logprobs)
    streamed_chars: int = 0
    # Incremental detokenization: the text of generated[_detok_start:_detok_end] is already in `text`.
    _detok_start: int = 0
    _detok_end: int = 0
    # Set when the tie guard refused the first pick of a multi-token pass: the next step must be plain.
    _plain_step_next: bool = False
    # The grammar's position (core/constraint.py), opened from options.grammar by ``start``; None: unconstrained.
    constraint: Constraint | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def start(
        cls,
        prompt_tokens: Sequence[int],
        options: Options,
        detokenize: Detokenize | None = None,
        *,
        capacity: int | None = None,
        vocab_size: int | None = None,
        cached_prefix: int = 0,
    ) -> DecodeState:
        """The state before the first step. ``capacity``: the backend's KV capacity in positions;
        ``vocab_size``: the model's vocabulary (prompt ids, stop sequences and biased ids must lie in it);
        ``cached_prefix``: how many leading prompt tokens the backend already holds the KV of (the caller vouches);
        the prompt pass reuses at most all but the last prompt token (``cached_prefix`` of the state, as
        ``core.prefix.reused_length`` says), whose row picks the first token.

        Raises ``ValueError`` for an empty prompt, a prompt id outside the vocabulary, a prompt longer than the
        context limit, or stop strings without a ``detokenize`` function. A prompt that fills the context limit
        gives a state that has already finished (``CONTEXT_FULL``, no token), as does a grammar that the empty
        output completes (``GRAMMAR_COMPLETE``)."""
        if not isinstance(options, Options):
            raise ValueError(f"options must be an ortspec Options, got {type(options).__name__}")
        if isinstance(prompt_tokens, (str, bytes)):
            raise ArgumentError("prompt_tokens", "prompt_tokens must be token ids, not text (tokenize it first)")
        if vocab_size is None:
            prompt = token_ids("prompt_tokens", prompt_tokens)
        else:
            vocab_size = check_int("vocab_size", vocab_size, 1)
            prompt = ids_in_vocab("prompt_tokens", prompt_tokens, vocab_size)
            ids_in_vocab("logit_bias", [token for token, _ in options.sampling.logit_bias], vocab_size)
            ids_in_vocab("stop", [t for seq in options.stop_token_sequences for t in seq], vocab_size)
        if not prompt:
            raise ArgumentError("prompt_tokens", "prompt_tokens is empty: generation needs at least one prompt token")
        if options.stop_strings and detokenize is None:
            raise ArgumentError("stop", "stop strings need a detokenize function (ids -> str) to see the text")
        if detokenize is not None and not callable(detokenize):
            raise ValueError("detokenize must be a callable ids -> str")
        if capacity is not None:
            capacity = check_int("capacity", capacity, 1)
        cached = reused_length(cached_prefix, len(prompt))
        grammar = options.grammar
        constraint = Constraint(grammar.matcher()) if grammar is not None else None
        state = cls(
            prompt_tokens=prompt,
            options=options,
            detokenize=detokenize,
            capacity=capacity,
            cached_prefix=cached,
            constraint=constraint,
        )
        limit = state.context_limit
        bound = "max_context" if limit == options.max_context else "the context (the KV capacity)"
        check_prompt_fits(len(prompt), limit, holds=f"{bound} is {limit}")
        if constraint is not None and constraint.complete(()):  # the empty output already completes the grammar
            state = attrs.evolve(state, finish_reason=FinishReason.GRAMMAR_COMPLETE)
        elif len(prompt) == state.context_limit:
            state = attrs.evolve(state, finish_reason=FinishReason.CONTEXT_FULL)
        return state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_limit(self) -> int | None:
        """The most prompt + generated tokens: the smaller of ``options.max_context`` and ``capacity``."""
        bounds = [b for b in (self.options.max_context, self.capacity) if b is not None]
        return min(bounds) if bounds else None

    @property
    def context_len(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_tokens) + len(self.generated_tokens)

    @property
    def kv_len(self) -> int:
        """KV positions the backend holds between steps: all tokens but the pending (last) one."""
        return self.context_len - 1

    @property
    def pending_token(self) -> int:
        """The committed token the next pass must feed first."""
        return self.generated_tokens[-1] if self.generated_tokens else self.prompt_tokens[-1]

    @property
    def plain_step_next(self) -> bool:
        """True when the tie guard refused the first pick of the last pass: the next step must be plain."""
        return self._plain_step_next

    @property
    def context_tokens(self) -> Shared[int]:
        """Prompt + generated tokens: what a proposer sees (a ``Shared`` sequence, made in O(1))."""
        return self.generated_tokens.with_head(self.prompt_tokens)

    @property
    def streamed_text(self) -> str:
        return self.text[: self.streamed_chars]


def check_prompt_fits(
    prompt_len: int,
    context_limit: int | None,
    *,
    holds: str,
    advice: str = "shorten the prompt",
    argument: str = "prompt_tokens",
) -> None:
    """The one prompt-length rule: ``ValueError`` unless a prompt of ``prompt_len`` tokens fits ``context_limit``
    (None: no limit). The message reads "the prompt has N tokens but {holds}: {advice}" (``holds`` names the
    bound, e.g. "max_context is 3"; ``argument``: the keyword the error names). A prompt that fills the limit
    exactly fits (it ends at once)."""
    if context_limit is not None and prompt_len > context_limit:
        raise ArgumentError(argument, f"the prompt has {prompt_len} tokens but {holds}: {advice}")


def draft_budget(state: DecodeState) -> int:
    """The most draft tokens (a tree's nodes) the next step may verify: every one of them could still be committed,
    bonus included, within ``max_tokens`` and the context limit. 0 means a plain step."""
    if state.finished or state._plain_step_next:
        return 0
    budget = state.options.max_tokens - len(state.generated_tokens) - 1
    limit = state.context_limit
    if limit is not None:
        budget = min(budget, limit - state.context_len - 1)
    return max(budget, 0)


def draft_width(state: DecodeState, policy_width: int) -> int:
    """How many draft tokens to ask a proposer for: the width policy's choice, capped by ``draft_budget``."""
    return min(draft_budget(state), policy_width)


def take_draft(
    state: DecodeState,
    proposal: Iterable[int] | DraftTree,
    width: int,
    vocab_size: int,
    *,
    trees: bool = False,
    nodes: int | None = None,
) -> Draft:
    """A proposer's answer as the next step's draft: cut to ``width`` (longer proposals are truncated; a tree to its
    first ``nodes`` nodes (None: ``width``) less than ``width`` deep), then checked by ``check_draft``. A
    ``DraftTree`` is reduced to its ``first_branch`` unless ``trees`` (the backend runs tree rows), and one with a
    single branch becomes the chain it is."""
    if isinstance(proposal, DraftTree):
        tree = (proposal if trees else proposal.first_branch()).within(max(nodes or width, width), width)
        return check_draft(state, tree.tokens if tree.is_chain else tree, vocab_size)
    return check_draft(state, tuple(proposal)[:width], vocab_size)


def check_draft(state: DecodeState, draft: Sequence[int] | DraftTree, vocab_size: int) -> Draft:
    """Validate a proposed draft for the next step; return it as a tuple of ints (a tree as it is).

    Raises ``ValueError`` for a finished state, an id outside ``[0, vocab_size)``, or a draft of more tokens (a
    tree of more nodes) than ``draft_budget(state)``."""
    if state.finished:
        raise ValueError(f"the generation already finished ({state.finish_reason})")
    if isinstance(draft, DraftTree):
        ids_in_vocab("draft", draft.tokens, vocab_size)
        if len(draft) > draft_budget(state):
            raise ArgumentError(
                "draft", f"a draft tree of {len(draft)} nodes exceeds this step's budget of {draft_budget(state)}"
            )
        return draft
    ids = ids_in_vocab("draft", draft, vocab_size)
    if len(ids) > draft_budget(state):
        raise ArgumentError(
            "draft", f"a draft of {len(ids)} tokens exceeds this step's budget of {draft_budget(state)}"
        )
    return ids


def step(
    state: DecodeState,
    base_logits: np.ndarray,
    rows: np.ndarray | None,
    draft: Sequence[int] | DraftTree,
) -> StepOutcome:
    """Advance by one target pass over ``(pending, *draft)`` (a tree: ``(pending, *draft.tokens)``).

    ``base_logits``: ``[vocab]`` logits for the first uncommitted position; ``rows``: ``[K, vocab]``, row ``i``
    after ``draft[i]`` (a tree of K nodes: after node ``i``'s path), ``None`` or empty when K = 0. Returns a
    ``StepOutcome``: ``(state, commits, rewind_to, accepted)`` and ``kept_nodes``. The arrays
    are read, never kept or modified. Raises ``ValueError`` on shapes that do not match the draft, ids outside
    the vocabulary, or a non-finite logit where a pick is made.
    """
    base = np.asarray(base_logits)
    if base.ndim != 1 or base.shape[0] < 1:
        raise ValueError(f"base_logits must have shape [vocab], got {base.shape}")
    vocab = base.shape[0]
    draft = check_draft(state, draft, vocab)
    bias = state.options.sampling.logit_bias
    if bias and bias[-1][0] >= vocab:
        raise ArgumentError("logit_bias", f"logit_bias names token id {bias[-1][0]}, outside the vocabulary")
    k = len(draft)
    if k == 0:
        if rows is not None and np.asarray(rows).size != 0:
            raise ValueError(f"rows must be empty for an empty draft, got shape {np.asarray(rows).shape}")
        all_rows: list[np.ndarray] = [base]
    else:
        rows = np.asarray(rows) if rows is not None else np.empty((0, vocab))
        if rows.shape != (k, vocab):
            raise ValueError(f"rows must have shape [{k}, {vocab}] for a draft of {k} tokens, got {rows.shape}")
        all_rows = [base, *rows]

    context = StepContext(state.options.sampling, state.prompt_tokens, state.generated_tokens)
    want_margin = bool(k) and state.options.tie_margin > 0
    constraint, generated, eos_ids = state.constraint, state.generated_tokens, state.options.eos_token_ids
    picks: dict[int, Pick] = {}

    def row_pick(i: int) -> Pick:
        if i not in picks:
            top_n = state.options.top_logprobs
            drafted = draft.before(i) if isinstance(draft, DraftTree) else draft[:i]  # the tokens before row i
            allowed = None if constraint is None else constraint.allowed(generated, drafted, eos_ids)
            index = len(drafted)  # the pick's index among the generated tokens, after the step's first
            picks[i] = context.pick(all_rows[i], index, drafted, margin=want_margin, top_n=top_n, allowed=allowed)
        return picks[i]

    def logprob(i: int, token: int) -> TokenLogprob:
        p = row_pick(i)
        return TokenLogprob(token_id=token, logprob=p.logprob, top=p.top)

    return _advance(
        state,
        draft,
        lambda i: row_pick(i).token,
        lambda i: row_pick(i).margin,
        logprob if state.options.top_logprobs else None,
    )


def step_from_picks(
    state: DecodeState,
    picks: Sequence[int] | np.ndarray,
    draft: Sequence[int] | DraftTree,
    *,
    vocab_size: int,
    margins: Sequence[float] | np.ndarray | None = None,
) -> StepOutcome:
    """``step`` with the K + 1 target picks already made where the logits live (a device-side argmax):
    ``picks[0]`` from the base row, ``picks[i + 1]`` after ``draft[i]`` (a tree's node ``i``), each the row's argmax
    (lowest id on ties). ``margins`` (top-1 minus top-2 logit per row) feed the tie guard; a NaN margin marks a row
    that is not finite where its pick is made, which is refused as ``step`` refuses it. Logprobs need the logits, so
    ``top_logprobs`` > 0 is refused here."""
    if state.options.top_logprobs:
        raise ValueError("step_from_picks cannot report logprobs (it has no logits); use step()")
    if not state.options.device_picks_suffice:
        raise ValueError("step_from_picks takes argmax picks: sampling, penalties, logit_bias, grammars need step()")
    draft = check_draft(state, draft, vocab_size)
    ids = ids_in_vocab("picks", picks, vocab_size)
    if len(ids) != len(draft) + 1:
        raise ValueError(f"picks must hold K + 1 = {len(draft) + 1} ids, got {len(ids)}")
    if margins is not None and len(margins) != len(ids):
        raise ValueError(f"margins must hold {len(ids)} values, got {len(margins)}")

    def pick(i: int) -> int:
        if margins is not None and math.isnan(float(margins[i])):
            raise NonFiniteRow(f"logits row {i} is not finite where the pick is made (its margin is NaN)")
        return ids[i]

    def margin(i: int) -> float:
        return math.inf if margins is None else float(margins[i])

    return _advance(state, draft, pick, margin, None)


def delivered(state: DecodeState, undelivered: Sequence[Commit]) -> DecodeState:
    """What a consumer has seen who received every commit of ``state`` except the last step's trailing
    ``undelivered`` ones: their tokens, logprobs and text are taken back, and the generation counts as running
    (``finish_reason`` None) if any were. ``text`` is the text released so far. A description to report, not a
    state to step from."""
    kept = len(state.generated_tokens) - len(undelivered)
    streamed = state.streamed_chars - sum(len(c.text) for c in undelivered)
    if not undelivered:
        return state if state.finished else attrs.evolve(state, text=state.streamed_text)
    return attrs.evolve(
        state,
        generated_tokens=state.generated_tokens[:kept],
        logprobs=state.logprobs[:kept],
        text=state.text[:streamed],
        streamed_chars=streamed,
        finish_reason=None,
        stop_matched=None,
    )


def _advance(
    state: DecodeState,
    draft: Draft,
    pick: Callable[[int], int],
    margin: Callable[[int], float],
    logprob: Callable[[int, int], TokenLogprob] | None,
) -> StepOutcome:
    """The accept rule, the tie guard, then the commit rules for each candidate; the only place that decides
    any of them. ``pick``, ``margin`` and ``logprob`` take a verify row's index."""
    opts = state.options
    k = len(draft)
    # Accept (core/tree.py: a chain's walk or a tree's): the candidates, each with its verify row, the accepted path.
    walked = walk(draft, pick) if isinstance(draft, DraftTree) else walk_chain(draft, pick)
    candidates, rows, nonfinite_cut = walked.candidates, walked.rows, walked.nonfinite_cut
    accepted = len(walked.path)  # draft tokens among the candidates

    # Tie guard: a multi-token pass's pick whose margin is below tie_margin is not committed, nor anything after
    # it. If that leaves nothing, the next step is a plain 1-token pass, which decides the pick as plain decoding would.
    guarded = len(candidates)
    if k and opts.tie_margin > 0:
        guarded = next((i for i in range(len(candidates)) if margin(rows[i]) < opts.tie_margin), len(candidates))
    guard_stopped = guarded < len(candidates)
    del candidates[guarded:]
    plain_step_next = not candidates or nonfinite_cut

    # Commit: each candidate passes the rules in order; the first rule that fires ends the generation.
    limit, constraint = state.context_limit, state.constraint
    text = TextTracker(state)
    generated = state.generated_tokens
    logprobs = state.logprobs
    commits: list[Commit] = []
    finish: FinishReason | None = None
    matched: str | tuple[int, ...] | None = None
    for i, token in enumerate(candidates):
        generated = generated.extended((token,))
        eos = token in opts.eos_token_ids
        seq = None if eos else _matched_stop_sequence(generated, opts.stop_token_sequences)
        grammar_done = not eos and seq is None and constraint is not None and constraint.complete(generated)
        bound = None
        if len(generated) >= opts.max_tokens:
            bound = FinishReason.MAX_TOKENS
        elif limit is not None and len(state.prompt_tokens) + len(generated) >= limit:
            bound = FinishReason.CONTEXT_FULL
        # A token that ends the generation also flushes a trailing partial character, before the stop check.
        text.add(generated, flush=eos or seq is not None or grammar_done or bound is not None)
        if eos:
            finish = FinishReason.EOS_TOKEN
        elif seq is not None:
            finish, matched = FinishReason.STOP_SEQUENCE, seq
        elif (stop := text.find_stop()) is not None:
            finish, matched = FinishReason.STOP_SEQUENCE, stop
        elif grammar_done:
            finish = FinishReason.GRAMMAR_COMPLETE
        else:
            finish = bound
        lp = logprob(rows[i], token) if logprob is not None else None
        if lp is not None:
            logprobs = logprobs.extended((lp,))
        commits.append(Commit(token, text.release(final=finish is not None), lp))
        if finish is not None:
            break

    committed_draft = min(len(commits), accepted)
    before = state.stats
    stats = attrs.evolve(
        before,
        steps=before.steps + 1,
        verification_steps=before.verification_steps + (1 if k else 0),
        proposed_tokens=before.proposed_tokens + k,
        accepted_tokens=before.accepted_tokens + committed_draft,
        multi_token_accepts=before.multi_token_accepts + (1 if committed_draft >= 2 else 0),
        tie_guard_stops=before.tie_guard_stops + (1 if guard_stopped else 0),
    )
    new_state = attrs.evolve(
        state,
        generated_tokens=generated,
        text=text.text,
        finish_reason=finish,
        stop_matched=matched,
        stats=stats,
        logprobs=logprobs,
        streamed_chars=text.streamed,
        detok_start=text.detok_start,
        detok_end=text.detok_end,
        plain_step_next=plain_step_next,
    )
    kept = walked.path[: max(len(commits) - 1, 0)]  # the committed tokens' KV but the last (the next pending)
    return StepOutcome(new_state, tuple(commits), new_state.kv_len, committed_draft, kept)


def _matched_stop_sequence(generated: Sequence[int], sequences: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    for seq in sequences:
        n = len(seq)
        if len(generated) >= n and tuple(generated[-n:]) == seq:
            return seq
    return None
