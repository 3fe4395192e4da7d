"""Example-based tests of the decode loop (``ortspec.driver``) over the fake backend."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from ortspec.backends.fake import FakeBackend, FakeModel
from ortspec.core import FinishReason, FixedWidth, Options, PromptLookup
from ortspec.driver import GenerateResult, Generation, GenerationAborted, GenerationError, ProposerError, generate

VOCAB = 32
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)

# Byte pieces (ASCII words and the three bytes of U+20AC) so that text arrives in partial characters.
PIECES = (b"a", b"b", b" ", b"\xe2", b"\x82", b"\xac", b"E", b"ND", b"xy", b"\n", b"", b"c")


def detok(ids) -> str:
    return b"".join(PIECES[int(i) % len(PIECES)] for i in ids).decode("utf-8", errors="replace")


def make_model(seed: int = 0, **kw) -> FakeModel:
    kw.setdefault("markov", 4.0)  # repetitive text: prompt lookup finds matches
    return FakeModel(vocab_size=VOCAB, seed=seed, **kw)


class RecordingBackend(FakeBackend):
    """A FakeBackend that records every pass's tokens."""

    def __init__(self, model, max_length=4096):
        super().__init__(model, max_length)
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def decode(self, tokens, past):
        self.calls.append(("decode", tuple(int(t) for t in tokens)))
        return super().decode(tokens, past)

    def decode_verify(self, tokens, base):
        self.calls.append(("verify", tuple(int(t) for t in tokens)))
        return super().decode_verify(tokens, base)


class DeviceAcceptBackend(RecordingBackend):
    """A backend offering ``verify_picks`` (the device-side accept path: the driver feeds ``step_from_picks``)."""

    def __init__(self, model, max_length=4096):
        super().__init__(model, max_length)
        self.picks_on_device = True

    def verify_picks(self, tokens, base):
        self.calls.append(("argmax", tuple(int(t) for t in tokens)))
        return FakeBackend.verify_picks(self, tokens, base)


class Oracle:
    """Proposes exactly the greedy continuation (every draft token is accepted); ``extra`` more than asked."""

    def __init__(self, model, extra: int = 0, as_list: bool = False):
        self.model, self.extra, self.as_list = model, extra, as_list
        self.calls: list[tuple[tuple[int, ...], int]] = []

    def propose(self, draft_context):
        context_tokens, width = draft_context.tokens, draft_context.width
        self.calls.append((tuple(context_tokens), width))
        out = self.model.greedy(context_tokens, width + self.extra)
        return out if self.as_list else tuple(out)


