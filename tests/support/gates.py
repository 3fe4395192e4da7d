"""Test stand-ins that make timing deterministic: a backend whose passes go through a gate the test holds, and a
clock the test moves. Every wait here is on an event; ``GATE_S`` only bounds a wait that should never end."""

from __future__ import annotations

import threading

GATE_S = 30.0  # the longest any wait here may take before the test fails (it never decides an outcome)


class GatedBackend:
    """A backend (one-sequence or batched), its passes behind a gate: open, a pass runs at once; held, each pass
    waits for a permit (``allow``). Counts the passes that ran; raises on pass ``fail_at``."""

    def __init__(self, inner) -> None:
        self.inner, self.passes, self.fail_at = inner, 0, None
        self._permits: int | None = None  # None: open
        self._blocked = False  # a pass is waiting for a permit
        self._changed = threading.Condition()

    def hold(self) -> int:
        """Hold the gate; return the passes run so far."""
        with self._changed:
            self._permits = 0
            return self.passes

    def allow(self, n: int) -> None:
        with self._changed:
            self._permits = (self._permits or 0) + n
            self._changed.notify_all()

    def open(self) -> None:
        with self._changed:
            self._permits = None
            self._changed.notify_all()

    def wait_blocked_at(self, passes: int) -> None:
        """Wait until ``passes`` passes have run and the next one waits at the held gate."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.passes == passes and self._blocked, GATE_S), self.passes

    def _pass(self) -> None:
        with self._changed:
            self._blocked = True
            self._changed.notify_all()
            released = self._changed.wait_for(lambda: self._permits is None or self._permits > 0, GATE_S)
            self._blocked = False
            if not released:
                raise RuntimeError("the test never let this pass through")
            if self._permits is not None:
                self._permits -= 1
            self.passes += 1
            self._changed.notify_all()
            if self.fail_at is not None and self.passes >= self.fail_at:
                self.fail_at = None
                raise RuntimeError("injected backend failure")

    def decode(self, tokens, past):
        self._pass()
        return self.inner.decode(tokens, past)

    def decode_verify(self, tokens, base):
        self._pass()
        return self.inner.decode_verify(tokens, base)

    def verify_picks(self, tokens, base):
        self._pass()
        return self.inner.verify_picks(tokens, base)

    def run_pass(self, rows):
        self._pass()
        return self.inner.run_pass(rows)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ManualClock:
    """The server's clock (seconds), moved only by the test: a deadline passes when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
