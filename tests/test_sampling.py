"""Seeded sampling (``ortspec.core.sampling``): the sampler is right, not only consistent.

- Over many seeds, the empirical token frequencies match the processed softmax: a chi-square test whose
  threshold a correct sampler exceeds with probability 1e-6 (Wilson-Hilferty approximation of the chi-square
  quantile). Covered: temperature alone and with each filter at the first position; positions after the first
  (later generated tokens and rows inside a draft block), and two positions of one seed drawn independently
  (their joint frequencies match the product); vocabularies of several CDF blocks (256 survivors each) with masked
  tokens among them; and each penalty (repetition over prompt + generated + drafted tokens, presence and frequency
  over generated + drafted ones), against a processed distribution written naively here from the rules. The
  seeds are fixed (0..N-1), so the outcome is reproducible: this documents a false-alarm rate of the design, not
  a flaky test.
- On random rows, the core's pick, logprob and alternatives equal the straightforward reference of the property
  suite (``property_tests/reference.py``) for every combination of filters and penalties.
- Options validation names the field; seeds matter; greedy is untouched.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from ortspec import Options, PromptLookup, generate
from ortspec.backends.fake import FakeBackend, FakeModel
from ortspec.core.checks import ArgumentError
from ortspec.core.sampling import F32_MAX, F32_TINY, Sampling, StepContext, splitmix64, uniform
from property_tests.reference import PickRules, reference_pick

ROW = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
DRAWS = 20_000


def draw_counts(row: np.ndarray, draws: int = DRAWS, prompt=(0,), generated=(), drafted=(), **rules) -> np.ndarray:
    """How often each token is picked over seeds 0..draws-1, at the row after ``prompt + generated + drafted``
    (the row of index ``len(drafted)`` in its step: the token's index is ``len(generated) + len(drafted)``)."""
    counts = np.zeros(len(row), dtype=np.int64)
    sampling = Sampling(seed=0, **rules)  # validated once; only the seed changes below
    for seed in range(draws):
        ctx = StepContext(attrs.evolve(sampling, seed=seed), prompt, generated)
        counts[ctx.pick(row, len(drafted), drafted, margin=False, top_n=0).token] += 1
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


def assert_frequencies_match(counts: np.ndarray, probs: np.ndarray) -> None:
    """``counts`` (any shape) are draws from ``probs`` (same shape): nothing outside the support, and a
    chi-square below the 1e-6 false-alarm threshold."""
    expected = probs * counts.sum()
    assert (counts[expected == 0] == 0).all(), "a filtered-out token was sampled"
    support = expected > 0
    df = int(support.sum()) - 1
    assert df > 0, "a test of one possible outcome proves nothing"
    assert expected[support].min() >= 5, "too few draws per outcome for the chi-square approximation"
    chi2 = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    assert chi2 < chi_square_threshold(df), (chi2, df, counts, expected.round())


def penalized(row: np.ndarray, prompt, generated, drafted, repetition_penalty=1.0, presence_penalty=0.0,
              frequency_penalty=0.0, **_) -> np.ndarray:  # fmt: skip
    """The row after the penalties, written from the rules one token id at a time (float64): the repetition
    penalty once per id in prompt + generated + drafted (divide a positive logit, multiply a negative one), then
    ``count * frequency + presence`` off every id generated or drafted (the prompt does not count)."""
    z = row.astype(np.float64)
    for t in set(prompt) | set(generated) | set(drafted):
        z[t] = z[t] / repetition_penalty if z[t] > 0 else z[t] * repetition_penalty
    history = list(generated) + list(drafted)
    for t in set(history):
        z[t] -= history.count(t) * frequency_penalty + presence_penalty
    return z


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
    assert_frequencies_match(draw_counts(ROW, **rules), expected_probs(ROW, **rules))


@pytest.mark.parametrize(
    "generated, drafted", [((4,), ()), ((4, 4, 1, 0, 7), ()), ((3,), (5,)), ((1, 2) * 20, (0, 6, 6, 1, 2, 7, 3))],
    ids=["index1", "index5", "draft-row1", "index47-draft-row7"],
)  # fmt: skip
def test_frequencies_match_at_positions_after_the_first(generated, drafted):
    rules = dict(temperature=0.9, top_p=0.95)
    counts = draw_counts(ROW, generated=generated, drafted=drafted, **rules)
    assert_frequencies_match(counts, expected_probs(ROW, **rules))


def test_two_positions_of_one_seed_are_drawn_independently():
    """The joint frequencies of (token at index 3, token at index 4) over seeds match the product of the
    distributions: a sampler that reused one uniform for every index would pass each marginal test, not this."""
    row, rules = ROW[:4], dict(temperature=1.0)
    sampling = Sampling(seed=0, **rules)
    counts = np.zeros((4, 4), dtype=np.int64)
    for seed in range(DRAWS):
        ctx = StepContext(attrs.evolve(sampling, seed=seed), (0,), (1, 2, 3))
        a = ctx.pick(row, 0, (), margin=False, top_n=0).token
        b = ctx.pick(row, 1, (a,), margin=False, top_n=0).token
        counts[a, b] += 1
    p = expected_probs(row, **rules)
    assert_frequencies_match(counts, np.outer(p, p))


LARGE_VOCAB = 1000  # four CDF blocks of survivors (3 x 256 + the rest) when nothing is masked


def large_row(masked: float) -> np.ndarray:
    """A fixed row over ``LARGE_VOCAB`` ids, flat enough that every id is drawn often, with a fraction ``masked``
    of its ids at -inf (survivors' positions in the blocks then differ from their ids)."""
    rng = np.random.default_rng(2024)
    row = rng.uniform(-0.7, 0.7, LARGE_VOCAB).astype(np.float32)
    row[rng.permutation(LARGE_VOCAB)[: int(masked * LARGE_VOCAB)]] = -np.inf
    return row


@pytest.mark.parametrize(
    "masked, rules",
    [(0.0, dict(temperature=1.0)), (0.3, dict(temperature=1.2)), (0.1, dict(temperature=1.0, top_k=600)),
     (0.0, dict(temperature=1.0, top_p=0.85))],
    ids=["4-blocks", "masked", "top_k-600", "top_p"],
)  # fmt: skip
def test_frequencies_match_over_several_cdf_blocks(masked, rules):
    row = large_row(masked)
    assert_frequencies_match(draw_counts(row, draws=40_000, **rules), expected_probs(row, **rules))


PENALTY_ROW = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.2, 0.8, -0.2], dtype=np.float32)
PROMPT, GENERATED, DRAFTED = (0, 6, 6, 9), (1, 2, 2, 5, 0), (2, 3)  # prompt-only ids: 6, 9; drafted: 2 again, 3


