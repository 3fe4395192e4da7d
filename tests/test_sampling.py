"""Seeded sampling (``ortspec.core.sampling``): the sampler is right, not only consistent.

- Over many seeds at one position, the empirical token frequencies match the processed softmax (temperature
  alone and with each filter): a chi-square test whose threshold a correct sampler exceeds with probability 1e-6
  (Wilson-Hilferty approximation of the chi-square quantile). The seeds are fixed (0..N-1), so the outcome is
  reproducible: this documents a false-alarm rate of the design, not a flaky test.
- On random rows, the core's pick, logprob and alternatives equal the straightforward reference of the property
  suite (``property_tests/reference.py``) for every combination of filters and penalties.
- Options validation names the field; seeds matter; greedy is untouched.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ortspec import Options, PromptLookup, generate
from ortspec.backends.fake import FakeBackend, FakeModel
from ortspec.core.sampling import StepContext, splitmix64, uniform
from property_tests.reference import PickRules, reference_pick

ROW = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
DRAWS = 20_000


def draw_counts(row: np.ndarray, draws: int = DRAWS, **rules) -> np.ndarray:
    """How often each token is picked at index 0 over seeds 0..draws-1."""
    counts = np.zeros(len(row), dtype=np.int64)
    for seed in range(draws):
        ctx = StepContext(Options(seed=seed, **rules).sampling, (0,), ())
        counts[ctx.pick(row, 0, (), margin=False, top_n=0).token] += 1
    return counts


def expected_probs(row: np.ndarray, temperature: float, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The processed softmax, written naively: sort, cut, renormalize."""
    z = row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(row)), key=lambda i: (-p[i], i))
    keep = set(order[:top_k] if top_k else order)
    if top_p < 1.0:
        q = p.copy()
        q[[i for i in range(len(row)) if i not in keep]] = 0
        q /= q.sum()
        acc, nucleus = 0.0, set()
        for i in order:
            if i in keep:
                nucleus.add(i)
                acc += q[i]
                if acc >= top_p:
                    break
        keep &= nucleus
    if min_p > 0:
        keep = {i for i in keep if p[i] >= min_p * p.max()}
    out = np.array([p[i] if i in keep else 0.0 for i in range(len(row))])
    return out / out.sum()


