"""End to end on the real default model, SmolLM2-135M-Instruct fp32 (converted on first use, then cached), and
on its int4 conversion at MatMulNBits accuracy level 1 (converted on first use too).

Speculative output must equal greedy output token for token, at the default settings (tie guard off): on fp32 a
verify pass agrees with one-token decodes to ~5e-5 logits. Every speculative test also asserts that drafts were
verified and some accepted, so that it tests speculation and not greedy decoding twice. The engine is deterministic,
so a generation several tests assert on runs once (``generated``).
"""

from __future__ import annotations

import pytest

from ortspec import FinishReason, PromptLookup
from ortspec.adapters.cli.demo import DEMO_PROMPT

pytestmark = pytest.mark.real_model


def assert_speculated(result) -> None:
    """The run verified drafts and committed some of them."""
    assert result.stats.verification_steps > 0, result.stats
    assert result.stats.accepted_tokens > 0, result.stats


PASSAGE = (
    "The Rhine is a river that begins in the Swiss canton of Graubünden in the southeastern Swiss Alps. It forms "
    "part of the Swiss-Liechtenstein border, then the Swiss-Austrian border, and flows through Germany and the "
    "Netherlands to the North Sea."
)
PROMPTS = [
    DEMO_PROMPT,
    "Repeat the following passage word for word:\n\n" + PASSAGE,
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. Write the list again in reverse order.",
    "Write a haiku about autumn leaves.",
]


@pytest.fixture(scope="module")
def generated(real_engine):
    """``real_engine.generate(prompt, chat=True, **options)`` for options of plain values (plain decoding unless
    ``speculative`` says otherwise), each distinct call run once in this module (the same call gives the same result:
    greedy, or sampling with a seed)."""
    runs = {}

    def generate(prompt, **options):
        options = {"speculative": None, **options}
        key = (prompt, tuple(sorted(options.items())))
        if key not in runs:
            runs[key] = real_engine.generate(prompt, chat=True, **options)
        return runs[key]

    return generate


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code-edit", "repeat", "list", "open-ended"])
def test_speculative_equals_greedy(generated, prompt):
    greedy = generated(prompt, max_tokens=96)
    for draft_width in ("auto", 8):
        spec = generated(prompt, max_tokens=96, speculative="prompt-lookup", draft_width=draft_width)
        assert spec.token_ids == greedy.token_ids
        assert spec.text == greedy.text
        assert spec.finish_reason == greedy.finish_reason
        assert spec.stats.steps <= greedy.stats.steps
        assert_speculated(spec)


def test_tie_guard_keeps_output_and_speculation(generated):
    greedy = generated(PROMPTS[0], max_tokens=96)
    spec = generated(PROMPTS[0], max_tokens=96, speculative="prompt-lookup", tie_margin=0.05)
    assert spec.token_ids == greedy.token_ids
    assert_speculated(spec)


def test_copy_task_accepts_drafts(generated):
    spec = generated(PROMPTS[1], max_tokens=96, speculative="prompt-lookup", draft_width="auto")
    assert spec.stats.accepted_tokens >= 20, spec.stats
    assert spec.stats.steps < len(spec.token_ids)


def test_stop_string_mid_block(real_engine, generated):
    greedy = generated(PROMPTS[1], max_tokens=96)  # its text up to the word is the 64-token run's
    word = "Swiss-Austrian"
    assert word in greedy.text, greedy.text
    for speculative in (None, PromptLookup(max_draft=12)):
        r = real_engine.generate(
            PROMPTS[1], chat=True, max_tokens=64, stop=word, speculative=speculative, draft_width=12
        )
        assert r.finish_reason == FinishReason.STOP_SEQUENCE
        assert r.stop_matched == word
        assert r.text == greedy.text[: greedy.text.index(word)]
        if speculative is not None:
            assert_speculated(r)


def test_eos_ends_generation(real_engine, generated):
    """EOS inside an accepted block: the passage is copied with drafts and ends with EOS."""
    greedy = generated(PROMPTS[1], max_tokens=96)
    assert greedy.finish_reason == FinishReason.EOS_TOKEN
    r = generated(PROMPTS[1], max_tokens=96, speculative="prompt-lookup", draft_width=8)
    assert r.finish_reason == FinishReason.EOS_TOKEN and r.token_ids == greedy.token_ids
    assert r.token_ids[-1] in real_engine.eos_token_ids
    assert_speculated(r)


def test_streaming_matches_result(real_engine):
    seen = []
    r = real_engine.generate_stream(
        PROMPTS[2],
        lambda text, tok, reason: seen.append((text, tok, reason)),
        chat=True,
        max_tokens=48,
        speculative="prompt-lookup",
    )
    assert "".join(t for t, _, _ in seen) == r.text
    assert tuple(tok for _, tok, _ in seen) == r.token_ids
    assert_speculated(r)
    assert [reason for _, _, reason in seen[:-1]] == [None] * (len(seen) - 1)
    assert seen[-1][2] == str(r.finish_reason)
    chunks = list(real_engine.stream(PROMPTS[2], chat=True, max_tokens=48, speculative="prompt-lookup"))
    assert "".join(chunks) == r.text


def test_prompt_longer_than_context_is_refused(real_engine):
    with pytest.raises(ValueError, match="context"):
        real_engine.generate([5] * (real_engine.backend.max_length + 1), max_tokens=4)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code-edit", "repeat", "list", "open-ended"])
def test_speculative_equals_plain_sampling(real_engine, prompt):
    """Exact seeded sampling at temperature 0.7, top_p 0.9: the same seed gives the same tokens with and
    without speculation."""
    sampling = dict(temperature=0.7, top_p=0.9, seed=20261130)
    plain = real_engine.generate(prompt, chat=True, max_tokens=96, **sampling)
    spec = real_engine.generate(prompt, chat=True, max_tokens=96, speculative="prompt-lookup", draft_width=8,
                                **sampling)  # fmt: skip
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert_speculated(spec)


@pytest.fixture(scope="module")
def int4_engine():
    """SmolLM2-135M-Instruct int4 at MatMulNBits accuracy level 1 (what ``ortspec convert --precision int4``
    builds), converted on first use into the ortspec cache, then reused."""
    from ortspec.adapters.engine import Engine
    from ortspec.adapters.tools.convert import convert_smollm2
    from ortspec.backends.onnx import BackendConfig

    return Engine.from_dir(convert_smollm2(precision="int4", progress=None), BackendConfig(threads=2))


def test_int4_at_level_one_is_exact(int4_engine):
    """The quantized folder ortspec builds: no drift warning, and speculative output equals greedy output."""
    import warnings

    assert int4_engine.measurements.verify_drift() < 1e-3
    for prompt in PROMPTS[:2]:
        greedy = int4_engine.generate(prompt, chat=True, max_tokens=64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            spec = int4_engine.generate(prompt, chat=True, max_tokens=64, speculative="prompt-lookup", draft_width=8)
        assert spec.token_ids == greedy.token_ids
        assert_speculated(spec)
