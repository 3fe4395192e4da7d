"""Example-based tests of the fake target model and the protocol checks of ``FakeBackend``."""

from __future__ import annotations

import numpy as np
import pytest

from ortspec.backends.base import Backend, BackendError, check_position, check_tokens
from ortspec.backends.fake import FakeBackend, FakeModel


def _snapshot(b: FakeBackend):
    return (b.resident_tokens(), b.current_len(), b.passes, b.tokens_processed)


@pytest.fixture
def model():
    return FakeModel(vocab_size=32, seed=3)


@pytest.fixture
def backend(model):
    return FakeBackend(model, max_length=16)


def test_is_a_backend(backend):
    assert isinstance(backend, Backend)
    assert backend.vocab_size == 32
    assert backend.max_length == 16
    assert backend.current_len() == 0


def test_decode_returns_float32_vocab_row_and_grows_the_cache(backend):
    out = backend.decode([1, 2, 3], 0)
    assert out.shape == (32,) and out.dtype == np.float32
    assert backend.current_len() == 3
    assert backend.resident_tokens() == (1, 2, 3)
    assert backend.passes == 1 and backend.tokens_processed == 3


def test_decode_verify_returns_one_row_per_token(backend):
    backend.decode([1], 0)
    rows = backend.decode_verify([4, 5, 6], 1)
    assert rows.shape == (3, 32) and rows.dtype == np.float32
    assert backend.current_len() == 4


def test_decode_at_the_wrong_position_raises_and_changes_nothing(backend):
    backend.decode([1, 2], 0)
    before = _snapshot(backend)
    with pytest.raises(BackendError, match="past=1 but the KV cache holds 2 positions"):
        backend.decode([3], 1)
    with pytest.raises(BackendError, match="past=3"):
        backend.decode([3], 3)
    with pytest.raises(BackendError, match="base=0"):
        backend.decode_verify([3, 4], 0)
    assert _snapshot(backend) == before
    # Still usable, and still the same model after the refused calls.
    assert np.array_equal(backend.decode([3], 2), backend.model.logits_for([1, 2, 3]))


def test_rewind_out_of_range_raises(backend):
    backend.decode([1, 2, 3], 0)
    before = _snapshot(backend)
    for bad in (-1, 4, 100, True):
        with pytest.raises(BackendError, match="rewind"):
            backend.rewind(bad)
    assert _snapshot(backend) == before
    backend.rewind(3)  # a no-op rewind is fine
    assert backend.current_len() == 3
    backend.rewind(0)
    assert backend.current_len() == 0


def test_capacity_overflow_raises_and_changes_nothing(model):
    b = FakeBackend(model, max_length=5)
    with pytest.raises(BackendError, match="exceed the KV capacity of 5"):
        b.decode([1] * 6, 0)
    assert _snapshot(b) == ((), 0, 0, 0)
    b.decode([1, 2, 3], 0)
    before = _snapshot(b)
    with pytest.raises(BackendError, match="exceed the KV capacity"):
        b.decode_verify([4, 5, 6], 3)
    assert _snapshot(b) == before
    b.decode_verify([4, 5], 3)  # exactly full is fine
    assert b.current_len() == 5
    with pytest.raises(BackendError, match="exceed"):
        b.decode([1], 5)


@pytest.mark.parametrize("bad", [32, 1000, -1])
def test_ids_outside_the_vocabulary_raise(backend, bad):
    backend.decode([1], 0)
    before = _snapshot(backend)
    with pytest.raises(BackendError, match=f"token id {bad}, outside the vocabulary"):
        backend.decode([2, bad], 1)
    with pytest.raises(BackendError, match="outside the vocabulary"):
        backend.decode_verify([bad], 1)
    assert _snapshot(backend) == before


def test_empty_pass_raises(backend):
    with pytest.raises(BackendError, match="empty"):
        backend.decode([], 0)
    with pytest.raises(BackendError, match="empty"):
        backend.decode_verify([], 0)