@pytest.mark.parametrize(
    "rules",
    [
        dict(temperature=1.0, repetition_penalty=1.8),
        dict(temperature=1.0, repetition_penalty=0.6),
        dict(temperature=1.0, presence_penalty=0.9),
        dict(temperature=1.0, frequency_penalty=0.5),
        dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=0.3, top_k=8),
    ],
    ids=["repetition", "repetition-below-1", "presence", "frequency", "all-three"],
)
def test_frequencies_match_the_penalized_distribution(rules):
    """Row 2 of a step (two drafted tokens before it), after a prompt and generated tokens with repeats."""
    counts = draw_counts(PENALTY_ROW, prompt=PROMPT, generated=GENERATED, drafted=DRAFTED, **rules)
    z = penalized(PENALTY_ROW, PROMPT, GENERATED, DRAFTED, **rules)
    filters = {k: v for k, v in rules.items() if k in ("temperature", "top_k", "top_p", "min_p")}
    assert_frequencies_match(counts, expected_probs(z, **filters))


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
    options = Options(sampling=Sampling(
        temperature=rules.temperature, top_k=rules.top_k, top_p=rules.top_p, min_p=rules.min_p, seed=rules.seed,
        repetition_penalty=rules.repetition_penalty, presence_penalty=rules.presence_penalty,
        frequency_penalty=rules.frequency_penalty, logit_bias=[(t % vocab, b) for t, b in rules.logit_bias],
    ))  # fmt: skip
    rules = PickRules(**{**rules.__dict__, "logit_bias": options.sampling.logit_bias})
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
        generate(
            FakeBackend(model), (1, 2, 3), Options(max_tokens=12, sampling=Sampling(temperature=1.0, seed=s))
        ).token_ids
        for s in range(20)
    }
    assert len(outputs) == 20


