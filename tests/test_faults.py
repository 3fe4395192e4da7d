"""Faults and interrupts on the ONNX Runtime backend (the tiny model): a session run that fails at any pass, a
KeyboardInterrupt in the middle of a draft block (from the stream callback, from inside a pass, or a real SIGINT
at an arbitrary moment), and onnxruntime's own log lines. After each, the same Engine's next generation equals a
fresh greedy one, with and without prefix reuse.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

import ortspec
import ortspec.adapters
import ortspec.backends
import ortspec.core
from ortspec import GenerationError
from ortspec.adapters.engine import Engine
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import BackendConfig
from tests.support.conformance import GreedyReplay

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox"
TOKENS = 48


class FailingSession:
    """An ``InferenceSession`` whose ``fail_at``-th run is a real onnxruntime failure (the run is started with
    ``RunOptions.terminate`` set), or raises ``raise_after`` once the real run has finished (an interrupt that
    arrives as the run returns). Everything else is the wrapped session's."""

    def __init__(self, inner, fail_at=0, raise_after=None):
        self.inner, self.fail_at, self.raise_after, self.runs = inner, fail_at, raise_after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_with_iobinding(self, binding, run_options=None):
        self.runs += 1
        if self.runs == self.fail_at and self.raise_after is None:
            terminate = ort.RunOptions()
            terminate.terminate = True
            return self.inner.run_with_iobinding(binding, terminate)
        result = self.inner.run_with_iobinding(binding, run_options)
        if self.runs == self.fail_at:
            raise self.raise_after
        return result


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    plain = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    reuse = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), prefix_reuse=True)
    for engine in (plain, reuse):
        engine.measurements.verify_drift()  # measured before the first speculative run: it counts only its passes
    return plain, reuse


@pytest.fixture(scope="module")
def greedy(engines):
    return engines[0].generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, speculative=None)


def _replay(engine, greedy):
    return GreedyReplay(engine.tokenize(PROMPT), greedy.token_ids, engine.backend.vocab_size, wrong_every=5)


def _stream(engine, session, greedy, speculative, **kwargs):
    """Generate with ``session`` in place of the backend's; return (streamed token ids, the error or None)."""
    real = engine.batch.session
    engine.batch.session = session
    streamed: list[int] = []
    try:
        engine.generate_stream(
            PROMPT,
            lambda text, token_id, finish: streamed.append(token_id),
            max_tokens=TOKENS,
            ignore_eos=True,
            speculative=_replay(engine, greedy) if speculative else None,
            draft_width=6,
            **kwargs,
        )
        return streamed, None
    except GenerationError as exc:
        return streamed, exc
    finally:
        engine.batch.session = real


@pytest.mark.parametrize("speculative", [False, True], ids=["greedy", "speculative"])
def test_an_onnxruntime_run_failing_at_any_pass_keeps_what_was_committed(engines, greedy, speculative):
    """Every pass of the generation fails in turn (the prompt pass is run 1): the error carries exactly the tokens
    streamed before it, a prefix of the greedy output, and the same Engine then generates the greedy output."""
    for engine in engines:
        counter = FailingSession(engine.batch.session)
        _stream(engine, counter, greedy, speculative)
        runs = counter.runs
        assert runs >= 3
        for fail_at in range(1, runs + 1):
            streamed, error = _stream(engine, FailingSession(engine.batch.session, fail_at), greedy, speculative)
            assert error is not None, f"run {fail_at} failed but the generation did not"
            assert isinstance(error.__cause__, BackendError) and "onnxruntime failed" in str(error.__cause__)
            assert list(error.partial.token_ids) == streamed == list(greedy.token_ids[: len(streamed)])
            assert error.partial.finish_reason is None
            again = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
            assert again.token_ids == greedy.token_ids
        if speculative:
            ok = engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, speculative=_replay(engine, greedy))
            assert ok.token_ids == greedy.token_ids and ok.stats.multi_token_accepts > 0


def test_a_keyboard_interrupt_from_the_callback_mid_block_leaves_the_engine_usable(engines, greedy):
    """The callback is interrupted on a token in the middle of an accepted draft block (its block committed more
    tokens after it): KeyboardInterrupt propagates as it is, and the next generation is the greedy one."""
    for engine in engines:
        passes: list[int] = []  # the target pass that committed each token
        counter = FailingSession(engine.batch.session)
        engine.batch.session = counter
        try:
            engine.generate_stream(PROMPT, lambda *_, p=passes, c=counter: p.append(c.runs), max_tokens=TOKENS,
                                   ignore_eos=True, speculative=_replay(engine, greedy), draft_width=6)  # fmt: skip
        finally:
            engine.batch.session = counter.inner
        mid_block = [i for i in range(1, len(passes) - 1) if passes[i - 1] == passes[i] == passes[i + 1]]
        assert mid_block, passes
        for at in mid_block[:3]:
            seen: list[int] = []

            def callback(text, token_id, finish, seen=seen, at=at):
                seen.append(token_id)
                if len(seen) == at + 1:
                    raise KeyboardInterrupt

            with pytest.raises(KeyboardInterrupt):
                engine.generate_stream(PROMPT, callback, max_tokens=TOKENS, ignore_eos=True,
                                       speculative=_replay(engine, greedy), draft_width=6)  # fmt: skip
            assert seen == list(greedy.token_ids[: at + 1])
            assert engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids == greedy.token_ids


