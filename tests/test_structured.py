"""Structured outputs (``response_format``): the shapes it takes and refuses, the core's constraint rules on the fake
backend, llguidance on the tiny model's tokenizer (valid output, speculative == plain, batched == alone), the
server's field, and a few schemas on the real model (marked real_model)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ortspec import BatchDriver, Generation, generate
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.structured import ResponseFormat
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.backends.onnx import BackendConfig
from ortspec.core import FinishReason, Options, PromptLookup, Sampling
from ortspec.core.constraint import Constraint
from ortspec.core.forced import ForcedTokens
from ortspec.core.state import DecodeState, step, step_from_picks
from ortspec.core.tokens import Shared
from tests.support.grammars import FakeGrammar

ENUMS = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "flags", "schema": ENUMS, "strict": True}}, "json"),
    ({"type": "regex", "regex": "(yes|no), (maybe|never)"}, r"(yes|no), (maybe|never)"),
    ({"type": "grammar", "grammar": 'start: "a" ("b" | "c") "d"'}, r"a[bc]d"),
]


# -- the value ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3, "expected an object"),
        ("{nope", "not valid JSON"),
        ({"type": "xml"}, "type must be one of"),
        ({"type": "json_object", "schema": {}}, "unrecognized field 'schema'"),
        ({"type": "json_schema"}, "needs the field 'json_schema'"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name must be a non-empty string"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "schema must be a JSON Schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "strict"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}, "unrecognized field"),
        ({"type": "regex", "regex": ""}, "non-empty string"),
        ({"type": "grammar", "grammar": 7}, "non-empty string"),
    ],
)
def test_a_bad_response_format_names_the_field(value, match):
    with pytest.raises(ValueError, match=match) as info:
        ResponseFormat.parse(value)
    assert info.value.argument == "response_format"  # type: ignore[attr-defined]


def test_response_format_shapes():
    assert ResponseFormat.parse(None) is None and ResponseFormat.parse({"type": "text"}) is None
    assert ResponseFormat.parse('{"type": "json_object"}') == ResponseFormat("json_object", '{"type": "object"}')
    assert ResponseFormat.parse({"type": "regex", "regex": "a+"}) == ResponseFormat("regex", "a+")


# -- the core's rules on the fake backend --------------------------------------------------------------------------

# Over a vocabulary of 8: token 1, then any of 2 or 3 (repeated), then 4 ends a complete match; EOS (7) may end
# the match after 4 only. 2 -> 5 is forced after it.
GRAMMAR = FakeGrammar(
    8,
    transitions=(((1, 1),), ((2, 2), (3, 1), (4, 3)), ((5, 1),), ()),
    accepting=frozenset({3}),
)


def test_a_constraint_answers_for_the_path_asked_whatever_was_asked_before():
    matcher = GRAMMAR.matcher()
    constraint = Constraint(matcher)
    base = Shared.of([1])
    longer = base.extended([2, 5])  # the same storage: the matcher's moves along it cost the new tokens only
    assert np.flatnonzero(constraint.allowed(longer, (), ())).tolist() == [2, 3, 4]
    assert np.flatnonzero(constraint.allowed(base, (2,), ())).tolist() == [5]  # the 5 rolled back
    assert np.flatnonzero(constraint.allowed(longer, (3,), {7})).tolist() == [2, 3, 4]
    assert np.flatnonzero(constraint.allowed(longer, (4,), {7})).tolist() == [7]  # complete: EOS only
    assert constraint.complete(longer.extended([4])) and not constraint.complete(longer)
    assert constraint.forced((0, 1, 2), 1) == (5,)
    assert matcher.consumed == 3 + 0 + 2 + 1  # each move consumed only what the path did not share


def test_every_token_obeys_the_grammar_and_a_complete_grammar_ends_the_generation():
    model = FakeModel(vocab_size=8, seed=3)
    options = Options(max_tokens=40, eos_token_ids={7}, grammar=GRAMMAR)
    plain = generate(FakeBackend(model), [0, 6], options)
    assert GRAMMAR.obeys(plain.token_ids)
    assert plain.finish_reason in (FinishReason.GRAMMAR_COMPLETE, FinishReason.MAX_TOKENS)
    assert plain.finish_reason.openai in ("stop", "length")
    if plain.finish_reason is FinishReason.GRAMMAR_COMPLETE:
        assert plain.token_ids[-1] == 4
    spec = generate(FakeBackend(model), [0, 6], options, ForcedTokens(GRAMMAR, 2, PromptLookup()))
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason


def test_forbidden_drafts_are_never_accepted_and_rejected_ones_are_rolled_back():
    state = DecodeState.start([0], Options(max_tokens=10, grammar=GRAMMAR))
    rows = np.zeros((4, 8), dtype=np.float32)
    rows[:, 6] = 10.0  # the model wants 6 everywhere, which the grammar never allows
    rows[:, 1] = 1.0
    rows[:, 2] = 2.0
    # The pass over (pending, 6, 6, 6): the base row picks 1 (6 is masked); the draft's 6 is rejected.
    outcome = step(state, rows[0], rows[1:], (6, 6, 6))
    assert [c.token_id for c in outcome.commits] == [1] and outcome.accepted == 0
    # After 1: 2 (then 5 is forced), and the drafts (2, 5, 2) are all accepted, with a bonus.
    outcome = step(outcome.state, rows[0], rows[1:], (2, 5, 2))
    assert [c.token_id for c in outcome.commits] == [2, 5, 2, 5] and outcome.accepted == 3
    assert GRAMMAR.obeys(outcome.state.generated_tokens)


def test_eos_only_where_the_grammar_accepts():
    state = DecodeState.start([0], Options(max_tokens=10, eos_token_ids={7}, grammar=GRAMMAR))
    row = np.zeros(8, dtype=np.float32)
    row[7] = 100.0  # the model wants to stop at once
    row[1] = 1.0
    outcome = step(state, row, None, ())
    assert [c.token_id for c in outcome.commits] == [1] and not outcome.state.finished


def test_a_grammar_complete_at_the_start_ends_with_no_token_and_device_picks_are_refused():
    done = FakeGrammar(4, transitions=((),), accepting=frozenset({0}))
    state = DecodeState.start([0], Options(grammar=done))
    assert state.finish_reason is FinishReason.GRAMMAR_COMPLETE
    assert not Options(grammar=GRAMMAR).device_picks_suffice
    with pytest.raises(ValueError, match="grammars need step"):
        step_from_picks(DecodeState.start([0], Options(grammar=GRAMMAR)), [1], (), vocab_size=8)
    with pytest.raises(ValueError, match="grammar"):
        Options(grammar="not a grammar")  # type: ignore[arg-type]


def test_logprob_alternatives_leave_out_the_tokens_the_grammar_masks():
    """A masked token is at -inf: never an alternative (JSON has no -inf), greedy or sampled, speculative or not."""
    model = FakeModel(vocab_size=8, seed=3)
    for sampling in (Sampling(), Sampling(temperature=0.9, seed=5)):
        options = Options(max_tokens=12, eos_token_ids={7}, grammar=GRAMMAR, top_logprobs=8, sampling=sampling)
        plain = generate(FakeBackend(model), [0, 6], options)
        spec = generate(FakeBackend(model), [0, 6], options, ForcedTokens(GRAMMAR, 2, PromptLookup()))
        assert plain.logprobs == spec.logprobs and plain.logprobs
        for lp in plain.logprobs:
            assert lp.top and all(np.isfinite(p) for _, p in lp.top), lp
        # After the first token (1), the grammar allows 2, 3 and 4 only: the alternatives are those, no more.
        assert {t for t, _ in plain.logprobs[1].top} <= {2, 3, 4}


def test_forced_tokens_are_drafted_and_cost_no_extra_pass():
    chain = FakeGrammar(8, transitions=(((1, 1),), ((2, 2),), ((3, 3),), ((4, 4),), ()), accepting=frozenset({4}))
    model = FakeModel(vocab_size=8, seed=1)
    plain = generate(FakeBackend(model), [0], Options(max_tokens=10, grammar=chain))
    spec = generate(FakeBackend(model), [0], Options(max_tokens=10, grammar=chain), ForcedTokens(chain, 1))
    assert plain.token_ids == spec.token_ids == (1, 2, 3, 4)
    assert plain.stats.steps == 4 and spec.stats.steps == 2  # the prompt pass picks 1; one pass verifies 2, 3, 4


def test_batched_constrained_sequences_equal_each_alone():
    model = FakeModel(vocab_size=8, seed=2)
    options = Options(max_tokens=30, eos_token_ids={7}, grammar=GRAMMAR)
    driver = BatchDriver(FakeBatchBackend(model, slots=2), prefill_chunk=2)
    prompts = ([0, 6, 6], [5, 5, 5, 5, 1], [3])
    seqs = [driver.submit(p, options, ForcedTokens(GRAMMAR, len(p), PromptLookup())) for p in prompts]
    driver.run()
    for p, seq in zip(prompts, seqs, strict=True):
        alone = Generation(FakeBackend(model), p, options).run()
        assert seq.result().token_ids == alone.token_ids and seq.result().finish_reason == alone.finish_reason


# -- llguidance on the tiny model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


def _obeys(text: str, expect: str) -> bool:
    if expect == "json":
        value = json.loads(text)
        return value["color"] in ENUMS["properties"]["color"]["enum"] and isinstance(value["ok"], bool)
    return re.fullmatch(expect, text) is not None


@pytest.mark.parametrize(("response_format", "expect"), FORMATS)
def test_llguidance_output_obeys_and_speculation_changes_nothing(engine, response_format, expect):
    plain = engine.generate("the quick brown fox", max_tokens=60, response_format=response_format)
    assert plain.finish_reason is FinishReason.GRAMMAR_COMPLETE and _obeys(plain.text, expect), plain.text
    spec = engine.generate(
        "the quick brown fox", max_tokens=60, response_format=response_format, speculative="prompt-lookup"
    )
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert spec.stats.steps <= plain.stats.steps
    many = engine.generate_many(["the quick brown fox", "hello"], max_tokens=60, response_format=response_format)
    assert many[0].token_ids == plain.token_ids and _obeys(many[1].text, expect)


@pytest.fixture(scope="module")
def drafter_engine(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("onnx")
    from tests.support.drafters import make_random_drafter

    folder = make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter") / "d", seed=1, draft_vocab=300)
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), drafter=folder)


@pytest.mark.parametrize("speculative", ["shared-kv", "auto"])
def test_forced_tokens_in_front_of_a_draft_head(drafter_engine, speculative):
    """A draft head reads the target's KV and last hidden state, so it cannot draft after forced tokens the target
    has not processed: there only the forced tokens (and under ``auto`` its lookup) draft. Constrained output with
    a drafter is plain constrained decoding's, greedy and sampled, alone and batched (generate_many)."""
    rf = FORMATS[0][0]
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        plain = drafter_engine.generate(
            "the quick brown fox", max_tokens=60, response_format=rf, speculative=None, **sampling
        )
        assert plain.finish_reason is FinishReason.GRAMMAR_COMPLETE and _obeys(plain.text, "json")
        spec = drafter_engine.generate(
            "the quick brown fox", max_tokens=60, response_format=rf, speculative=speculative, **sampling
        )
        assert spec.token_ids == plain.token_ids and spec.stats.steps < plain.stats.steps  # forced tokens drafted
        many = drafter_engine.generate_many(
            ["the quick brown fox", "hello"], max_tokens=60, response_format=rf, speculative=speculative, **sampling
        )
        assert many[0].token_ids == plain.token_ids