def chi_square_threshold(df: int, z: float = 4.753) -> float:
    """The chi-square quantile a correct sampler exceeds with probability ~1e-6 (z: the normal 1 - 1e-6
    quantile), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "rules",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1.8),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
    ],
    ids=["t1", "t0.7", "t1.8", "top_k", "top_p", "min_p", "all"],
)
def test_frequencies_match_the_processed_softmax(rules):
    counts = draw_counts(ROW, **rules)
    expected = expected_probs(ROW, **rules) * DRAWS
    assert (counts[expected == 0] == 0).all(), "a filtered-out token was sampled"
    support = expected > 0
    chi2 = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    assert chi2 < chi_square_threshold(df), (chi2, counts, expected.round())


def test_uniform_is_splitmix64_of_seed_and_index():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output of SplitMix64 seeded with 0
    u = [uniform(7, i) for i in range(1000)]
    assert all(0.0 <= x < 1.0 for x in u) and len(set(u)) == 1000
    assert abs(np.mean(u) - 0.5) < 0.03
    # The documented rule: the top 53 bits of SplitMix64 of seed XOR (index * golden ratio), 64-bit arithmetic.
    for seed, index in [(7, 3), (0, 0), (8, 3), (2**64 - 1, 123_456), (12345, 2**40)]:
        state = (seed ^ (index * 0x9E3779B97F4A7C15)) & (2**64 - 1)
        assert uniform(seed, index) == (splitmix64(state) >> 11) / 2**53, (seed, index)
    assert uniform(7, 3) != uniform(8, 3) and uniform(7, 3) != uniform(7, 4)


RULE_SETS = [
    PickRules(temperature=0.7, seed=1),
    PickRules(temperature=1.3, top_k=4, seed=2),
    PickRules(temperature=0.9, top_p=0.5, seed=3),
    PickRules(temperature=1.0, min_p=0.1, seed=4),
    PickRules(temperature=0.5, top_k=10, top_p=0.9, min_p=0.02, seed=5, repetition_penalty=1.3),
    PickRules(temperature=2.0, seed=6, presence_penalty=0.5, frequency_penalty=0.7, logit_bias=((3, 5.0), (9, -100.0))),
    PickRules(repetition_penalty=0.8, logit_bias=((1, 2.5),)),  # greedy with processors
    PickRules(),
]


@pytest.mark.parametrize("rules", RULE_SETS, ids=[f"rules{i}" for i in range(len(RULE_SETS))])
@pytest.mark.parametrize("vocab", [2, 17, 300, 4096])
def test_picks_equal_the_reference_on_random_rows(rules, vocab):
    rng = np.random.default_rng(vocab)
    options = Options(
        temperature=rules.temperature, top_k=rules.top_k, top_p=rules.top_p, min_p=rules.min_p, seed=rules.seed,
        repetition_penalty=rules.repetition_penalty, presence_penalty=rules.presence_penalty,
        frequency_penalty=rules.frequency_penalty, logit_bias=[(t % vocab, b) for t, b in rules.logit_bias],
    )  # fmt: skip
    rules = PickRules(**{**rules.__dict__, "logit_bias": options.logit_bias})
    for trial in range(40):
        row = (rng.standard_normal(vocab) * rng.choice([0.3, 2.0, 6.0])).astype(np.float32)
        if trial % 5 == 0:
            row[rng.integers(0, vocab, size=max(1, vocab // 3))] = -np.inf  # masked tokens
            row[0] = 1.0
        prompt = tuple(int(t) for t in rng.integers(0, vocab, size=5))
        generated = tuple(int(t) for t in rng.integers(0, vocab, size=int(rng.integers(0, 6))))
        got = StepContext(options.sampling, prompt, generated).pick(row, 0, (), margin=False, top_n=3)
        token, record = reference_pick(row, rules, prompt, generated, top_n=3)
        assert got.token == token
        assert record is not None
        assert got.logprob == pytest.approx(record[0], abs=1e-9)
        assert [t for t, _ in got.top] == [t for t, _ in record[1]]


def test_seeds_matter_on_a_flat_model():
    model = FakeModel(vocab_size=64, seed=1, markov=0.0, noise=0.05)
    outputs = {
        generate(FakeBackend(model), (1, 2, 3), Options(max_new_tokens=12, temperature=1.0, seed=s)).token_ids
        for s in range(20)
    }
    assert len(outputs) == 20


def test_the_same_seed_replays_and_speculation_keeps_it():
    model = FakeModel(vocab_size=32, seed=2, markov=3.0)
    options = Options(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=99)
    plain = generate(FakeBackend(model), (1, 2, 3, 1, 2), options)
    again = generate(FakeBackend(model), (1, 2, 3, 1, 2), options)
    spec = generate(FakeBackend(model), (1, 2, 3, 1, 2), options, PromptLookup(), draft_width=6)
    assert plain.token_ids == again.token_ids == spec.token_ids
    assert plain.seed == spec.seed == 99
    assert spec.stats.verification_steps > 0


def test_greedy_is_the_temperature_zero_case():
    model = FakeModel(vocab_size=32, seed=3)
    assert generate(FakeBackend(model), (5, 6), Options(max_new_tokens=20)).token_ids == tuple(model.greedy((5, 6), 20))
    assert generate(FakeBackend(model), (5, 6), Options(max_new_tokens=20)).seed is None


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=0.5), "seed"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty="x"), "frequency_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_bad_sampling_options_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        Options(**bad)


def test_logit_bias_outside_the_vocabulary_is_refused_before_any_pass():
    backend = FakeBackend(FakeModel(vocab_size=16))
    with pytest.raises(ValueError, match="logit_bias"):
        generate(backend, (1, 2), Options(logit_bias={16: 1.0}))
    assert backend.passes == 0


def test_a_non_finite_row_is_refused_even_where_filters_would_drop_it():
    row = ROW.copy()
    row[-1] = np.nan  # the least likely token: top_k would drop it
    ctx = StepContext(Options(temperature=1.0, top_k=2, seed=1).sampling, (0,), ())
    with pytest.raises(ValueError, match="not finite"):
        ctx.pick(row, 0, (), margin=False, top_n=0)
    with pytest.raises(ValueError, match="not finite"):
        ctx.pick(np.full(8, -np.inf, np.float32), 0, (), margin=False, top_n=0)
