"""Backend faults at every pass: a backend that fails on its n-th pass (the prompt pass is the first; ``decode``,
``decode_verify`` or ``verify_picks``, whichever that pass is, or the ``rewind`` after it), before touching its
cache or after running the pass, must end the generation with a ``GenerationError`` that carries exactly what
the same generation without the fault had committed and streamed by the end of pass n - 1: nothing lost, nothing
repeated, nothing from the failed pass. Afterwards the same backend serves the next generation exactly as a fresh
one, with or without reusing the KV the failed generation left (``cached_prefix``).
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import Generation, GenerationError
from ortspec.backends.base import BackendError
from ortspec.backends.fake import FakeBackend
from ortspec.core import FixedWidth
from property_tests.conftest import examples
from property_tests.strategies import Scenario, proposers_for, scenarios, width_policies
from property_tests.test_equivalence import reference


class DeviceLost(RuntimeError):
    """Not a BackendError: what a raw runtime failure that escaped a backend looks like."""


class FaultyBackend(FakeBackend):
    """A FakeBackend whose ``fail_at``-th pass fails. ``mode``: ``"before"`` raises ``BackendError`` before the
    pass touches anything (the protocol's promise); ``"after"`` runs the pass, then raises ``DeviceLost`` (a
    backend that broke its promise and grew its cache); ``"rewind"`` fails the ``rewind`` that follows the pass.
    ``fail_at`` 0: never."""

    def __init__(self, model, max_length, *, picks_on_device, fail_at, mode):
        super().__init__(model, max_length, picks_on_device=picks_on_device)
        self.fail_at, self.mode, self.calls, self.failed = fail_at, mode, 0, False
        self._rewind_armed = False

    def _run(self, tokens, position, what):
        self.calls += 1
        if self.calls == self.fail_at and self.mode == "before":
            self.failed = True
            raise BackendError(f"injected failure before pass {self.calls}")
        rows = super()._run(tokens, position, what)
        if self.calls == self.fail_at and self.mode == "after":
            self.failed = True
            raise DeviceLost(f"injected failure after pass {self.calls}")
        self._rewind_armed = self.calls == self.fail_at and self.mode == "rewind"
        return rows

    def rewind(self, length):
        if self._rewind_armed:
            self._rewind_armed, self.failed = False, True
            raise BackendError(f"injected rewind failure after pass {self.calls}")
        super().rewind(length)


def traced(backend, sc: Scenario, proposer, width, *, cached_prefix=0):
    """Run one generation to the end or to its error; ``(Generation or None, [(pass, commit)], error or None)``."""
    stream: list = []
    generation = None
    try:
        generation = Generation(backend, sc.prompt, sc.options, proposer, draft_width=width,
                                detokenize=sc.detokenize, cached_prefix=cached_prefix)  # fmt: skip
        for commit in generation:
            stream.append((backend.calls, commit))
        return generation, stream, None
    except GenerationError as exc:
        return generation, stream, exc


@settings(max_examples=examples(200))
@given(scenarios(), st.sampled_from(["before", "after", "rewind"]), st.data())
def test_a_backend_failing_at_any_pass_loses_and_repeats_nothing(sc: Scenario, mode, data):
    proposer = data.draw(proposers_for(sc.model), label="proposer")
    width = data.draw(width_policies(), label="width")
    width = FixedWidth(width) if isinstance(width, int) else width
    picks = sc.options.top_logprobs == 0 and data.draw(st.booleans(), label="device picks")

    clean = FaultyBackend(sc.model, sc.capacity, picks_on_device=picks, fail_at=0, mode=mode)
    _, clean_stream, clean_error = traced(clean, sc, proposer, width)
    assert clean_error is None
    ref = reference(sc)
    assert [c.token_id for _, c in clean_stream] == ref.tokens
    passes = clean.calls

    # evenly over the passes (integers(1, n) would favour the first)
    fail_at = 1 + data.draw(st.integers(0, 2**16), label="failing pass") % max(passes, 1)
    backend = FaultyBackend(sc.model, sc.capacity, picks_on_device=picks, fail_at=fail_at, mode=mode)
    generation, stream, error = traced(backend, sc, proposer, width)
    if not backend.failed:  # a prompt that fills the context makes no pass at all
        assert passes == 0 and error is None
        return
    assert error is not None, "a failing pass must end the generation with an error"
    assert isinstance(error.__cause__, BackendError if mode != "after" else DeviceLost)
    # Exactly what the clean run had delivered by the end of the previous pass: nothing lost, nothing repeated.
    want = [c for p, c in clean_stream if p < fail_at]
    assert [c for _, c in stream] == want
    partial = error.partial
    assert list(partial.token_ids) == [c.token_id for c in want]
    assert partial.text == "".join(c.text for c in want)
    assert partial.finish_reason is None
    event(f"failed at pass {min(fail_at, 4)}{'+' if fail_at >= 4 else ''} ({mode})")

    # The same backend, afterwards: a fresh generation, and one that reuses what the failed one left resident.
    backend.fail_at = 0
    resident = generation.resident_tokens() if generation is not None else ()
    assert backend.resident_tokens()[: len(resident)] == resident
    for cached in (0, data.draw(st.integers(0, len(resident)), label="reused prefix")):
        again, again_stream, again_error = traced(backend, sc, proposer, width, cached_prefix=cached)
        assert again_error is None
        result = again.result()
        assert list(result.token_ids) == ref.tokens and result.text == ref.text
        assert [c for _, c in again_stream] == [c for _, c in clean_stream]
