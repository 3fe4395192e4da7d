"""The central property: speculative generation is greedy generation, whatever the proposer and options."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ortspec import generate
from ortspec.backends.fake import FakeBackend
from property_tests.conftest import examples
from property_tests.strategies import (
    OracleProposer,
    detokenize,
    fake_models,
    options_for,
    prompts,
    proposers_for,
    width_policies,
)


def run(model, prompt, options, proposer, width, use_text, capacity):
    backend = FakeBackend(model, max_length=capacity)
    streamed = []
    result = generate(
        backend,
        prompt,
        options,
        proposer,
        draft_width=width,
        callback=lambda c: streamed.append((c.token_id, c.text, c.logprob)),
        detokenize=detokenize if use_text else None,
    )
    assert backend.current_len() == len(prompt) + len(result.token_ids) - 1 or not result.token_ids
    # No pass ever made the KV hold a position that could not be committed: drafts never overshoot the token
    # budget or the context limit.
    limit = min(options.max_context or capacity, capacity, len(prompt) + options.max_new_tokens)
    assert backend.peak_len <= limit - 1
    return result, streamed


def check_stats(result):
    s = result.stats
    assert 0 <= s.accepted_tokens <= s.proposed_tokens
    assert s.verification_steps <= s.steps
    assert s.multi_token_accepts <= s.verification_steps
    assert s.tie_guard_stops <= s.steps
    assert len(result.token_ids) <= s.accepted_tokens + s.steps


@st.composite
def scenarios(draw):
    model = draw(fake_models())
    prompt = draw(prompts(model.vocab_size))
    options, use_text = draw(options_for(model, prompt))
    proposer = draw(proposers_for(model))
    width = draw(width_policies())
    capacity = draw(st.one_of(st.just(4096), st.integers(len(prompt), len(prompt) + 80)))
    return model, prompt, options, proposer, width, use_text, capacity


def assert_equivalent(model, prompt, options, proposer, width, use_text, capacity):
    greedy, greedy_stream = run(model, prompt, options, None, 1, use_text, capacity)
    spec, spec_stream = run(model, prompt, options, proposer, width, use_text, capacity)

    # Same decisions...
    assert spec.token_ids == greedy.token_ids
    assert spec.text == greedy.text
    assert spec.finish_reason == greedy.finish_reason
    assert spec.stop_matched == greedy.stop_matched
    assert spec.logprobs == greedy.logprobs
    # ...streamed the same way, token by token, and the stream adds up to the text.
    assert spec_stream == greedy_stream
    assert "".join(t for _, t, _ in spec_stream) == spec.text
    assert [t for t, _, _ in spec_stream] == list(spec.token_ids)
    # Greedy itself is the model's argmax chain, cut by the rules.
    assert list(greedy.token_ids) == model.greedy(prompt, len(greedy.token_ids))
    assert len(greedy.token_ids) <= options.max_new_tokens
    limit = min(options.max_context or capacity, capacity)
    assert len(prompt) + len(greedy.token_ids) <= limit
    # Never more target passes than greedy (a tie-guard stop that commits nothing costs one pass).
    assert spec.stats.steps <= greedy.stats.steps + spec.stats.tie_guard_stops
    check_stats(greedy)
    check_stats(spec)
    assert greedy.stats.proposed_tokens == 0
    if isinstance(proposer, OracleProposer) and isinstance(width, int) and options.tie_margin == 0:
        # Oracle drafts are all accepted, except where a stop rule ended the block.
        assert spec.stats.proposed_tokens - spec.stats.accepted_tokens <= width


@settings(max_examples=examples(9000))
@given(scenarios())
def test_speculative_equals_greedy(scenario):
    assert_equivalent(*scenario)


@settings(max_examples=examples(1500))
@given(scenarios(), st.integers(1, 3))
def test_speculative_equals_greedy_with_tiny_budgets(scenario, budget):
    model, prompt, options, proposer, width, use_text, capacity = scenario
    import attrs

    options = attrs.evolve(options, max_new_tokens=budget)
    assert_equivalent(model, prompt, options, proposer, width, use_text, capacity)


def test_property_sanity_lookup_accepts_on_repetitive_model():
    """The suite must exercise acceptance, not only rejection: a repetitive model accepts most lookups."""
    from ortspec import Options, PromptLookup
    from ortspec.backends.fake import FakeModel

    model = FakeModel(vocab_size=8, seed=3, markov=6.0, noise=0.05)
    result, _ = run(model, (1, 2, 3, 1, 2), Options(max_new_tokens=60), PromptLookup(), 8, False, 4096)
    assert result.stats.accepted_tokens > 30
    assert result.stats.steps < 30
    assert not math.isnan(result.stats.acceptance_rate)


@settings(max_examples=examples(300))
@given(width_policies(), st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=40))
def test_width_policies_are_deterministic_and_in_range(policy, observations):
    """The same observations give the same widths; a width is never negative."""
    if isinstance(policy, int):
        return
    replay = policy
    for proposed, accepted in observations:
        accepted = min(accepted, proposed)
        assert policy.width() == replay.width() >= 0
        policy, replay = policy.observe(proposed, accepted), replay.observe(proposed, accepted)
        assert policy == replay
