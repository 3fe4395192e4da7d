"""Every rule of speculative greedy decoding, in one place, with no I/O.

Theory of operation
-------------------
A generation is a ``DecodeState``: the prompt, the tokens committed so far, their text, and (once it ends) why
it ended. The state is frozen; ``step`` returns a new one. Nothing here touches a device: a backend computes
logits, this module decides what they mean.

The KV cache trails the committed tokens by exactly one. Between steps the backend holds the KV of
``prompt + generated[:-1]`` (``state.kv_len`` positions) and the last committed token is *pending*. One step is
one target pass over ``(pending, *draft)``: row 0 of that pass (``base_logits``) predicts the first uncommitted
position, and row ``i + 1`` (``rows[i]``) predicts the position after ``draft[i]``. Plain greedy decoding is the
same step with an empty draft.

From the K + 1 rows the step takes the target's picks (argmax, lowest id on ties). ``picks[0]`` is what greedy
decoding would emit next; ``picks[i]`` for ``i >= 1`` is what it would emit after ``draft[:i]``, so the step may
use it only while ``draft[:i]`` equals ``picks[:i]``. The committed candidates are therefore
``picks[0 .. accepted]``: the accepted draft tokens followed by one free *bonus* token.

Each candidate then passes the commit rules, one token at a time and in this order, even in the middle of a
block: EOS (the EOS token is kept), stop token sequences, stop strings (the earliest completion in the text wins
and the text is cut before it), ``max_new_tokens``, ``max_context``. The first rule that fires ends the
generation, and no candidate after that token is ever committed. Because the rules see the same tokens in the
same order whatever the draft was, speculative and greedy runs end identically.

The step returns ``rewind_to``, the KV length the backend must keep: ``kv_len`` of the new state. The pass left
``kv_len + 1 + K`` positions; the committed ones stay, and the last committed token becomes the next pending
token (it is re-fed, so its KV entry is recomputed by the next pass).

Near ties (opt-in, ``Options.tie_margin``). A K-token pass can round differently from a 1-token pass and flip an
argmax whose top two logits almost tie. With the guard on, a pick from a multi-token pass whose margin is below
the threshold is not committed: the step ends before it, and when that is the very first pick the state asks for
a plain step next (``draft_budget`` is 0), whose 1-token pass decides it exactly as greedy decoding would.

Text. With a ``detokenize`` function (ids -> str), text is decoded incrementally over a sliding window of
tokens, so each token's text delta costs O(window); a delta ending in U+FFFD (a partial UTF-8 character) waits
for the next token. Text that could still become part of a stop string is held back from the stream until it
cannot. Every commit carries the text it releases; the concatenated deltas always equal ``state.text``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

Detokenize = Callable[[Sequence[int]], str]

_REPLACEMENT_CHAR = "\ufffd"


class FinishReason(str, enum.Enum):
    """Why a generation ended."""

    MAX_TOKENS = "max_tokens"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    LENGTH = "length"

    def __str__(self) -> str:
        return self.value


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _token_ids(field: str, values: Iterable[object]) -> tuple[int, ...]:
    out = []
    for v in values:
        if not _is_int(v) or int(v) < 0:
            raise ValueError(f"{field}: {v!r} is not a token id (a non-negative int)")
        out.append(int(v))
    return tuple(out)


def _to_eos_ids(value: object) -> frozenset[int]:
    if value is None:
        return frozenset()
    if _is_int(value):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"eos_token_ids: expected a set of token ids, got {value!r}")
    return frozenset(_token_ids("eos_token_ids", value))


def _to_stop_sequences(value: object) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"stop_token_sequences: expected a tuple of token-id tuples, got {value!r}")
    out = []
    for seq in value:
        if _is_int(seq) or isinstance(seq, (str, bytes)) or not isinstance(seq, Iterable):
            raise ValueError(f"stop_token_sequences: {seq!r} is not a sequence of token ids")
        ids = _token_ids("stop_token_sequences", seq)
        if not ids:
            raise ValueError("stop_token_sequences: a stop sequence must not be empty")
        out.append(ids)
    return tuple(out)


def _to_stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise ValueError(f"stop_strings: expected a tuple of strings, got {value!r}")
    out = tuple(value)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop_strings: {s!r} is not a non-empty string")
    return out


@attrs.frozen
class Options:
    """What to generate and when to stop. Every field is validated; a bad one raises ``ValueError`` naming it.

    ``max_context`` bounds prompt + generated tokens (the KV positions a generation may use); ``None`` leaves
    the bound to the backend's capacity. ``top_logprobs`` > 0 records, for each committed token, its
    log-probability and the N most likely alternatives. ``tie_margin`` > 0 turns on the near-tie guard (see the
    module docstring), in logit units.
    """

    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_to_eos_ids)
    stop_token_sequences: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_to_stop_sequences)
    stop_strings: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_strings)
    max_context: int | None = None
    top_logprobs: int = 0
    tie_margin: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.max_context is not None and (not _is_int(self.max_context) or self.max_context < 1):
            raise ValueError(f"max_context must be None or an int >= 1, got {self.max_context!r}")
        if not _is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {self.top_logprobs!r}")
        if (
            isinstance(self.tie_margin, bool)
            or not isinstance(self.tie_margin, (int, float, np.floating))
            or not math.isfinite(self.tie_margin)
            or self.tie_margin < 0
        ):
            raise ValueError(f"tie_margin must be a finite number >= 0, got {self.tie_margin!r}")


@attrs.frozen
class Stats:
    """Counters of one generation. Every step is one target pass (the driver's prompt pass is the first step),
    so ``target_forward_passes`` equals ``steps``. A verification step is a step with a non-empty draft."""

    steps: int = 0
    verification_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    multi_token_accepts: int = 0
    target_forward_passes: int = 0
    tie_guard_stops: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ proposed draft tokens (0.0 when nothing was proposed)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


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


@attrs.frozen
class DecodeState:
    """One generation's decisions so far. Build it with ``DecodeState.start``; advance it with ``step``.

    ``text`` is the generated text decoded so far (cut before the stop string once one matched);
    ``streamed_chars`` of it have been released through commits. ``finish_reason`` is None while running;
    ``stop_matched`` names the stop string or token sequence that ended it.
    """

    prompt_tokens: tuple[int, ...]
    options: Options
    detokenize: Detokenize | None = attrs.field(default=None, eq=False, repr=False)
    generated_tokens: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_matched: str | tuple[int, ...] | None = None
    stats: Stats = Stats()
    logprobs: tuple[TokenLogprob, ...] = ()
    streamed_chars: int = 0
    # Incremental detokenization window: text of generated[window_start:window_read] is already in `text`.
    window_start: int = 0
    window_read: int = 0
    # Set when the tie guard refused the first pick of a multi-token pass: the next step must be plain.
    plain_step_next: bool = False

    @classmethod
    def start(
        cls, prompt_tokens: Sequence[int], options: Options, detokenize: Detokenize | None = None
    ) -> DecodeState:
        """The state before the first step. Raises ``ValueError`` for an empty prompt, a prompt longer than
        ``max_context``, or stop strings without a ``detokenize`` function."""
        if not isinstance(options, Options):
            raise ValueError(f"options must be an ortspec Options, got {type(options).__name__}")
        if isinstance(prompt_tokens, (str, bytes)):
            raise ValueError("prompt_tokens must be token ids, not text (tokenize it first)")
        prompt = _token_ids("prompt_tokens", prompt_tokens)
        if not prompt:
            raise ValueError("prompt_tokens is empty: generation needs at least one prompt token")
        if options.stop_strings and detokenize is None:
            raise ValueError("stop_strings need a detokenize function (ids -> str) to see the text")
        if detokenize is not None and not callable(detokenize):
            raise ValueError("detokenize must be a callable ids -> str")
        state = cls(prompt_tokens=prompt, options=options, detokenize=detokenize)
        if options.max_context is not None:
            if len(prompt) > options.max_context:
                raise ValueError(
                    f"the prompt has {len(prompt)} tokens but max_context is {options.max_context}"
                )
            if len(prompt) == options.max_context:
                state = attrs.evolve(state, finish_reason=FinishReason.LENGTH)
        return state

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
    def streamed_text(self) -> str:
        return self.text[: self.streamed_chars]


def draft_budget(state: DecodeState) -> int:
    """The most draft tokens the next step may verify: every one of them could still be committed, bonus
    included, within ``max_new_tokens`` and ``max_context``. 0 means a plain step."""
    if state.finished or state.plain_step_next:
        return 0
    budget = state.options.max_new_tokens - len(state.generated_tokens) - 1
    if state.options.max_context is not None:
        budget = min(budget, state.options.max_context - state.context_len - 1)
    return max(budget, 0)


def check_draft(state: DecodeState, draft: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """Validate a proposed draft for the next step; return it as a tuple of ints.

    Raises ``ValueError`` for a finished state, an id outside ``[0, vocab_size)``, or a draft longer than
    ``draft_budget(state)``."""
    if state.finished:
        raise ValueError(f"the generation already finished ({state.finish_reason})")
    draft = _token_ids("draft", draft)
    for t in draft:
        if t >= vocab_size:
            raise ValueError(f"draft holds token id {t}, outside the vocabulary [0, {vocab_size})")
    if len(draft) > draft_budget(state):
        raise ValueError(f"a draft of {len(draft)} tokens exceeds this step's budget of {draft_budget(state)}")
    return draft


def step(
    state: DecodeState,
    base_logits: np.ndarray,
    rows: np.ndarray | None,
    draft: Sequence[int],
) -> tuple[DecodeState, tuple[Commit, ...], int]:
    """Advance by one target pass over ``(pending, *draft)``.

    ``base_logits``: ``[vocab]`` logits for the first uncommitted position; ``rows``: ``[K, vocab]``, row ``i``
    after ``draft[i]`` (``None`` or empty when K = 0). Returns ``(new_state, commits, rewind_to)``. The arrays
    are read, never kept or modified. Raises ``ValueError`` on shapes that do not match the draft, ids outside
    the vocabulary, or a NaN / +inf logit where a pick is made.
    """
    base = np.asarray(base_logits)
    if base.ndim != 1 or base.shape[0] < 1:
        raise ValueError(f"base_logits must have shape [vocab], got {base.shape}")
    vocab = base.shape[0]
    draft = check_draft(state, draft, vocab)
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

    def pick(i: int) -> int:
        row = all_rows[i]
        t = int(np.argmax(row))  # first maximum: ties go to the lowest id; a NaN anywhere is picked
        if not math.isfinite(float(row[t])):
            raise ValueError(f"logits row {i} is not finite where the pick is made (value {row[t]})")
        return t

    def margin(i: int) -> float:
        top2 = np.partition(all_rows[i], vocab - 2)[-2:] if vocab > 1 else np.array([0.0, math.inf])
        return float(top2[1] - top2[0])

    def logprob(i: int, token: int) -> TokenLogprob:
        return _logprob(all_rows[i], token, state.options.top_logprobs)

    return _advance(state, draft, pick, margin, logprob if state.options.top_logprobs else None)


def step_ids(
    state: DecodeState,
    target_ids: Sequence[int],
    draft: Sequence[int],
    *,
    margins: Sequence[float] | None = None,
) -> tuple[DecodeState, tuple[Commit, ...], int]:
    """``step`` with the K + 1 target picks already made (device-side argmax): ``target_ids[0]`` from the base
    row, ``target_ids[i + 1]`` after ``draft[i]``. ``margins`` (top-1 minus top-2 logit per row) feed the tie
    guard. Logprobs need the logits, so ``top_logprobs`` > 0 is refused here."""
    if state.options.top_logprobs:
        raise ValueError("step_ids cannot report logprobs (it has no logits); use step()")
    draft = _token_ids("draft", draft)
    ids = _token_ids("target_ids", target_ids)
    if len(ids) != len(draft) + 1:
        raise ValueError(f"target_ids must hold K + 1 = {len(draft) + 1} picks, got {len(ids)}")
    if margins is not None and len(margins) != len(ids):
        raise ValueError(f"margins must hold {len(ids)} values, got {len(margins)}")
    if state.finished:
        raise ValueError(f"the generation already finished ({state.finish_reason})")
    if len(draft) > draft_budget(state):
        raise ValueError(f"a draft of {len(draft)} tokens exceeds this step's budget of {draft_budget(state)}")

    def margin(i: int) -> float:
        return math.inf if margins is None else float(margins[i])

    return _advance(state, draft, lambda i: ids[i], margin, None)


def _advance(
    state: DecodeState,
    draft: tuple[int, ...],
    pick: Callable[[int], int],
    margin: Callable[[int], float],
    logprob: Callable[[int, int], TokenLogprob] | None,
) -> tuple[DecodeState, tuple[Commit, ...], int]:
    """The accept rule, then the commit rules for each candidate; the only place that decides either."""
    opts = state.options
    k = len(draft)
    candidates: list[int] = [pick(0)]
    while len(candidates) <= k and candidates[-1] == draft[len(candidates) - 1]:
        candidates.append(pick(len(candidates)))
    accepted = len(candidates) - 1

    guard_stopped = False
    if k and opts.tie_margin > 0:
        for i in range(len(candidates)):
            if margin(i) < opts.tie_margin:
                del candidates[i:]
                guard_stopped = True
                break

    text = _TextTracker(state)
    generated = list(state.generated_tokens)
    logprobs = list(state.logprobs)
    commits: list[Commit] = []
    finish: FinishReason | None = None
    matched: str | tuple[int, ...] | None = None
    for i, token in enumerate(candidates):
        generated.append(token)
        eos = token in opts.eos_token_ids
        seq = None if eos else _matched_stop_sequence(generated, opts.stop_token_sequences)
        limit = None
        if len(generated) >= opts.max_new_tokens:
            limit = FinishReason.MAX_TOKENS
        elif opts.max_context is not None and len(state.prompt_tokens) + len(generated) >= opts.max_context:
            limit = FinishReason.LENGTH
        # A token that ends the generation also flushes a trailing partial character, before the stop check.
        text.add(generated, flush=eos or seq is not None or limit is not None)
        if eos:
            finish = FinishReason.EOS_TOKEN
        elif seq is not None:
            finish, matched = FinishReason.STOP_SEQUENCE, seq
        elif (s := text.find_stop(opts.stop_strings)) is not None:
            finish, matched = FinishReason.STOP_SEQUENCE, s
        else:
            finish = limit
        lp = logprob(i, token) if logprob is not None else None
        if lp is not None:
            logprobs.append(lp)
        commits.append(Commit(token, text.release(final=finish is not None), lp))
        if finish is not None:
            break

    committed_draft = min(len(commits), accepted)
    s = state.stats
    stats = attrs.evolve(
        s,
        steps=s.steps + 1,
        target_forward_passes=s.target_forward_passes + 1,
        verification_steps=s.verification_steps + (1 if k else 0),
        proposed_tokens=s.proposed_tokens + k,
        accepted_tokens=s.accepted_tokens + committed_draft,
        multi_token_accepts=s.multi_token_accepts + (1 if committed_draft >= 2 else 0),
        tie_guard_stops=s.tie_guard_stops + (1 if guard_stopped else 0),
    )
    new_state = attrs.evolve(
        state,
        generated_tokens=tuple(generated),
        text=text.text,
        finish_reason=finish,
        stop_matched=matched,
        stats=stats,
        logprobs=tuple(logprobs),
        streamed_chars=text.streamed,
        window_start=text.window_start,
        window_read=text.window_read,
        plain_step_next=not commits,
    )
    return new_state, tuple(commits), new_state.kv_len


def _matched_stop_sequence(
    generated: list[int], sequences: tuple[tuple[int, ...], ...]
) -> tuple[int, ...] | None:
    for seq in sequences:
        n = len(seq)
        if len(generated) >= n and tuple(generated[-n:]) == seq:
            return seq
    return None


class _TextTracker:
    """Incremental detokenization and stop-string hold-back for one step (local scratch, never shared)."""

    def __init__(self, state: DecodeState) -> None:
        self.detokenize = state.detokenize
        self.text = state.text
        self.streamed = state.streamed_chars
        self.window_start = state.window_start
        self.window_read = state.window_read
        self.checked = len(state.text)  # stop strings were already searched in text[:checked]
        self.longest_stop = max((len(s) for s in state.options.stop_strings), default=0)
        self.stop_strings = state.options.stop_strings
        self.generated: list[int] = []

    def add(self, generated: list[int], flush: bool) -> None:
        """Decode what the newest token completes. A trailing partial character waits for the next token,
        unless ``flush`` (the generation ends here), when it is kept as U+FFFD."""
        self.generated = generated
        if self.detokenize is None:
            return
        prefix = self.detokenize(generated[self.window_start : self.window_read])
        full = self.detokenize(generated[self.window_start :])
        if len(full) > len(prefix) and (flush or not full.endswith(_REPLACEMENT_CHAR)):
            self.text += full[len(prefix) :]
            self.window_start, self.window_read = self.window_read, len(generated)

    def find_stop(self, stop_strings: tuple[str, ...]) -> str | None:
        """Cut the text before the earliest-completing stop string that the new text completes; return it."""
        if not stop_strings or len(self.text) == self.checked:
            return None
        start = max(0, self.checked - self.longest_stop + 1)
        self.checked = len(self.text)
        best: tuple[int, int, str] | None = None
        for s in stop_strings:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or (at + len(s), at) < best[:2]):
                best = (at + len(s), at, s)
        if best is None:
            return None
        self.text = self.text[: best[1]]
        self.checked = len(self.text)
        return best[2]

    def release(self, final: bool) -> str:
        """The text this commit releases: all of it when the generation ends, else all but what could still
        start a stop string."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self.streamed:
            return ""
        out = self.text[self.streamed : end]
        self.streamed = end
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        best = 0
        tail = self.text[-self.longest_stop :] if self.longest_stop else ""
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:n]):
                    best = n
                    break
        return best


def _logprob(row: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """Log-softmax of ``row`` at ``token`` and its ``top_n`` most likely ids (lowest id first on ties)."""
    x = np.asarray(row, dtype=np.float64)
    m = float(np.max(x))
    lse = m + math.log(float(np.sum(np.exp(x - m))))
    n = min(top_n, x.shape[0])
    cand = np.argpartition(-x, n - 1)[:n] if n < x.shape[0] else np.arange(x.shape[0])
    # argpartition may cut a tie arbitrarily: take every id tied with the n-th value, then order exactly.
    threshold = x[cand].min()
    cand = np.nonzero(x >= threshold)[0]
    order = np.lexsort((cand, -x[cand]))[:n]
    top = tuple((int(cand[j]), float(x[cand[j]] - lse)) for j in order)
    return TokenLogprob(token_id=token, logprob=float(x[token] - lse), top=top)
