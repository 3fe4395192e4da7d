"""End to end on the real default model, SmolLM2-135M-Instruct fp32 (converted on first use, then cached).

Speculative output must equal greedy output token for token. Real numerics can flip a near-tied argmax between
a multi-token verify pass and a one-token decode; these tests run with the tie guard on, as the docs advise for
exactness-critical use.
"""

from __future__ import annotations

import pytest

from ortspec import FinishReason, PromptLookup
from ortspec.adapters.cli import DEMO_PROMPT

pytestmark = pytest.mark.real_model

TIE = 0.05
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


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code-edit", "repeat", "list", "open-ended"])
def test_speculative_equals_greedy(real_engine, prompt):
    greedy = real_engine.generate(prompt, chat=True, max_tokens=96, tie_margin=TIE)
    spec = real_engine.generate(prompt, chat=True, max_tokens=96, tie_margin=TIE, speculative="prompt-lookup")
    assert spec.token_ids == greedy.token_ids
    assert spec.text == greedy.text
    assert spec.finish_reason == greedy.finish_reason
    assert spec.stats.steps <= greedy.stats.steps + spec.stats.tie_guard_stops


def test_copy_task_accepts_drafts(real_engine):
    spec = real_engine.generate(PROMPTS[1], chat=True, max_tokens=64, speculative="prompt-lookup")
    assert spec.stats.accepted_tokens >= 20, spec.stats
    assert spec.stats.steps < len(spec.token_ids)


def test_stop_string_mid_block(real_engine):
    greedy = real_engine.generate(PROMPTS[1], chat=True, max_tokens=64)
    word = "Swiss-Austrian"
    assert word in greedy.text, greedy.text
    for speculative in (None, PromptLookup(max_draft=12)):
        r = real_engine.generate(
            PROMPTS[1], chat=True, max_tokens=64, stop=word, speculative=speculative, draft_width=12, tie_margin=TIE
        )
        assert r.finish_reason == FinishReason.STOP_SEQUENCE
        assert r.stop_matched == word
        assert r.text == greedy.text[: greedy.text.index(word)]


def test_eos_ends_generation(real_engine):
    r = real_engine.generate("Say only the word: yes", chat=True, max_tokens=64, speculative="prompt-lookup")
    assert r.finish_reason == FinishReason.EOS_TOKEN
    assert r.token_ids[-1] in real_engine.eos_token_ids
    assert len(r.token_ids) < 64


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
    assert [reason for _, _, reason in seen[:-1]] == [None] * (len(seen) - 1)
    assert seen[-1][2] == str(r.finish_reason)
    chunks = list(real_engine.stream(PROMPTS[2], chat=True, max_tokens=48, speculative="prompt-lookup"))
    assert "".join(chunks) == r.text


def test_prompt_longer_than_context_is_refused(real_engine):
    with pytest.raises(ValueError, match="context"):
        real_engine.generate([5] * (real_engine.backend.max_length + 1), max_tokens=4)