@pytest.mark.parametrize("speculative", [False, True], ids=["greedy", "speculative"])
def test_a_keyboard_interrupt_inside_a_pass_leaves_the_engine_usable(engines, greedy, speculative):
    """KeyboardInterrupt raised as a run returns (before the backend or the driver records it) at every pass."""
    for engine in engines:
        counter = FailingSession(engine.batch.session)
        _stream(engine, counter, greedy, speculative)
        for fail_at in range(1, counter.runs + 1):
            session = FailingSession(engine.batch.session, fail_at, raise_after=KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                _stream(engine, session, greedy, speculative)
            assert engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids == greedy.token_ids
            batch = engine.batch
            assert all(batch.current_len(slot) <= batch.max_length for slot in range(batch.slots))


_OURS = tuple(str(Path(m.__file__).parent) for m in (ortspec, ortspec.core, ortspec.backends, ortspec.adapters))


class SigintAt:
    """A profile function (``sys.setprofile``) that sends this process a real SIGINT at the ``at``-th place in
    ortspec's own code where CPython delivers a pending signal (None: it only counts them): the entry of one of
    its functions, or just after one of its calls into C returns (an onnxruntime run, a numpy operation, a lock's
    ``__exit__``) - in the Engine, the driver, the core, the proposer or the backend. The interrupt lands by the
    count of those places, not by the clock, so the same ``at`` lands at the same place on every machine. (Raising
    at line events instead would also land where no real signal can, e.g. before a ``with`` block's exit.)"""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.places = at, 0

    def __call__(self, frame, event, arg):
        if event in ("call", "c_return") and frame.f_code.co_filename.startswith(_OURS):
            self.places += 1
            if self.places == self.at:
                signal.raise_signal(signal.SIGINT)


def _profiled_generate(engine, profile, speculative):
    sys.setprofile(profile)
    try:
        return engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, speculative=speculative, draft_width=6)
    finally:
        sys.setprofile(None)


def test_a_real_sigint_at_any_moment_leaves_the_engine_usable(engines, greedy):
    """A real SIGINT lands at places spread over the whole generation (greedy and speculative, with and without
    prefix reuse): every one interrupts it, and after each the next generation is the greedy one and no request is
    left running."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    landed: list[tuple[str, int, int]] = []
    try:
        for engine in engines:
            for speculative in (None, _replay(engine, greedy)):
                engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)  # the state every run below starts from
                count = SigintAt()
                assert _profiled_generate(engine, count, speculative).token_ids == greedy.token_ids
                for k in range(6):
                    at = 1 + (count.places - 1) * (2 * k + 1) // 12  # spread over the generation
                    with pytest.raises(KeyboardInterrupt):
                        _profiled_generate(engine, SigintAt(at), speculative)
                    landed.append((type(speculative).__name__, at, count.places))
                    assert engine.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids == greedy.token_ids
                    idle = engine.scheduler.wait_until(lambda s: s.ended == s.submitted, timeout_s=30)
                    assert idle, "an interrupt left a request running"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(landed) == 24, landed


def test_onnxruntime_log_lines_go_to_python_logging_not_stderr(tiny_model_dir, tmp_path, capfd, caplog):
    """Once the application routes onnxruntime's log (``route_onnxruntime_logging``, as the command line and the
    server do at start-up), a kernel failure's error arrives as a record on ``ortspec.onnxruntime`` (no ANSI
    colour codes) and nothing reaches the process's stderr; the exception says what failed."""
    from ortspec.backends.onnx import route_onnxruntime_logging

    assert route_onnxruntime_logging()
    folder = tmp_path / "longer-config"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["context_length"] = 1024  # the graph's rotary tables hold 256 positions
    (folder / "genai_config.json").write_text(json.dumps(config))
    engine = Engine.from_dir(folder, BackendConfig(threads=1))
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="ortspec.onnxruntime"):
        with pytest.raises(GenerationError) as info:
            engine.generate(list(range(3, 303)), max_tokens=4, speculative=None)
    assert "cos_cache" in str(info.value.__cause__)
    err = capfd.readouterr().err
    assert "\x1b[" not in err and "onnxruntime" not in err, err
    records = [r for r in caplog.records if r.name == "ortspec.onnxruntime"]
    assert records and records[0].levelno == logging.ERROR and "cos_cache" in records[0].getMessage()
    assert "\x1b[" not in records[0].getMessage() and records[0].ort_logid == "onnxruntime-genai"
    # and the engine still serves prompts that fit the graph
    assert len(engine.generate("hello", max_tokens=3, ignore_eos=True, speculative=None).token_ids) == 3