def test_json_object_and_sampling(engine):
    result = engine.generate(
        "hi", max_tokens=80, response_format={"type": "json_object"}, temperature=0.8, seed=3, speculative="auto"
    )
    again = engine.generate("hi", max_tokens=80, response_format={"type": "json_object"}, temperature=0.8, seed=3)
    assert result.token_ids == again.token_ids
    if result.finish_reason is FinishReason.GRAMMAR_COMPLETE:
        assert isinstance(json.loads(result.text), dict)


@pytest.mark.parametrize(
    ("response_format", "match"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "Invalid type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "w"}}}, "format"),
        ({"type": "regex", "regex": "(a"}, "unclosed group"),
        ({"type": "grammar", "grammar": "start: foo"}, "unknown name"),
        ({"type": "regex", "regex": r"[^\s\S]"}, "can never match"),
    ],
)
def test_what_llguidance_refuses_is_an_argument_error_before_anything_runs(engine, response_format, match):
    passes = engine.generate("hi", max_tokens=2).stats.steps
    with pytest.raises(ValueError, match=match) as info:
        engine.generate("hi", max_tokens=5, response_format=response_format)
    assert info.value.argument == "response_format"  # type: ignore[attr-defined]
    assert engine.generate("hi", max_tokens=2).stats.steps == passes  # the engine stays usable


# -- the real model --------------------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["math", "poetry", "engines"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


@pytest.mark.real_model
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "seed": 11}])
def test_real_model_schema_output_is_valid_and_speculation_exact(real_engine, sampling):
    prompt = "Ada Lovelace, 36, a mathematician and poet from London. Give her record as JSON."
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    plain = real_engine.generate(prompt, chat=True, max_tokens=120, response_format=rf, **sampling)
    spec = real_engine.generate(prompt, chat=True, max_tokens=120, response_format=rf, speculative="auto", **sampling)
    assert spec.token_ids == plain.token_ids and plain.finish_reason is FinishReason.GRAMMAR_COMPLETE
    value = json.loads(plain.text)
    assert set(value) == {"name", "age", "tags", "address"} and 0 <= value["age"] <= 150
    assert spec.stats.steps < plain.stats.steps
