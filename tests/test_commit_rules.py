"""Commit rules of ``ortspec.core.state`` that the example tests of ``test_core_rules.py`` leave open: which stop
token sequence is reported, that stop sequences see only generated tokens, how much streamed text a stop string
holds back, and incremental text for a detokenizer that is not concatenative (SentencePiece drops the leading
space of a text). Each test builds its logits by hand and checks what a user sees: tokens, text, the streamed
deltas, the finish reason and ``stop_matched``."""

from __future__ import annotations

import numpy as np

from ortspec.core.state import DecodeState, FinishReason, Options, step

V = 8
PROMPT = (0, 7)


def row(pick: int) -> np.ndarray:
    """A logits row whose argmax is ``pick`` by a wide margin."""
    r = np.zeros(V, dtype=np.float32)
    r[pick] = 5.0
    return r


def decode(options: Options, picks, detokenize=None, prompt=PROMPT):
    """Plain steps picking ``picks`` until the generation ends; returns the state and each commit's text."""
    state = DecodeState.start(prompt, options, detokenize)
    deltas = []
    for pick in picks:
        state, commits, _, _, _ = step(state, row(pick), None, ())
        deltas += [c.text for c in commits]
        if state.finished:
            break
    return state, deltas


def test_the_first_listed_stop_sequence_is_reported_when_several_end_on_one_token():
    for listed in ([(3,), (2, 3)], [(2, 3), (3,)]):
        state, _ = decode(Options(stop=listed), [1, 2, 3, 4])
        assert state.generated_tokens == (1, 2, 3)
        assert state.finish_reason is FinishReason.STOP_SEQUENCE
        assert state.stop_matched == listed[0]


def test_a_stop_sequence_is_matched_in_the_generated_tokens_only():
    # The prompt ends with 7: (7, 1) spans the prompt and the first token, so it does not stop the generation;
    # later, when the output itself holds 7 then 1, it does.
    state, _ = decode(Options(stop=[(7, 1)]), [1, 2, 7, 1, 5])
    assert state.generated_tokens == (1, 2, 7, 1)
    assert state.finish_reason is FinishReason.STOP_SEQUENCE and state.stop_matched == (7, 1)


BYTES = {0: "c", 1: "x", 2: "a", 3: "b", 4: "y", 5: "!", 6: " ", 7: "?"}


def byte_detok(ids) -> str:
    return "".join(BYTES[int(i)] for i in ids)


def test_the_stream_holds_back_the_longest_suffix_that_may_start_a_stop_string():
    # After "xaa" both "a" and "aa" may start "aab": the stream must hold back "aa", since "aab" then completes
    # one character earlier than a hold-back of "a" would allow, and the text is cut before it.
    state, deltas = decode(Options(stop=["aab"]), [1, 2, 2, 3, 4], byte_detok)
    assert state.finish_reason is FinishReason.STOP_SEQUENCE and state.stop_matched == "aab"
    assert state.text == "x"
    assert deltas == ["x", "", "", ""]


def test_the_stream_releases_what_can_no_longer_start_a_stop_string():
    state, deltas = decode(Options(stop=["aab"]), [2, 2, 2, 4, 1], byte_detok)
    assert state.finish_reason is None and state.text == "aaayx"
    assert deltas == ["", "", "a", "aay", "x"]
    assert "".join(deltas) == state.text


# SentencePiece-like pieces: "▁" is a space, and a text drops its leading space (so a token's text depends on
# the tokens before it: decoding each token alone would lose every space).
SP = {0: "▁the", 1: "▁cat", 2: "s", 3: "▁sat", 4: "▁", 5: ".", 6: "▁on", 7: "▁mat"}


def sp_detok(ids) -> str:
    text = "".join(SP[int(i)] for i in ids).replace("▁", " ")
    return text[1:] if text.startswith(" ") else text


def test_text_of_a_non_concatenative_detokenizer_equals_decoding_every_token_at_once():
    picks = [0, 1, 2, 3, 6, 0, 7, 5]
    state, deltas = decode(Options(max_tokens=len(picks)), picks, sp_detok, prompt=(4, 4))
    assert state.text == sp_detok(picks) == "the cats sat on the mat."
    assert "".join(deltas) == state.text
    # with a stop string across a space: the text is cut before it, and nothing of it was streamed
    state, deltas = decode(Options(stop=[" on the"], max_tokens=len(picks)), picks, sp_detok, (4, 4))
    assert state.text == "the cats sat" and state.stop_matched == " on the"
    assert "".join(deltas) == state.text
