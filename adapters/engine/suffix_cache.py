"""``SuffixCache``: an Engine's recent outputs, for ``speculative="suffix"`` to draft from across requests.

The mutable part of suffix drafting (the rule and the immutable values are ``core/suffix.py``'s): one per Engine, so
one per model, shared by all its requests (every call on its one scheduler, the server's, a batch job's). A request
takes ``snapshot()`` when it starts and drafts from that value to its end; ``add`` records a request's output after
it finished (its prompt's last ``PROMPT_TAIL`` tokens, then its output), making the next snapshot. Thread-safe: the
server's pass thread adds while request threads take snapshots.

It records nothing until the first snapshot is taken (an Engine that never drafts by suffix keeps no corpus);
from then on every finished generation of the Engine is recorded, speculative or not. Memory: the corpus holds at
most ``max_tokens`` tokens (the oldest documents go first; ``SuffixSnapshot``), plus its n-gram index, which
grows with the corpus (its measured size per token: docs/suffix-cache.md).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ortspec.core import SuffixSnapshot

# Prompt tokens recorded before each output: the turn's opening (the chat template's assistant header), so that a
# request drafts the first tokens of earlier answers from its own prompt's end.
PROMPT_TAIL = 8
# The default cap of an Engine's cache, in tokens (about 100 outputs of 300 tokens).
DEFAULT_MAX_TOKENS = 32768


class SuffixCache:
    """The newest ``SuffixSnapshot`` of an Engine's finished outputs, behind a lock (see the module docstring)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, start: SuffixSnapshot | None = None) -> None:
        """``max_tokens``: the cap on the recorded tokens (``ValueError`` below 2); ``start``: the outputs it holds
        to begin with (another cache's snapshot: a fork that records apart; its own cap then), none by default."""
        self._snapshot = start if start is not None else SuffixSnapshot(max_tokens=max_tokens)
        self._active = False
        self._lock = threading.Lock()

    def snapshot(self) -> SuffixSnapshot:
        """What a request starting now drafts from (an immutable value); from now on, outputs are recorded."""
        with self._lock:
            self._active = True
            return self._snapshot

    def add(self, prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> None:
        """Record a finished request: its prompt's last ``PROMPT_TAIL`` tokens and its output (nothing before the
        first snapshot, nor for an empty output)."""
        if not self._active or not output_tokens:
            return
        document = [*prompt_tokens[-PROMPT_TAIL:], *output_tokens]
        with self._lock:
            self._snapshot = self._snapshot.with_document(document)

    @property
    def tokens(self) -> int:
        """The tokens the newest snapshot holds (separators included)."""
        return len(self._snapshot)