def test_the_same_seed_replays_and_speculation_keeps_it():
    model = FakeModel(vocab_size=32, seed=2, markov=3.0)
    options = Options(max_tokens=40, sampling=Sampling(temperature=0.8, top_p=0.9, seed=99))
    plain = generate(FakeBackend(model), (1, 2, 3, 1, 2), options)
    again = generate(FakeBackend(model), (1, 2, 3, 1, 2), options)
    spec = generate(FakeBackend(model), (1, 2, 3, 1, 2), options, PromptLookup(), draft_width=6)
    assert plain.token_ids == again.token_ids == spec.token_ids
    assert plain.seed == spec.seed == 99
    assert spec.stats.verification_steps > 0


def test_greedy_is_the_temperature_zero_case():
    model = FakeModel(vocab_size=32, seed=3)
    assert generate(FakeBackend(model), (5, 6), Options(max_tokens=20)).token_ids == tuple(model.greedy((5, 6), 20))
    assert generate(FakeBackend(model), (5, 6), Options(max_tokens=20)).seed is None


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
        (dict(repetition_penalty=5e-324), "repetition_penalty"),  # 0 in float32
        (dict(temperature=2.6e-125, seed=1), "temperature"),  # 0 in float32
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty="x"), "frequency_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_bad_sampling_options_name_the_field(bad, field):
    with pytest.raises(ArgumentError, match=field) as info:
        Options(sampling=Sampling(**bad))
    assert info.value.argument == field and isinstance(info.value, ValueError)


def test_logit_bias_outside_the_vocabulary_is_refused_before_any_pass():
    backend = FakeBackend(FakeModel(vocab_size=16))
    with pytest.raises(ValueError, match="logit_bias"):
        generate(backend, (1, 2), Options(sampling=Sampling(logit_bias={16: 1.0})))
    assert backend.passes == 0


def test_a_non_finite_row_is_refused_even_where_filters_would_drop_it():
    row = ROW.copy()
    row[-1] = np.nan  # the least likely token: top_k would drop it
    ctx = StepContext(Sampling(temperature=1.0, top_k=2, seed=1), (0,), ())
    with pytest.raises(ValueError, match="not finite"):
        ctx.pick(row, 0, (), margin=False, top_n=0)
    with pytest.raises(ValueError, match="not finite"):
        ctx.pick(np.full(8, -np.inf, np.float32), 0, (), margin=False, top_n=0)


BIG = 1.7e308  # a finite float64 far past float32's range


@pytest.mark.parametrize(
    "rules, prompt, generated, token",
    [
        # 10 / F32_TINY and 5 / F32_TINY both saturate at F32_MAX: a tie, the lowest id
        (dict(repetition_penalty=F32_TINY), (2, 3), (), 2),
        (dict(presence_penalty=-BIG), (0,), (5,), 5),  # -0.5 + F32_MAX
        (dict(presence_penalty=-BIG, frequency_penalty=BIG), (0,), (0,), 0),  # the two cancel, no inf - inf
        (dict(frequency_penalty=BIG), (0,), (0, 0), 1),  # token 0 falls to -F32_MAX
        (dict(logit_bias={7: BIG}), (0,), (), 7),
        (dict(logit_bias={7: BIG, 6: BIG}), (0,), (), 6),  # both round to F32_MAX: a tie
        (dict(logit_bias={7: BIG}, temperature=1.0, seed=1), (0,), (), 7),  # nothing else within the window
        (dict(temperature=F32_TINY, seed=3), (0,), (), 0),  # the least temperature: only the top survives
    ],
)
def test_extreme_option_values_saturate_instead_of_making_a_finite_row_non_finite(rules, prompt, generated, token):
    """Found by fuzzing the server: ``repetition_penalty=1.6e-171`` divided a positive logit to +inf, a penalty or
    bias past float32's range was +-inf in float32 (and inf - inf a NaN), and a temperature that is 0 in float32
    divided 0 by 0; each failed the generation (a 500). The processors saturate at +-F32_MAX, the least temperature
    and repetition penalty are F32_TINY (a smaller one is refused, above), so a finite row always gives a pick,
    the one the saturated values say, and the property suite's reference agrees."""
    row = ROW * 10  # 10 / F32_TINY is past float32's range
    pick = StepContext(Sampling(**rules), prompt, generated).pick(row, 0, (), margin=True, top_n=2)
    assert pick.token == token and math.isfinite(pick.logprob)
    bias = tuple(sorted(rules.get("logit_bias", {}).items()))
    got, _ = reference_pick(row, PickRules(**(rules | {"logit_bias": bias})), prompt, generated)
    assert got == token
    assert float(np.max(StepContext(Sampling(**rules), prompt, generated).processed(row, ()))) <= F32_MAX