def test_verify_rows_equal_sequential_decodes_exactly(model):
    prompt, tokens = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3]
    a = FakeBackend(model)
    a.decode(prompt, 0)
    rows = a.decode_verify(tokens, len(prompt)).copy()
    b = FakeBackend(model)
    b.decode(prompt, 0)
    for i, t in enumerate(tokens):
        row = b.decode([t], len(prompt) + i)
        assert np.array_equal(rows[i], row)
    assert a.resident_tokens() == b.resident_tokens()


def test_decode_of_many_tokens_returns_the_last_row(model):
    a = FakeBackend(model)
    last = a.decode([7, 8, 9], 0).copy()
    b = FakeBackend(model)
    assert np.array_equal(b.decode_verify([7, 8, 9], 0)[-1], last)


def test_rewind_then_decode_equals_fresh_decode(model):
    b = FakeBackend(model)
    b.decode([1, 2, 3, 4, 5], 0)
    b.decode_verify([6, 7, 8], 5)
    b.rewind(4)
    assert b.resident_tokens() == (1, 2, 3, 4)
    got = b.decode_verify([9, 10], 4).copy()
    fresh = FakeBackend(model)
    fresh.decode([1, 2, 3, 4], 0)
    want = fresh.decode_verify([9, 10], 4)
    assert np.array_equal(got, want)


def test_reset_empties_the_cache(model):
    b = FakeBackend(model)
    first = b.decode([1, 2, 3], 0).copy()
    b.reset()
    assert b.current_len() == 0 and b.resident_tokens() == ()
    assert np.array_equal(b.decode([1, 2, 3], 0), first)


def test_logits_for_matches_backend_rows(model):
    ctx = [5, 17, 2, 31, 0, 8, 8]
    b = FakeBackend(model)
    b.decode(ctx[:2], 0)
    rows = b.decode_verify(ctx[2:], 2)
    for i in range(2, len(ctx)):
        assert np.array_equal(rows[i - 2], model.logits_for(ctx[: i + 1]))


def test_greedy_matches_argmax_of_backend_decodes(model):
    prompt = [4, 4, 2]
    b = FakeBackend(model)
    row = b.decode(prompt, 0)
    out = []
    for _ in range(12):
        t = int(np.argmax(row))
        out.append(t)
        row = b.decode([t], b.current_len())
    assert model.greedy(prompt, 12) == out


def test_logits_depend_on_the_whole_context(model):
    # Same last token, different earlier token: the whole-context part changes the row.
    assert not np.array_equal(model.logits_for([1, 2, 3]), model.logits_for([9, 2, 3]))


def test_model_is_deterministic_and_seeded():
    a = FakeModel(vocab_size=16, seed=1)
    b = FakeModel(vocab_size=16, seed=1)
    c = FakeModel(vocab_size=16, seed=2)
    assert np.array_equal(a.logits_for([1, 2]), b.logits_for([1, 2]))
    assert not np.array_equal(a.logits_for([1, 2]), c.logits_for([1, 2]))
    # Calls never change the model: after other calls (and a caller writing into a returned row), the model
    # gives what a fresh one gives.
    first = a.logits_for([1, 2])
    first[:] = 0.0
    a.greedy([5, 6], 20)
    a.after([2, 1]).then(3).logits()
    assert np.array_equal(a.logits_for([1, 2]), b.logits_for([1, 2]))
    assert a.greedy([3], 10) == b.greedy([3], 10)
    # The carried context gives what the whole context gives.
    state = a.after([])
    for i, t in enumerate([4, 9, 9, 1, 15]):
        state = state.then(t)
        assert np.array_equal(state.logits(), b.logits_for([4, 9, 9, 1, 15][: i + 1]))


