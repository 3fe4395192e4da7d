"""``Engine.generate_many``: many prompts, one set of options, batched; each result is the prompt's alone."""

from __future__ import annotations

import pytest

from ortspec import ArgumentError, BackendConfig, Engine

PROMPTS = [
    "the cat sat on the mat. the cat sat on the",
    "a b a b a b a b",
    "hello",
    list(range(5, 40)),  # token ids, a longer prompt
    "one two three one two three one two",
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


@pytest.mark.parametrize(
    "options",
    [
        dict(max_tokens=12),
        dict(max_tokens=12, speculative="prompt-lookup", draft_width=4),
        dict(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, speculative="auto"),
        dict(max_tokens=9, stop=["b a"], repetition_penalty=1.3, ignore_eos=True),
    ],
    ids=["greedy", "lookup", "sampled", "stop-penalty"],
)
def test_each_result_is_the_prompt_generated_alone(engine, options):
    many = engine.generate_many(PROMPTS, **options)
    alone = [engine.generate(p, **options) for p in PROMPTS]
    assert len(many) == len(PROMPTS)
    for got, want in zip(many, alone, strict=True):
        assert (got.token_ids, got.text, got.finish_reason, got.stop_matched) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_matched,
        )
    assert engine.batch.runs > 0


def test_more_prompts_than_slots_wait_for_a_free_slot(engine):
    from ortspec.adapters.engine.engine import DEFAULT_SLOTS as BATCH_SLOTS

    prompts = [f"count {i} {i} {i}" for i in range(BATCH_SLOTS + 3)]
    many = engine.generate_many(prompts, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in many] == [engine.generate(p, max_tokens=6, ignore_eos=True).token_ids for p in prompts]


def test_with_prefix_reuse_prompts_reuse_a_shared_prefix_and_each_result_is_the_prompt_alone(tiny_model_dir, engine):
    from ortspec.adapters.engine.engine import DEFAULT_SLOTS as BATCH_SLOTS

    reuse = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), prefix_reuse=True)
    system = list(range(5, 25))  # a shared opening; the later prompts take slots freed by the first ones
    prompts = [[*system, 30 + i, 31 + i] for i in range(BATCH_SLOTS + 2)]
    many = reuse.generate_many(prompts, max_tokens=4, ignore_eos=True)
    assert [r.token_ids for r in many] == [engine.generate(p, max_tokens=4, ignore_eos=True).token_ids for p in prompts]
    assert [r.cached_prompt_tokens for r in many] == [0] * BATCH_SLOTS + [len(system)] * 2
    assert all(r.cached_prompt_tokens == 0 for r in engine.generate_many(prompts[-2:], max_tokens=4, ignore_eos=True))


def test_bad_input_is_refused_before_anything_runs(engine):
    runs = engine.batch.runs
    with pytest.raises(ArgumentError) as info:
        engine.generate_many("not a list", max_tokens=4)
    assert info.value.argument == "prompts"
    with pytest.raises(ArgumentError) as info:
        engine.generate_many(["ok", ""], max_tokens=4)
    assert info.value.argument == "prompt"
    with pytest.raises(ArgumentError) as info:
        engine.generate_many(["ok"], speculative="shared-kv")
    assert info.value.argument == "speculative"
    assert engine.batch.runs == runs
    assert engine.generate_many([], max_tokens=4) == []


def test_batch_slots_sets_the_sequences_run_at_once_fixed_at_load(tiny_model_dir, engine):
    three = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=3)
    assert three.batch.slots == 3
    got = three.generate_many(PROMPTS, max_tokens=5)  # five prompts, three slots: two wait for a free one
    assert [r.token_ids for r in got] == [r.token_ids for r in engine.generate_many(PROMPTS, max_tokens=5)]
    with pytest.raises(ArgumentError) as info:
        Engine.from_dir(tiny_model_dir, batch_slots=0)
    assert info.value.argument == "batch_slots"


def test_the_engines_prefill_budget_changes_no_result(tiny_model_dir, engine):
    budgeted = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), prefill_budget=3)
    assert budgeted.prefill_budget == 3 and engine.prefill_budget == 512
    options = dict(max_tokens=8, speculative="prompt-lookup", draft_width=4)
    got = budgeted.generate_many(PROMPTS, **options)  # every prompt prefilled 3 tokens a pass, first come first
    assert [r.token_ids for r in got] == [r.token_ids for r in engine.generate_many(PROMPTS, **options)]
    with pytest.raises(ArgumentError) as info:
        Engine.from_dir(tiny_model_dir, prefill_budget=0)
    assert info.value.argument == "prefill_budget"
