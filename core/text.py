"""A step's text: incremental detokenization and stop-string hold-back, for ``core.state``.

``state.py`` decides what is committed and when a generation ends; this module keeps the text of those commits:
each token's text delta is decoded over a sliding window of tokens (O(window) per token), a delta ending in U+FFFD
(a partial UTF-8 character) waits for the next token unless the generation ends there, stop strings are searched in
the new text only, and text that could still become part of a stop string is held back from the stream. A
``TextTracker`` is one step's local scratch, made from the state before the step and never shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import DecodeState

_REPLACEMENT_CHAR = "\ufffd"


class TextTracker:
    """Incremental detokenization and stop-string hold-back for one step (local scratch, never shared)."""

    def __init__(self, state: DecodeState) -> None:
        self.detokenize = state.detokenize
        self.text = state.text
        self.streamed = state.streamed_chars
        self.detok_start = state._detok_start
        self.detok_end = state._detok_end
        self.checked = len(state.text)  # stop strings were already searched in text[:checked]
        self.stop_strings = state.options.stop_strings
        self.longest_stop = max((len(s) for s in self.stop_strings), default=0)

    def add(self, generated: Sequence[int], flush: bool) -> None:
        """Decode what the newest token completes. A trailing partial character waits for the next token,
        unless ``flush`` (the generation ends here), when it is kept as U+FFFD."""
        if self.detokenize is None:
            return
        prefix = self.detokenize(generated[self.detok_start : self.detok_end])
        full = self.detokenize(generated[self.detok_start :])
        if len(full) > len(prefix) and (flush or not full.endswith(_REPLACEMENT_CHAR)):
            self.text += full[len(prefix) :]
            self.detok_start, self.detok_end = self.detok_end, len(generated)

    def find_stop(self) -> str | None:
        """Cut the text before the earliest-completing stop string that the new text completes; return it."""
        if not self.stop_strings or len(self.text) == self.checked:
            return None
        start = max(0, self.checked - self.longest_stop + 1)
        self.checked = len(self.text)
        best: tuple[int, int, str] | None = None
        for s in self.stop_strings:
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