class Fixed:
    """Always proposes the same tokens."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, draft_context):
        return self.tokens


# --------------------------------------------------------------------------------------------------------------
# Output equals greedy decoding


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_plain_generate_equals_greedy(seed):
    model = make_model(seed)
    backend = FakeBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=30))
    assert list(r.token_ids) == model.greedy(PROMPT, 30)
    assert r.finish_reason is FinishReason.MAX_TOKENS
    assert r.stats.steps == 30
    assert r.stats.verification_steps == 0 and r.stats.proposed_tokens == 0
    assert r.stats.steps == 30 == backend.passes  # the prompt pass picks the first token
    assert r.prompt_tokens == len(PROMPT)
    assert r.logprobs is None


@pytest.mark.parametrize("width", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 5])
def test_prompt_lookup_generate_equals_greedy(seed, width):
    model = make_model(seed)
    r = generate(FakeBackend(model), PROMPT, Options(max_tokens=40), PromptLookup(), draft_width=width)
    assert list(r.token_ids) == model.greedy(PROMPT, 40)
    assert r.finish_reason is FinishReason.MAX_TOKENS


def test_prompt_lookup_accepts_tokens_on_repetitive_text():
    model = make_model(0, markov=20.0)
    backend = FakeBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=60), PromptLookup(), draft_width=4)
    assert list(r.token_ids) == model.greedy(PROMPT, 60)
    assert r.stats.accepted_tokens > 20
    assert r.stats.steps < 60


def test_oracle_proposer_fills_every_pass():
    model = make_model(3)
    backend = RecordingBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=20), Oracle(model), draft_width=3)
    assert list(r.token_ids) == model.greedy(PROMPT, 20)
    assert r.stats.accepted_tokens == r.stats.proposed_tokens
    assert r.stats.steps == 6  # prompt pass 1, then 4 + 4 + 4 + 4, then 3 (the budget caps the last draft)
    verify = [t for kind, t in backend.calls if kind == "verify"]
    assert all(len(t) <= 4 for t in verify)


def test_device_accept_path_equals_greedy():
    model = make_model(4)
    backend = DeviceAcceptBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=30), PromptLookup(), draft_width=4)
    assert list(r.token_ids) == model.greedy(PROMPT, 30)
    kinds = {kind for kind, _ in backend.calls}
    assert kinds == {"decode", "argmax"}  # prefill, then every step through verify_picks
    assert r.stats.steps == backend.passes


def test_device_accept_is_skipped_for_logprobs():
    model = make_model(4)
    backend = DeviceAcceptBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=10, top_logprobs=2), Oracle(model), draft_width=2)
    assert list(r.token_ids) == model.greedy(PROMPT, 10)
    assert "argmax" not in {kind for kind, _ in backend.calls}
    assert len(r.logprobs) == 10


def test_one_token_prompt_has_no_prefill():
    model = make_model(2)
    backend = RecordingBackend(model)
    r = generate(backend, [7], Options(max_tokens=6))
    assert list(r.token_ids) == model.greedy([7], 6)
    assert backend.calls[0] == ("decode", (7,))
    assert r.stats.steps == 6 == backend.passes


def test_prompt_pass_picks_the_first_token():
    model = make_model(2)
    backend = RecordingBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=2))
    assert backend.calls[0] == ("decode", PROMPT)
    assert backend.calls[1] == ("decode", (r.token_ids[0],))
    assert len(backend.calls) == 2


def test_eos_ends_generation_like_greedy():
    model = make_model(1, eos_id=0, eos_rate=0.08)
    g = model.greedy(PROMPT, 200)
    assert 0 in g
    want = g[: g.index(0) + 1]
    for proposer in (None, PromptLookup(), Oracle(model)):
        r = generate(FakeBackend(model), PROMPT, Options(max_tokens=200, eos_token_ids=0), proposer)
        assert list(r.token_ids) == want
        assert r.finish_reason is FinishReason.EOS_TOKEN


def test_stop_string_through_the_driver():
    model = make_model(6, markov=1.0)
    full = detok(model.greedy(PROMPT, 80))
    stop = next(full[i : i + 3] for i in range(10, 70) if full[i : i + 3].isascii() and full[i : i + 3].strip())
    results = [
        generate(
            FakeBackend(model),
            PROMPT,
            Options(max_tokens=80, stop=[stop]),
            proposer,
            detokenize=detok,
        )
        for proposer in (None, PromptLookup(), Oracle(model))
    ]
    for r in results:
        assert r.finish_reason is FinishReason.STOP_SEQUENCE
        assert r.stop_matched == stop
        assert r.text == full[: full.index(stop)]
        assert (r.token_ids, r.text) == (results[0].token_ids, results[0].text)


def test_stop_token_sequence_through_the_driver():
    model = make_model(8)
    g = model.greedy(PROMPT, 50)
    seq = tuple(g[20:22])
    first = next(i for i in range(len(g) - 1) if tuple(g[i : i + 2]) == seq)
    for proposer in (None, PromptLookup(), Oracle(model)):
        r = generate(FakeBackend(model), PROMPT, Options(max_tokens=50, stop=[seq]), proposer)
        assert list(r.token_ids) == g[: first + 2]
        assert r.stop_matched == seq


def test_logprobs_through_the_driver_are_the_same_with_and_without_speculation():
    model = make_model(9)
    opts = Options(max_tokens=15, top_logprobs=3)
    plain = generate(FakeBackend(model), PROMPT, opts)
    spec = generate(FakeBackend(model), PROMPT, opts, Oracle(model), draft_width=4)
    assert plain.token_ids == spec.token_ids
    assert len(plain.logprobs) == len(plain.token_ids)
    assert plain.logprobs == spec.logprobs
    for rec, tok in zip(plain.logprobs, plain.token_ids, strict=True):
        assert rec.token_id == tok and rec.top[0][0] == tok


def test_tie_guard_with_planted_ties_still_equals_greedy():
    model = make_model(10, tie_rate=0.5, near_tie_gap=1e-4)
    opts = Options(max_tokens=40, tie_margin=1e-3)
    r = generate(FakeBackend(model), PROMPT, opts, Oracle(model), draft_width=4)
    assert list(r.token_ids) == model.greedy(PROMPT, 40)
    assert r.stats.tie_guard_stops > 0
    r2 = generate(DeviceAcceptBackend(model), PROMPT, opts, Oracle(model), draft_width=4)
    assert r2.token_ids == r.token_ids
    assert r2.stats == r.stats


# --------------------------------------------------------------------------------------------------------------
# Streaming callback and abort


def _recorder(into: list):
    """A stream callback ``(text, token_id, finish_reason)`` that records each call as a ``Commit``-like triple."""

    def cb(text, token_id, finish_reason):
        into.append(Delivered(text, token_id, finish_reason))

    return cb


class Delivered(NamedTuple):
    text: str
    token_id: int
    finish_reason: object


def test_callback_receives_commits_in_order():
    model = make_model(11)
    got: list = []
    r = generate(
        FakeBackend(model),
        PROMPT,
        Options(max_tokens=30),
        PromptLookup(),
        draft_width=4,
        callback=_recorder(got),
        detokenize=detok,
    )
    assert tuple(c.token_id for c in got) == r.token_ids
    assert "".join(c.text for c in got) == r.text == detok(r.token_ids)
    assert [c.finish_reason for c in got] == [None] * (len(got) - 1) + [r.finish_reason]


def test_callback_deltas_with_stop_string_concatenate_to_the_text():
    model = make_model(12, markov=1.0)
    full = detok(model.greedy(PROMPT, 60))
    stop = full[30:32]
    got: list = []
    r = generate(
        FakeBackend(model),
        PROMPT,
        Options(max_tokens=60, stop=stop),
        Oracle(model),
        draft_width=5,
        callback=_recorder(got),
        detokenize=detok,
    )
    assert "".join(c.text for c in got) == r.text
    assert tuple(c.token_id for c in got) == r.token_ids
    assert stop not in r.text


class Boom(RuntimeError):
    pass


def _raise_at(n: int, received: list):
    def cb(text, token_id, finish_reason):
        received.append(Delivered(text, token_id, finish_reason))
        if len(received) == n:
            raise Boom(f"stop at {n}")

    return cb


@pytest.mark.parametrize("n", [1, 3, 6])
def test_callback_raising_mid_block_aborts_with_the_streamed_tokens(n):
    model = make_model(13)
    backend = FakeBackend(model)
    received: list = []
    with pytest.raises(GenerationAborted) as info:
        # The oracle's drafts are all accepted: each pass commits 5 tokens, so commit 3 is mid-block.
        generate(
            backend,
            PROMPT,
            Options(max_tokens=30, top_logprobs=1),
            Oracle(model),
            draft_width=4,
            callback=_raise_at(n, received),
            detokenize=detok,
        )
    exc = info.value
    assert isinstance(exc.__cause__, Boom)
    assert str(exc.__cause__) == f"stop at {n}"
    partial = exc.partial
    assert isinstance(partial, GenerateResult)
    assert partial.token_ids == tuple(c.token_id for c in received)
    assert len(partial.token_ids) == n
    assert partial.text == "".join(c.text for c in received)
    assert partial.finish_reason is None
    assert partial.stop_matched is None
    assert len(partial.logprobs) == n
    assert list(partial.token_ids) == model.greedy(PROMPT, n)
    # The backend is usable for a new generation.
    r = generate(backend, PROMPT, Options(max_tokens=10))
    assert list(r.token_ids) == model.greedy(PROMPT, 10)
    assert backend.current_len() == len(PROMPT) + 10 - 1


def test_callback_raising_before_a_stop_in_the_same_block_reports_no_stop():
    model = make_model(14)
    g = model.greedy(PROMPT, 30)
    seq = (g[3], g[4])
    assert all(tuple(g[i : i + 2]) != seq for i in range(3))
    received: list = []
    with pytest.raises(GenerationAborted) as info:
        generate(
            FakeBackend(model),
            PROMPT,
            Options(max_tokens=30, stop=[seq]),
            Oracle(model),
            draft_width=6,
            callback=_raise_at(2, received),
        )
    partial = info.value.partial
    assert partial.token_ids == tuple(g[:2])
    assert partial.finish_reason is None
    assert partial.stop_matched is None


def test_callback_raising_on_the_last_commit_keeps_every_token():
    model = make_model(15)
    received: list = []
    with pytest.raises(GenerationAborted) as info:
        generate(FakeBackend(model), PROMPT, Options(max_tokens=5), callback=_raise_at(5, received))
    assert info.value.partial.token_ids == tuple(model.greedy(PROMPT, 5))


def test_callback_base_exception_is_not_wrapped():
    def cb(text, token_id, finish_reason):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(FakeBackend(make_model()), PROMPT, Options(max_tokens=3), callback=cb)


def test_generation_iterator_partial_result_and_done():
    model = make_model(16)
    run = Generation(FakeBackend(model), PROMPT, Options(max_tokens=12), Oracle(model), draft_width=4)
    it = iter(run)
    first = [next(it) for _ in range(3)]
    assert not run.done
    partial = run.result()
    assert partial.token_ids == tuple(c.token_id for c in first)
    assert partial.finish_reason is None
    rest = list(it)
    assert run.done
    final = run.result()
    assert final.token_ids == tuple(c.token_id for c in first + rest) == tuple(model.greedy(PROMPT, 12))
    assert final.finish_reason is FinishReason.MAX_TOKENS


# --------------------------------------------------------------------------------------------------------------
# Proposer handling


def test_proposer_returning_too_many_tokens_is_truncated():
    model = make_model(17)
    backend = RecordingBackend(model)
    proposer = Oracle(model, extra=10)
    r = generate(backend, PROMPT, Options(max_tokens=25), proposer, draft_width=3)
    assert list(r.token_ids) == model.greedy(PROMPT, 25)
    assert all(len(t) <= 1 + 3 for kind, t in backend.calls if kind == "verify")
    assert r.stats.proposed_tokens <= 3 * r.stats.verification_steps


def test_proposer_returning_an_out_of_vocab_id_raises_before_the_backend_sees_it():
    model = make_model(18)
    backend = RecordingBackend(model)
    with pytest.raises(GenerationError, match=f"token id {VOCAB}, outside the vocabulary") as info:
        generate(backend, PROMPT, Options(max_tokens=10), Fixed((1, VOCAB)), draft_width=4)
    assert isinstance(info.value.__cause__, ProposerError)
    assert info.value.partial.token_ids == tuple(model.greedy(PROMPT, 1))  # the prompt pass's token is kept
    assert all(max(t) < VOCAB for _, t in backend.calls)
    assert [kind for kind, _ in backend.calls] == ["decode"]  # only the prefill


def test_proposer_returning_a_negative_id_raises():
    backend = RecordingBackend(make_model())
    with pytest.raises(GenerationError, match="not a token id") as info:
        generate(backend, PROMPT, Options(max_tokens=10), Fixed((-1,)), draft_width=4)
    assert isinstance(info.value.__cause__, ProposerError)
    assert [kind for kind, _ in backend.calls] == ["decode"]


def test_proposer_returning_a_list_or_array_works():
    model = make_model(19)
    for proposer in (Oracle(model, as_list=True), Fixed([1, 2, 3]), Fixed(np.array([1, 2], dtype=np.int64))):
        r = generate(FakeBackend(model), PROMPT, Options(max_tokens=12), proposer, draft_width=4)
        assert list(r.token_ids) == model.greedy(PROMPT, 12)


def test_proposer_returning_nothing_is_a_plain_step():
    model = make_model(20)
    r = generate(FakeBackend(model), PROMPT, Options(max_tokens=8), Fixed(()), draft_width=4)
    assert list(r.token_ids) == model.greedy(PROMPT, 8)
    assert r.stats.verification_steps == 0


def test_proposer_sees_the_context_and_a_capped_width():
    model = make_model(21)
    proposer = Oracle(model)
    r = generate(FakeBackend(model), PROMPT, Options(max_tokens=10), proposer, draft_width=4)
    g = model.greedy(PROMPT, 10)
    assert proposer.calls[0] == (PROMPT + (g[0],), 4)  # the prompt pass already picked g[0]
    for context, width in proposer.calls:
        done = len(context) - len(PROMPT)
        assert context == PROMPT + tuple(g[:done])
        assert 1 <= width <= min(4, 10 - done - 1)
    assert list(r.token_ids) == g


def test_width_policy_observes_every_step():
    class Recorder:
        def __init__(self, log):
            self.log = log

        def width(self):
            return 3

        def observe(self, proposed, accepted):
            self.log.append((proposed, accepted))
            return self

    log: list = []
    model = make_model(22)
    r = generate(FakeBackend(model), PROMPT, Options(max_tokens=30), PromptLookup(), draft_width=Recorder(log))
    assert list(r.token_ids) == model.greedy(PROMPT, 30)
    assert len(log) == r.stats.steps - 1  # every step after the prompt pass
    assert sum(p for p, _ in log) == r.stats.proposed_tokens
    assert sum(a for _, a in log) == r.stats.accepted_tokens
    assert all(0 <= a <= p <= 3 for p, a in log)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_bad_draft_width(bad):
    with pytest.raises(ValueError, match="draft_width must be an int >= 1"):
        generate(FakeBackend(make_model()), PROMPT, Options(max_tokens=3), PromptLookup(), draft_width=bad)


def test_fixed_width_policy():
    p = FixedWidth(5)
    assert p.width() == 5
    assert p.observe(5, 0) is p
    r = generate(FakeBackend(make_model()), PROMPT, Options(max_tokens=5), PromptLookup(), draft_width=p)
    assert len(r.token_ids) == 5


# --------------------------------------------------------------------------------------------------------------
# Stats, KV length, context limits


@pytest.mark.parametrize(
    "proposer, width",
    [(None, 8), ("lookup", 1), ("lookup", 5), ("oracle", 3), ("fixed", 4)],
)
def test_stats_invariants_and_kv_length(proposer, width):
    model = make_model(23)
    backend = FakeBackend(model)
    prop = {"lookup": PromptLookup(), "oracle": Oracle(model), "fixed": Fixed((1, 2, 3, 4)), None: None}[proposer]
    r = generate(backend, PROMPT, Options(max_tokens=33), prop, draft_width=width)
    s = r.stats
    assert list(r.token_ids) == model.greedy(PROMPT, 33)
    assert 0 <= s.accepted_tokens <= s.proposed_tokens
    assert s.verification_steps <= s.steps
    assert s.multi_token_accepts <= s.verification_steps
    assert s.steps == backend.passes
    assert s.proposed_tokens <= width * s.verification_steps
    assert s.steps + s.accepted_tokens == len(r.token_ids)  # each pass commits its accepted drafts + 1
    assert backend.current_len() == len(PROMPT) + len(r.token_ids) - 1
    assert backend.resident_tokens() == PROMPT + r.token_ids[:-1]


def test_max_context_defaults_to_backend_capacity():
    model = make_model(24)
    for proposer in (None, PromptLookup(), Oracle(model)):
        backend = FakeBackend(model, max_length=10)
        r = generate(backend, PROMPT[:6], Options(max_tokens=100), proposer)
        assert len(r.token_ids) == 4
        assert r.finish_reason is FinishReason.CONTEXT_FULL
        assert list(r.token_ids) == model.greedy(PROMPT[:6], 4)
        assert backend.peak_len <= 10
        assert backend.current_len() == 9


def test_max_context_larger_than_capacity_is_capped():
    model = make_model(25)
    backend = FakeBackend(model, max_length=12)
    r = generate(backend, PROMPT, Options(max_tokens=100, max_context=1000), Oracle(model))
    assert len(PROMPT) + len(r.token_ids) == 12
    assert r.finish_reason is FinishReason.CONTEXT_FULL
    assert backend.peak_len <= 12


def test_max_context_smaller_than_capacity_is_honoured():
    model = make_model(26)
    backend = FakeBackend(model, max_length=100)
    r = generate(backend, PROMPT, Options(max_tokens=100, max_context=len(PROMPT) + 7), Oracle(model))
    assert len(r.token_ids) == 7
    assert r.finish_reason is FinishReason.CONTEXT_FULL
    assert backend.peak_len <= len(PROMPT) + 7


def test_max_tokens_is_never_overshot_by_a_pass():
    model = make_model(27)
    backend = FakeBackend(model)
    r = generate(backend, PROMPT, Options(max_tokens=7), Oracle(model), draft_width=5)
    assert len(r.token_ids) == 7
    assert backend.peak_len <= len(PROMPT) + 7 - 1  # no pass ever reaches past the last committed token


def test_prompt_longer_than_capacity_raises():
    backend = RecordingBackend(make_model(), max_length=5)
    with pytest.raises(ValueError, match=r"the prompt has 8 tokens but the context \(the KV capacity\) is 5"):
        generate(backend, PROMPT, Options(max_tokens=3))
    assert backend.calls == []


def test_prompt_filling_the_capacity_finishes_with_no_tokens():
    backend = RecordingBackend(make_model(), max_length=len(PROMPT))
    r = generate(backend, PROMPT, Options(max_tokens=3), PromptLookup())
    assert r.token_ids == ()
    assert r.finish_reason is FinishReason.CONTEXT_FULL
    assert r.text == ""
    assert backend.calls == []


@pytest.mark.parametrize("bad, match", [([], "prompt_tokens is empty"), ("hi", "not text"), ([1, -1], "prompt_tokens")])
def test_bad_prompt(bad, match):
    with pytest.raises(ValueError, match=match):
        generate(FakeBackend(make_model()), bad, Options(max_tokens=3))


@pytest.mark.parametrize("prompt", [[1, VOCAB + 3, 2], [VOCAB]])
def test_prompt_id_outside_the_vocabulary_is_refused(prompt):
    # The core checks prompt ids against the backend's vocabulary before any pass.
    backend = RecordingBackend(make_model())
    with pytest.raises(ValueError, match=f"prompt_tokens holds token id {VOCAB + 3 if len(prompt) > 1 else VOCAB}"):
        generate(backend, prompt, Options(max_tokens=3))
    assert backend.calls == []


def test_stop_strings_without_detokenize_raise():
    with pytest.raises(ValueError, match="detokenize"):
        generate(FakeBackend(make_model()), PROMPT, Options(stop="x"))


def test_default_options():
    model = make_model(28)
    r = generate(FakeBackend(model), PROMPT)
    assert len(r.token_ids) == Options().max_tokens
    assert r.finish_reason is FinishReason.MAX_TOKENS


def test_result_timings_and_rate():
    r = generate(FakeBackend(make_model()), PROMPT, Options(max_tokens=5))
    t = r.timings
    assert 0 <= t.prefill_s <= t.total_s
    assert 0 <= t.first_token_s <= t.total_s
    assert 0 <= t.decode_s <= t.total_s
    assert r.tokens_per_second >= 0


def test_on_finish_is_told_the_finished_state_once_when_the_last_commit_is_delivered():
    finished: list = []
    run = Generation(FakeBackend(make_model(), 256), [1, 2, 3], Options(max_tokens=5), on_finish=finished.append)
    commits = iter(run)
    next(commits)
    assert finished == []  # abandoned here, it would never be told
    result = run.run()
    assert len(finished) == 1 and finished[0].finished
    assert tuple(finished[0].generated_tokens) == result.token_ids and len(result.token_ids) == 5
    list(run)
    assert len(finished) == 1
