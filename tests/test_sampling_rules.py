"""Rules of the pick (``core/sampling.py``) seen through decoding, beside the statistical and reference checks of
``test_sampling.py``: ``top_k`` keeps the lowest ids among equal logits, a ``logit_bias`` alone changes greedy
picks on every pick path, and the penalties of a verify row count the draft tokens before it (so speculative
decoding equals plain decoding under penalties)."""

from __future__ import annotations

import threading

import numpy as np

from ortspec import Options, Sampling, generate
from ortspec.backends.fake import FakeBackend, FakeModel
from ortspec.core.state import DecodeState, step


def first_pick(row: np.ndarray, **options) -> int:
    state = DecodeState.start((0,), Options(sampling=Sampling(**options)))
    state, _, _, _, _ = step(state, row, None, ())
    return state.generated_tokens[0]


def test_top_k_keeps_the_lowest_ids_among_equal_logits():
    # ids 1, 2 and 3 tie for the top; top_k=2 keeps 1 and 2, so 3 is never sampled, and both survivors are.
    row = np.array([0.0, 2.0, 2.0, 2.0, 1.5, -1.0], dtype=np.float32)
    picks = {first_pick(row, temperature=1.0, top_k=2, seed=seed) for seed in range(200)}
    assert picks == {1, 2}


def test_top_k_past_the_vocabulary_at_a_temperature_past_float32_is_answered():
    # Found by fuzzing the server (6,000 examples on /v1/completions): at a temperature whose window width (80 T)
    # overflows to inf, top_k's candidate search doubled its threshold to inf and never stopped when the row had no
    # more than k tokens, freezing the batch thread. The temperature is inf in float32, so every token is as likely.
    row = np.random.default_rng(0).normal(size=300).astype(np.float32)
    picks: set[int] = set()
    worker = threading.Thread(
        target=lambda: picks.update(first_pick(row, temperature=5.8e307, top_k=405, seed=s) for s in range(50)),
        daemon=True,
    )
    worker.start()
    worker.join(60.0)  # a bound, not a wait: the picks take milliseconds; the bug never ends
    assert not worker.is_alive(), "the pick did not return"
    assert len(picks) > 25  # uniform over 300 tokens: 50 seeds give about 46 distinct picks


def test_a_logit_bias_alone_changes_greedy_picks_on_every_pick_path():
    model = FakeModel(vocab_size=16, seed=4)
    prompt = (1, 2, 3)
    plain = generate(FakeBackend(model), prompt, Options(max_tokens=6)).token_ids
    favoured = next(t for t in range(16) if t not in plain)
    options = Options(max_tokens=6, sampling=Sampling(logit_bias={plain[0]: -100.0, favoured: 50.0}))
    for picks_on_device in (False, True):  # a device-picks backend computes raw argmaxes: it must not be used
        biased = generate(FakeBackend(model, picks_on_device=picks_on_device), prompt, options).token_ids
        assert biased[0] == favoured and plain[0] not in biased


def test_penalties_count_the_draft_tokens_before_a_verify_row():
    # Plain decoding commits 1, then picks from a row where 1 leads 2 narrowly; each penalty on the already
    # generated 1 makes 2 the pick. A verify pass over the draft (1,) sees the same row after 1: its pick must be
    # 2 as well.
    base = np.array([0.0, 3.0, 0.0, 0.0], dtype=np.float32)
    after = np.array([0.0, 2.0, 1.9, 0.0], dtype=np.float32)
    for penalty in ({"repetition_penalty": 2.0}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}):
        options = Options(max_tokens=8, sampling=Sampling(**penalty))
        plain = DecodeState.start((0,), options)
        plain, _, _, _, _ = step(plain, base, None, ())
        plain, _, _, _, _ = step(plain, after, None, ())
        spec, _, _, _, _ = step(DecodeState.start((0,), options), base, after[None, :], (1,))
        assert spec.generated_tokens == plain.generated_tokens == (1, 2), penalty