def test_high_markov_weight_makes_the_last_token_decide():
    m = FakeModel(vocab_size=16, seed=5, markov=50.0, noise=1.0)
    for last in range(16):
        picks = {int(np.argmax(m.logits_for([first, 9, last]))) for first in range(16)}
        assert len(picks) == 1


def test_tie_rate_one_plants_exact_and_near_ties():
    m = FakeModel(vocab_size=24, seed=11, tie_rate=1.0, near_tie_gap=1e-3)
    exact = near = 0
    for start in range(24):
        ctx = [start]
        for _ in range(12):
            row = m.logits_for(ctx)
            top = np.sort(row)[::-1]
            gap = float(top[0] - top[1])
            if gap == 0.0:
                exact += 1
                best = np.flatnonzero(row == top[0])
                assert len(best) >= 2
                assert int(np.argmax(row)) == int(best.min())  # greedy takes the lowest id
            else:
                near += 1
                assert gap == pytest.approx(1e-3, rel=1e-2)
            ctx.append(int(np.argmax(row)))
    assert exact > 20 and near > 20


def test_tie_rate_zero_plants_no_ties():
    m = FakeModel(vocab_size=24, seed=11, tie_rate=0.0, near_tie_gap=1e-3)
    for start in range(24):
        top = np.sort(m.logits_for([start, 1, 2]))[::-1]
        assert top[0] - top[1] > 1e-3


def test_eos_rate_one_always_picks_eos():
    m = FakeModel(vocab_size=16, seed=2, eos_id=7, eos_rate=1.0)
    for ctx in ([1], [1, 2], [5, 5, 5], [7]):
        assert int(np.argmax(m.logits_for(ctx))) == 7
    assert m.greedy([3], 5) == [7] * 5


def test_eos_rate_fraction_sometimes_picks_eos():
    m = FakeModel(vocab_size=16, seed=2, eos_id=7, eos_rate=0.2)
    picks = [int(np.argmax(m.logits_for([a, b]))) for a in range(16) for b in range(16)]
    assert 0 < picks.count(7) < len(picks)


def test_model_validation():
    with pytest.raises(ValueError, match="vocab_size must be >= 2"):
        FakeModel(vocab_size=1)
    with pytest.raises(ValueError, match="eos_id 16 is outside the vocabulary"):
        FakeModel(vocab_size=16, eos_id=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        FakeModel(vocab_size=16, eos_id=-1)


def test_backend_validation(model):
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        FakeBackend(model, max_length=0)


def test_accepts_numpy_token_ids(model):
    b = FakeBackend(model)
    row = b.decode(np.array([1, 2, 3], dtype=np.int64), 0).copy()
    assert b.resident_tokens() == (1, 2, 3)
    assert all(type(t) is int for t in b.resident_tokens())
    assert np.array_equal(row, model.logits_for([1, 2, 3]))


def test_check_helpers():
    check_tokens([0, 9], 10)
    with pytest.raises(BackendError, match="ids is empty"):
        check_tokens([], 10, "ids")
    with pytest.raises(BackendError, match="token id 10"):
        check_tokens([0, 10], 10)
    check_position(3, 3, 2, 5, "past")
    with pytest.raises(BackendError, match="past=2 but the KV cache holds 3"):
        check_position(2, 3, 1, 10, "past")
    with pytest.raises(BackendError, match="2 tokens at position 4 would exceed the KV capacity of 5"):
        check_position(4, 4, 2, 5, "base")


def test_peak_len_tracks_the_most_resident_positions(model):
    b = FakeBackend(model, max_length=16)
    assert b.peak_len == 0
    b.decode([1, 2, 3], 0)
    b.decode_verify([4, 5, 6, 7], 3)
    assert b.peak_len == 7
    b.rewind(2)
    assert b.peak_len == 7
    b.decode([9], 2)
    assert b.peak_len == 7
    with pytest.raises(BackendError):
        b.decode([1] * 20, 3)
    assert b.peak_len == 7  # a refused pass changes nothing
