"""``DraftModelProposer``: drafting with a separate, smaller model of the same vocabulary
(``speculative="draft-model"``) on any ``BatchBackend`` (a ``FakeBatchBackend`` in the tests, an ``OrtBatchBackend``
on a second model folder in an Engine: ``adapters/engine/draft_models.py``).

The contract:

* **One draft slot per sequence.** The proposer keeps its own KV per sequence, in the draft backend's slot named by
  the context's ``DraftContext.sequence`` (the target's batch slot, which ``after`` keeps when tokens are drafted in
  front, e.g. a grammar's forced ones; a context that names no sequence falls back to ``slot``; one naming neither,
  or a slot the draft backend does not have, gets no draft). It remembers which tokens each draft slot holds (as it
  fed them; a slot whose length is not that is emptied first).
* **Never re-read what a slot holds.** Per ``propose``: the longest common prefix of what the slot holds and
  ``context.tokens`` stays (the slot is rewound to it, at most to one token short of the context, since the next
  draft token needs the logits after the context's last token); the rest of the context is fed as one prompt-like
  row (``last_logits=1``; in rows of at most ``prefill_chunk`` tokens when that is set), then up to ``width`` draft
  tokens are picked one at a time, each fed back as a one-token row except the last. So after the target verifies a
  draft, the accepted draft tokens are kept and only the bonus token (and the last accepted one, when all were) is
  fed; a new sequence in the slot keeps the prefix it shares with the last one.
* **The pick.** Greedy (``context.picker`` None): the argmax of the draft's logits row; sampled: the target's own
  seeded rule on the draft's row (``context.picker.after(tokens).pick``, ``core.sampling.DraftPicker``), so where
  the two distributions are close the draft is the target's pick. The draft's row is read over the target's
  vocabulary (cut, or padded with ``-inf``), so a draft token is always a target id. A row that is not finite where
  the pick is made ends the draft. A picked ``stop_ids`` token (the target's EOS) ends the draft after it: the
  target ends there if it accepts it, so drafting past it is wasted (with ``ignore_eos`` it is only a shorter draft).
  A context token the draft backend has no id for, or a context that would overflow the draft slot, gets no draft.
* **Failures draft nothing wrong.** Every draft token is only a proposal (the core commits the target's picks), so
  what the proposer returns can cost speed, never correctness. If the draft backend raises mid-draft, the proposer
  returns the tokens it picked before the failure, warns (``RuntimeWarning``, once per slot) and drafts nothing
  more in that slot (its state is unknown after an arbitrary exception): the request goes on, exactly, without
  drafts there (``broken`` names the failed slots and why).

Thread-safe: one lock serialises every use of the draft backend.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence

import numpy as np

from ortspec.core.prefix import common_prefix_length
from ortspec.core.proposers import MAX_DRAFT, DraftContext
from ortspec.core.sampling import DraftPicks

from .base import BatchBackend, BatchRow


class DraftModelProposer:
    """Drafts with ``backend``, a draft model of the target's vocabulary, one slot per sequence (the module
    docstring). ``target_vocab``: the target's logits width (draft tokens are ids below it); ``stop_ids``: the
    tokens after which a draft ends (the target's EOS ids); ``max_draft``: the most tokens per draft;
    ``prefill_chunk``: the most context tokens fed in one row (None: the whole rest of the context in one).
    ``tokens_fed``: how many tokens the proposer has fed the draft backend, in all."""

    def __init__(
        self,
        backend: BatchBackend,
        target_vocab: int,
        *,
        stop_ids: Iterable[int] = (),
        max_draft: int = MAX_DRAFT,
        prefill_chunk: int | None = None,
    ) -> None:
        if isinstance(target_vocab, bool) or not isinstance(target_vocab, int) or target_vocab < 2:
            raise ValueError(f"target_vocab must be an int >= 2, got {target_vocab!r}")
        if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
            raise ValueError(f"max_draft must be an int >= 1, got {max_draft!r}")
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1
        ):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.backend = backend
        self.target_vocab = target_vocab
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.max_draft = max_draft
        self.prefill_chunk = prefill_chunk
        self.tokens_fed = 0
        self.broken: dict[int, str] = {}  # draft slot -> why it drafts nothing more
        self._held: dict[int, list[int]] = {}  # draft slot -> the tokens whose KV it holds, as fed
        self._lock = threading.Lock()

    def propose(self, context: DraftContext) -> tuple[int, ...]:
        """Up to ``min(context.width, max_draft)`` draft tokens after ``context.tokens`` (the module docstring)."""
        key = context.sequence if context.sequence is not None else context.slot
        tokens = context.tokens
        if key is None or not tokens or context.width < 1:
            return ()
        backend = self.backend
        # every fed position must fit the slot; the last draft token is never fed
        width = min(context.width, self.max_draft, backend.max_length - len(tokens) + 1)
        if width < 1 or not 0 <= key < backend.slots:
            return ()
        with self._lock:
            if key in self.broken:
                return ()
            draft: list[int] = []
            try:
                self._draft(key, tokens, width, context, draft)
            except Exception as exc:  # the slot's state is unknown: draft nothing more there
                self._fail(key, exc)
            return tuple(draft)

    def held(self, slot: int) -> tuple[int, ...]:
        """The tokens whose KV draft slot ``slot`` holds, as this proposer fed them."""
        with self._lock:
            return tuple(self._held.get(slot, ()))

    def _draft(self, key: int, tokens: Sequence[int], width: int, context: DraftContext, draft: list[int]) -> None:
        """Rewind slot ``key`` to what it shares with ``tokens``, feed the rest, and pick up to ``width`` draft
        tokens into ``draft`` (which holds those picked so far if this raises)."""
        backend = self.backend
        held = self._held.setdefault(key, [])
        if backend.current_len(key) != len(held):  # not what this proposer left there: start afresh
            backend.reset(key)
            held.clear()
        keep = min(common_prefix_length(held, tokens), len(tokens) - 1)
        rest = tuple(int(t) for t in tokens[keep:])
        if any(not 0 <= t < backend.vocab_size for t in rest):
            return  # a token the draft model has no id for
        if keep < len(held):
            backend.rewind(key, keep)
            del held[keep:]
        chunk = self.prefill_chunk or len(rest)
        for start in range(0, len(rest), chunk):
            row = self._feed(key, rest[start : start + chunk], held)
        picks = context.picker.after(tokens) if context.picker is not None else None
        while True:
            token = self._pick(row, picks, draft)
            if token is None:
                return
            draft.append(token)
            if len(draft) == width or token in self.stop_ids or token >= backend.vocab_size:
                return
            row = self._feed(key, (token,), held)

    def _feed(self, key: int, tokens: tuple[int, ...], held: list[int]) -> np.ndarray:
        """Fold ``tokens`` into slot ``key`` after ``held``; the logits row after the last of them."""
        logits = self.backend.run_pass([BatchRow(key, tokens, len(held), last_logits=1)])[0]
        assert isinstance(logits, np.ndarray)
        held.extend(tokens)
        self.tokens_fed += len(tokens)
        return logits[-1]

    def _pick(self, row: np.ndarray, picks: DraftPicks | None, drafted: Sequence[int]) -> int | None:
        """The draft token from the draft's logits ``row``, read over the target's vocabulary: the argmax, or the
        coupled pick; None where the row is not finite where the pick is made."""
        n = self.target_vocab
        if row.shape[0] != n:
            wide = np.full(n, -np.inf, dtype=np.float32)
            wide[: min(n, row.shape[0])] = row[:n]
            row = wide
        if picks is None:
            token = int(np.argmax(row))
            return token if np.isfinite(row[token]) else None
        pick = picks.pick(row, drafted)
        return None if pick is None else int(pick.token)

    def _fail(self, key: int, exc: Exception) -> None:
        why = f"{type(exc).__name__}: {exc}"
        self.broken[key] = why
        self._held.pop(key, None)
        warnings.warn(
            f"the draft model failed in slot {key} ({why}); it drafts nothing more there, and the generations there "
            "go on without its drafts (their output is the same)",
            RuntimeWarning,
            stacklevel=4,
        )
        try:
            self.backend.reset(key)
        except Exception:  # noqa: BLE001 - the slot is not used again; nothing more to do
            pass

    def __repr__(self) -> str:
        return f"DraftModelProposer({self.backend!r}, target_vocab={self.target_vocab}, max_draft={self.max_draft})"
