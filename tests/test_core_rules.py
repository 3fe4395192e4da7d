"""Example-based tests of the pure decoding rules (``ortspec.core.state``).

Every test builds its logits by hand, so each says exactly which pick, margin or logprob it checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ortspec.core.state import (
    Commit,
    DecodeState,
    FinishReason,
    Options,
    Stats,
    TokenLogprob,
    check_draft,
    draft_budget,
    step,
    step_from_picks,
)

# --------------------------------------------------------------------------------------------------------------
# A 20-token vocabulary whose ids decode to single bytes / short strings (errors="replace" like a byte-level BPE).

A, B, E, N, D, C3, A9, SP, X, ND, EN, E2, X82, XAC, EMPTY, D_C3, ENDA, XEND, BANG, C = range(20)
V = 20
PIECES = {
    A: b"a",
    B: b"b",
    E: b"E",
    N: b"N",
    D: b"D",
    C3: b"\xc3",  # first byte of U+00E9 (e-acute)
    A9: b"\xa9",  # second byte of U+00E9
    SP: b" ",
    X: b"x",
    ND: b"ND",
    EN: b"EN",
    E2: b"\xe2",  # U+20AC (euro sign) is E2 82 AC
    X82: b"\x82",
    XAC: b"\xac",
    EMPTY: b"",
    D_C3: b"D\xc3",  # a complete character followed by a partial one
    ENDA: b"ENDa",
    XEND: b"xEND",
    BANG: b"!",
    C: b"c",
}
PROMPT = (C, BANG, SP)


def detok(ids) -> str:
    return b"".join(PIECES[int(i)] for i in ids).decode("utf-8", errors="replace")


def onehot(pick: int, value: float = 5.0, v: int = V) -> np.ndarray:
    """A row whose argmax is ``pick`` with margin ``value`` over every other id (all zeros)."""
    r = np.zeros(v, dtype=np.float32)
    r[pick] = value
    return r


def stack(picks, v: int = V) -> np.ndarray:
    return np.stack([onehot(p, v=v) for p in picks]) if picks else np.empty((0, v), dtype=np.float32)


def run(state, picks, draft=()):
    """One step whose K + 1 rows pick ``picks`` (each with a wide margin): ``(state, commits, rewind_to)``."""
    draft = tuple(draft)
    assert len(picks) == len(draft) + 1
    outcome = step(state, onehot(picks[0]), stack(picks[1:]) if draft else None, draft)
    return outcome.state, outcome.commits, outcome.rewind_to


@pytest.mark.parametrize(
    "picks, draft, options, accepted",
    [
        ([5], (), Options(), 0),
        ([4, 5, 9, 1], (4, 5, 6), Options(), 2),  # draft[2] rejected: 4, 5 accepted, 9 is the bonus
        ([4, 5, 6, 7], (4, 5, 6), Options(), 3),  # all accepted, 7 is the bonus
        ([4, 5, 6, 7], (4, 5, 6), Options(max_tokens=2), 1),  # a budget of 1 draft token: 4, then the bonus 5
        ([4, 5, 6, 7], (4, 5, 6), Options(eos_token_ids={4}), 1),  # the accepted EOS ends the block
        ([4, 5, 6, 7], (4, 5, 6), Options(eos_token_ids={5}), 2),
    ],
)
def test_step_reports_the_draft_tokens_it_committed(picks, draft, options, accepted):
    s = start(options)
    if draft and len(draft) > draft_budget(s):
        draft = draft[: draft_budget(s)]
        picks = picks[: len(draft) + 1]
    outcome = step(s, onehot(picks[0]), stack(picks[1:]) if draft else None, draft)
    assert outcome.accepted == accepted
    assert outcome.state.stats.accepted_tokens == accepted


def start(options=None, prompt=PROMPT, detokenize=None):
    return DecodeState.start(prompt, options if options is not None else Options(), detokenize)


def texts(commits):
    return tuple(c.text for c in commits)


def tokens(commits):
    return tuple(c.token_id for c in commits)


# --------------------------------------------------------------------------------------------------------------
# Greedy acceptance


def test_plain_step_commits_the_base_pick():
    s = start()
    s2, commits, rewind_to = run(s, [5])
    assert s2.generated_tokens == (5,)
    assert commits == (Commit(5, ""),)
    assert rewind_to == s2.kv_len == len(PROMPT) + 1 - 1
    assert s2.finish_reason is None
    assert s2.stats == Stats(steps=1)
    assert s2.pending_token == 5


def test_initial_state_properties():
    s = start()
    assert s.generated_tokens == ()
    assert s.pending_token == PROMPT[-1]
    assert s.context_len == len(PROMPT)
    assert s.kv_len == len(PROMPT) - 1
    assert not s.finished and s.finish_reason is None
    assert s.text == "" and s.streamed_text == ""


def test_all_draft_accepted_adds_bonus_from_last_row():
    s = start()
    s2, commits, rewind_to = run(s, [4, 5, 6, 7], draft=(4, 5, 6))
    assert s2.generated_tokens == (4, 5, 6, 7)
    assert tokens(commits) == (4, 5, 6, 7)
    assert rewind_to == s2.kv_len == len(PROMPT) + 4 - 1
    assert s2.stats == Stats(
        steps=1,
        verification_steps=1,
        proposed_tokens=3,
        accepted_tokens=3,
        multi_token_accepts=1,
    )


def test_longest_matching_prefix_then_the_target_pick():
    s = start()
    # picks: 4 (== draft[0]) then 9 (!= draft[1] = 5): commit 4 and the correction 9. Rows 2 and 3 are never read.
    base = onehot(4)
    rows = np.stack([onehot(9), np.full(V, np.nan, np.float32), np.full(V, np.nan, np.float32)])
    s2, commits, rewind_to, _, _ = step(s, base, rows, (4, 5, 6))
    assert s2.generated_tokens == (4, 9)
    assert tokens(commits) == (4, 9)
    assert rewind_to == s2.kv_len == len(PROMPT) + 2 - 1
    assert s2.stats.accepted_tokens == 1
    assert s2.stats.proposed_tokens == 3
    assert s2.stats.multi_token_accepts == 0


def test_first_draft_token_rejected_commits_only_the_base_pick():
    s = start()
    s2, commits, rewind_to = run(s, [3, 4, 5], draft=(4, 5))
    assert s2.generated_tokens == (3,)
    assert tokens(commits) == (3,)
    assert rewind_to == s.kv_len + 1 == s2.kv_len
    assert s2.stats.accepted_tokens == 0
    assert s2.stats.verification_steps == 1
    assert s2.stats.proposed_tokens == 2


def test_argmax_ties_break_to_lowest_id_in_base_row():
    s = start()
    base = np.zeros(V, np.float32)
    base[[3, 7, 11]] = 2.0
    s2, commits, _, _, _ = step(s, base, None, ())
    assert s2.generated_tokens == (3,)


def test_argmax_ties_break_to_lowest_id_in_verify_row():
    s = start()
    base = np.zeros(V, np.float32)
    base[[1, 2]] = 2.0  # tie 1/2 -> 1, which matches the draft
    row = np.zeros(V, np.float32)
    row[[6, 3]] = 4.0  # tie 3/6 -> 3
    s2, _, _, _, _ = step(s, base, row[None, :], (1,))
    assert s2.generated_tokens == (1, 3)


def test_tie_broken_against_the_draft_rejects_it():
    s = start()
    base = np.zeros(V, np.float32)
    base[[1, 2]] = 2.0  # the draft proposes the higher id of an exact tie: greedy picks 1
    s2, _, _, _, _ = step(s, base, onehot(5)[None, :], (2,))
    assert s2.generated_tokens == (1,)
    assert s2.stats.accepted_tokens == 0


def test_nan_in_a_row_that_is_never_reached_is_ignored():
    s = start()
    rows = np.stack([onehot(6), np.full(V, np.nan, np.float32)])
    s2, _, _, _, _ = step(s, onehot(5), rows, (7, 8))  # draft[0] rejected: rows are not read
    assert s2.generated_tokens == (5,)


def test_step_does_not_modify_its_arrays():
    s = start()
    base = onehot(4)
    rows = stack([5, 6])
    base_copy, rows_copy = base.copy(), rows.copy()
    step(s, base, rows, (4, 5))
    assert np.array_equal(base, base_copy)
    assert np.array_equal(rows, rows_copy)


def test_logits_as_lists_and_float64_are_accepted():
    s = start()
    base = [0.0] * V
    base[4] = 1.0
    rows = [[0.0] * V]
    rows[0][9] = 1.0
    s2, _, _, _, _ = step(s, base, rows, [4])
    assert s2.generated_tokens == (4, 9)
    s3, _, _, _, _ = step(s, onehot(4).astype(np.float64), None, ())
    assert s3.generated_tokens == (4,)


SCENARIOS = {
    "plain": (Options(), [5], ()),
    "full_accept": (Options(), [4, 5, 6, 7], (4, 5, 6)),
    "partial_accept": (Options(), [4, 5, 9, 1], (4, 5, 6)),
    "reject_first": (Options(), [9, 1, 2, 3], (4, 5, 6)),
    "eos_mid_block": (Options(eos_token_ids=5), [4, 5, 6, 7], (4, 5, 6)),
    "stop_seq_mid_block": (Options(stop=[(4, 5)]), [4, 5, 6, 7], (4, 5, 6)),
    "max_tokens_end_of_block": (Options(max_tokens=4), [4, 5, 6, 7], (4, 5, 6)),
    "max_context_end_of_block": (Options(max_context=len(PROMPT) + 3), [4, 5, 6], (4, 5)),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_rewind_to_is_new_kv_len(name):
    options, picks, draft = SCENARIOS[name]
    s = start(options)
    s2, commits, rewind_to = run(s, picks, draft)
    assert rewind_to == s2.kv_len == len(PROMPT) + len(s2.generated_tokens) - 1
    assert len(commits) == len(s2.generated_tokens)
    # The pass left kv_len + 1 + K positions; the rewind never asks for more than that.
    assert s.kv_len < rewind_to <= s.kv_len + 1 + len(draft)


def test_rewind_to_over_several_steps():
    s = start(Options(max_tokens=50))
    plan = [([5], ()), ([1, 2, 3], (1, 2)), ([7, 8], (9,)), ([4, 4, 4, 4], (4, 4, 4))]
    for picks, draft in plan:
        before = len(s.generated_tokens)
        s, commits, rewind_to = run(s, picks, draft)
        assert rewind_to == s.kv_len == len(PROMPT) + len(s.generated_tokens) - 1
        assert len(s.generated_tokens) == before + len(commits)
    assert s.generated_tokens == (5, 1, 2, 3, 7, 4, 4, 4, 4)
    assert s.stats.steps == 4
    assert s.stats.steps == 4
    assert s.stats.verification_steps == 3
    assert s.stats.proposed_tokens == 6
    assert s.stats.accepted_tokens == 2 + 0 + 3


# --------------------------------------------------------------------------------------------------------------
# Commit rules, in order, in the middle of an accepted block


def test_eos_mid_block_is_kept_and_nothing_after_it():
    s = start(Options(eos_token_ids=6))
    s2, commits, rewind_to = run(s, [4, 6, 5, 7], draft=(4, 6, 5))
    assert s2.generated_tokens == (4, 6)
    assert tokens(commits) == (4, 6)
    assert s2.finish_reason is FinishReason.EOS_TOKEN
    assert s2.stop_matched is None
    assert rewind_to == len(PROMPT) + 2 - 1
    assert s2.stats.accepted_tokens == 2  # both committed tokens were draft tokens
    assert draft_budget(s2) == 0


def test_eos_as_first_pick_and_as_bonus():
    opts = Options(eos_token_ids=[6, 9])
    s2, commits, _ = run(start(opts), [9, 1, 2], draft=(4, 5))
    assert s2.generated_tokens == (9,) and s2.finish_reason is FinishReason.EOS_TOKEN
    s3, commits, _ = run(start(opts), [4, 6], draft=(4,))
    assert s3.generated_tokens == (4, 6) and s3.finish_reason is FinishReason.EOS_TOKEN


def test_stop_token_sequence_mid_block():
    s = start(Options(stop=[(4, 5)]))
    s2, commits, rewind_to = run(s, [4, 5, 6, 7], draft=(4, 5, 6))
    assert s2.generated_tokens == (4, 5)
    assert s2.finish_reason is FinishReason.STOP_SEQUENCE
    assert s2.stop_matched == (4, 5)
    assert rewind_to == len(PROMPT) + 2 - 1


def test_stop_token_sequence_spanning_two_steps():
    s = start(Options(stop=[(9, 9, 9), (4, 5)]))
    s, commits, _ = run(s, [4])
    assert s.finish_reason is None
    s, commits, rewind_to = run(s, [5, 6, 7], draft=(5, 6))
    assert tokens(commits) == (5,)
    assert s.generated_tokens == (4, 5)
    assert s.finish_reason is FinishReason.STOP_SEQUENCE
    assert s.stop_matched == (4, 5)
    assert rewind_to == s.kv_len


def test_stop_token_sequence_needs_the_whole_sequence():
    s = start(Options(stop=[(4, 5, 6)]))
    s, _, _ = run(s, [4, 5, 4, 5], draft=(4, 5, 4))
    assert s.finish_reason is None
    s, commits, _ = run(s, [6, 1], draft=(6,))
    assert tokens(commits) == (6,)
    assert s.stop_matched == (4, 5, 6)


def test_stop_string_spanning_tokens_in_one_block():
    s = start(Options(stop="END"), detokenize=detok)
    s2, commits, rewind_to = run(s, [A, E, N, D, B], draft=(A, E, N, D))
    assert s2.generated_tokens == (A, E, N, D)
    assert s2.finish_reason is FinishReason.STOP_SEQUENCE
    assert s2.stop_matched == "END"
    assert s2.text == "a"
    assert texts(commits) == ("a", "", "", "")
    assert rewind_to == s2.kv_len


def test_stop_string_spanning_steps():
    s = start(Options(stop=["zz", "END"]), detokenize=detok)
    all_commits = []
    s, c, _ = run(s, [A])
    all_commits += c
    s, c, _ = run(s, [E, N], draft=(E,))
    all_commits += c
    assert s.text == "aEN" and s.streamed_text == "a"
    s, c, _ = run(s, [D, B, C], draft=(D, B))
    all_commits += c
    assert tokens(c) == (D,)
    assert s.generated_tokens == (A, E, N, D)
    assert s.text == "a"
    assert s.stop_matched == "END"
    assert "".join(texts(all_commits)) == "a"


def test_stop_string_earliest_completion_across_tokens():
    # "ND" completes at D; "ENDx" would start earlier but completes only at x: "ND" wins.
    s = start(Options(stop=("ENDx", "ND")), detokenize=detok)
    s2, commits, _ = run(s, [E, N, D, X, A], draft=(E, N, D, X))
    assert s2.generated_tokens == (E, N, D)
    assert s2.stop_matched == "ND"
    assert s2.text == "E"
    assert "".join(texts(commits)) == "E"


def test_stop_string_earliest_completion_in_one_token():
    # The token's text is "ENDa": "EN" completes at 2, "ND" at 3, whatever the order of the options.
    s = start(Options(stop=("ND", "EN")), detokenize=detok)
    s2, commits, _ = run(s, [A, ENDA, B], draft=(A, ENDA))
    assert s2.generated_tokens == (A, ENDA)
    assert s2.stop_matched == "EN"
    assert s2.text == "a"
    assert "".join(texts(commits)) == "a"


def test_stop_string_equal_completion_prefers_earlier_start():
    # "xEND": "END" and "ND" both complete at 4; "END" starts earlier and cuts more.
    s = start(Options(stop=("ND", "END")), detokenize=detok)
    s2, commits, _ = run(s, [XEND])
    assert s2.stop_matched == "END"
    assert s2.text == "x"
    assert texts(commits) == ("x",)


def test_stop_string_inside_a_token_cuts_the_rest_of_it():
    s = start(Options(stop="END"), detokenize=detok)
    s2, commits, _ = run(s, [B, ENDA, A], draft=(B, ENDA))
    assert s2.generated_tokens == (B, ENDA)
    assert s2.text == "b"
    assert "".join(texts(commits)) == "b"


def test_max_tokens_budget_values():
    s = start(Options(max_tokens=4))
    assert draft_budget(s) == 3
    s, _, _ = run(s, [5])
    assert draft_budget(s) == 2
    s, _, _ = run(s, [6])
    assert draft_budget(s) == 1
    s, _, _ = run(s, [7])
    assert draft_budget(s) == 0
    s, _, _ = run(s, [8])
    assert s.finish_reason is FinishReason.MAX_TOKENS
    assert draft_budget(s) == 0
    assert draft_budget(start(Options(max_tokens=1))) == 0


def test_max_tokens_reached_exactly_by_a_full_budget_block():
    s = start(Options(max_tokens=4))
    s, _, _ = run(s, [5])
    # A proposer may want 3 more, but the budget is 2: those 2 plus the bonus land exactly on 4.
    with pytest.raises(ValueError, match="budget of 2"):
        run(s, [6, 7, 8, 9], draft=(6, 7, 8))
    s, commits, rewind_to = run(s, [6, 7, 8], draft=(6, 7))
    assert s.generated_tokens == (5, 6, 7, 8)
    assert len(s.generated_tokens) == 4
    assert s.finish_reason is FinishReason.MAX_TOKENS
    assert rewind_to == s.kv_len


def test_max_tokens_one():
    s = start(Options(max_tokens=1))
    with pytest.raises(ValueError, match="budget of 0"):
        run(s, [1, 2], draft=(1,))
    s, commits, _ = run(s, [1])
    assert s.generated_tokens == (1,) and s.finish_reason is FinishReason.MAX_TOKENS


def test_max_context_budget_and_finish():
    opts = Options(max_tokens=100, max_context=len(PROMPT) + 3)
    s = start(opts)
    assert draft_budget(s) == 2  # min(100 - 0 - 1, 6 - 3 - 1)
    s1, _, _ = run(s, [9, 1, 2], draft=(4, 5))  # rejected: one token
    assert s1.finish_reason is None
    assert draft_budget(s1) == 1
    s2, commits, rewind_to = run(s, [4, 5, 6], draft=(4, 5))
    assert s2.generated_tokens == (4, 5, 6)
    assert s2.context_len == opts.max_context
    assert s2.finish_reason is FinishReason.CONTEXT_FULL
    assert rewind_to == s2.kv_len == opts.max_context - 1


def test_max_context_reached_mid_block_via_step_from_picks_after_earlier_steps():
    opts = Options(max_tokens=100, max_context=len(PROMPT) + 5)
    s = start(opts)
    s, _, _, _, _ = step_from_picks(s, [1], (), vocab_size=V)
    s, _, _, _, _ = step_from_picks(s, [2], (), vocab_size=V)
    assert draft_budget(s) == 2
    s, commits, rewind_to, _, _ = step_from_picks(s, [3, 4, 5], (3, 4), vocab_size=V)
    assert s.generated_tokens == (1, 2, 3, 4, 5)
    assert s.finish_reason is FinishReason.CONTEXT_FULL
    assert rewind_to == opts.max_context - 1


def test_prompt_of_exactly_max_context_finishes_immediately():
    s = DecodeState.start((1, 2, 3), Options(max_context=3))
    assert s.finished
    assert s.finish_reason is FinishReason.CONTEXT_FULL
    assert s.generated_tokens == ()
    assert draft_budget(s) == 0
    with pytest.raises(ValueError, match="already finished"):
        run(s, [1])
    with pytest.raises(ValueError, match="already finished"):
        step_from_picks(s, [1], (), vocab_size=V)


def test_prompt_one_short_of_max_context_gets_one_token():
    s = DecodeState.start((1, 2, 3), Options(max_context=4))
    assert draft_budget(s) == 0
    s, commits, _ = run(s, [7])
    assert s.generated_tokens == (7,)
    assert s.finish_reason is FinishReason.CONTEXT_FULL


def test_eos_wins_over_max_tokens_on_the_same_token():
    s = start(Options(max_tokens=2, eos_token_ids=6))
    s, _, _ = run(s, [4, 6], draft=(4,))
    assert s.generated_tokens == (4, 6)
    assert s.finish_reason is FinishReason.EOS_TOKEN


def test_eos_wins_over_stop_sequence_on_the_same_token():
    s = start(Options(eos_token_ids=6, stop=[(6,)]))
    s, _, _ = run(s, [6])
    assert s.finish_reason is FinishReason.EOS_TOKEN
    assert s.stop_matched is None


def test_eos_wins_over_stop_string_on_the_same_token():
    s = start(Options(eos_token_ids=D, stop="END"), detokenize=detok)
    s, _, _ = run(s, [E, N, D], draft=(E, N))
    assert s.finish_reason is FinishReason.EOS_TOKEN
    assert s.stop_matched is None


def test_stop_sequence_wins_over_stop_string_on_the_same_token():
    s = start(Options(stop=[(D,), "END"]), detokenize=detok)
    s, _, _ = run(s, [E, N, D], draft=(E, N))
    assert s.finish_reason is FinishReason.STOP_SEQUENCE
    assert s.stop_matched == (D,)


def test_stop_sequence_wins_over_max_tokens_on_the_same_token():
    s = start(Options(max_tokens=2, stop=[(4, 5)]))
    s, _, _ = run(s, [4, 5], draft=(4,))
    assert s.finish_reason is FinishReason.STOP_SEQUENCE
    assert s.stop_matched == (4, 5)


def test_stop_string_wins_over_max_tokens_on_the_same_token():
    s = start(Options(max_tokens=3, stop="END"), detokenize=detok)
    s, commits, _ = run(s, [E, N, D], draft=(E, N))
    assert s.finish_reason is FinishReason.STOP_SEQUENCE
    assert s.stop_matched == "END"
    assert s.text == ""
    assert "".join(texts(commits)) == ""


def test_max_tokens_wins_over_max_context_on_the_same_token():
    s = start(Options(max_tokens=3, max_context=len(PROMPT) + 3))
    s, _, _ = run(s, [4, 5, 6], draft=(4, 5))
    assert s.finish_reason is FinishReason.MAX_TOKENS


# --------------------------------------------------------------------------------------------------------------
# Streaming text


def _stream(options, plan, detokenize=detok):
    """Run ``plan`` (a list of (picks, draft)); check the stream invariants after every step."""
    s = start(options, detokenize=detokenize)
    streamed = ""
    per_step = []
    for picks, draft in plan:
        s, commits, _ = run(s, picks, draft)
        streamed += "".join(texts(commits))
        per_step.append(texts(commits))
        assert streamed == s.streamed_text
        assert s.text.startswith(streamed)
        assert s.streamed_chars == len(streamed)
        if s.finished:
            assert streamed == s.text
            break
    return s, per_step


def test_stream_without_stop_strings_releases_each_token():
    s, per_step = _stream(Options(), [([A], ()), ([B, SP, C], (B, SP))])
    assert per_step == [("a",), ("b", " ", "c")]
    assert s.text == "ab c"


def test_stream_holds_back_a_possible_stop_string_then_releases_it():
    s, per_step = _stream(Options(stop="END"), [([A], ()), ([E], ()), ([N], ()), ([B], ())])
    assert per_step == [("a",), ("",), ("",), ("ENb",)]
    assert s.text == "aENb" and s.finish_reason is None


def test_stream_holds_back_in_one_block():
    s, per_step = _stream(Options(stop="END"), [([A, E, N, B, C], (A, E, N, B))])
    assert per_step == [("a", "", "", "ENb", "c")]


def test_stream_releases_only_what_cannot_start_the_stop_string():
    # "EE": the first E can no longer start "END" once a second E follows; the second E is still held.
    s, per_step = _stream(Options(stop="END"), [([E], ()), ([E], ()), ([A], ())])
    assert per_step == [("",), ("E",), ("Ea",)]


def test_stream_hold_back_uses_the_longest_possible_prefix():
    s, per_step = _stream(Options(stop=("abc", "bx")), [([A], ()), ([B], ()), ([C], ())])
    assert s.stop_matched == "abc"
    assert per_step == [("",), ("",), ("",)]
    assert s.text == ""


def test_stream_partial_utf8_character_is_never_emitted():
    s, per_step = _stream(Options(), [([A], ()), ([C3], ()), ([A9], ()), ([B], ())])
    assert per_step == [("a",), ("",), ("\u00e9",), ("b",)]
    assert "\ufffd" not in s.text


def test_stream_three_byte_character_in_one_block():
    s, per_step = _stream(Options(), [([E2, X82, XAC, A], (E2, X82, XAC))])
    assert per_step == [("", "", "\u20ac", "a")]
    assert s.text == "\u20aca"


def test_stream_partial_character_while_text_is_held_back():
    s, per_step = _stream(Options(stop="END"), [([E], ()), ([C3], ()), ([A9], ())])
    assert per_step == [("",), ("",), ("E\u00e9",)]


def test_stream_empty_piece_tokens():
    s, per_step = _stream(Options(), [([EMPTY, A, EMPTY], (EMPTY, A))])
    assert per_step == [("", "a", "")]
    assert s.text == "a"


def test_stream_releases_everything_at_finish():
    s, per_step = _stream(Options(max_tokens=3, stop="END"), [([A, E, N], (A, E))])
    assert per_step == [("a", "", "EN")]
    assert s.finish_reason is FinishReason.MAX_TOKENS
    assert s.text == "aEN" and s.streamed_chars == 3
    assert s.stop_matched is None


def test_stream_releases_held_text_at_eos():
    s, per_step = _stream(Options(eos_token_ids=B, stop="END"), [([E, N, B], (E, N))])
    assert per_step == [("", "", "ENb")]
    assert s.finish_reason is FinishReason.EOS_TOKEN


def test_stream_partial_character_at_finish_is_flushed_as_replacement():
    # Documented: at the end, an undecodable tail shows as U+FFFD rather than being lost.
    s, per_step = _stream(Options(max_tokens=2), [([A, C3], (A,))])
    assert per_step == [("a", "\ufffd")]
    assert s.text == "a\ufffd"


def test_final_flush_applies_stop_strings():
    # Token D_C3 decodes to "D" + a partial character; it is the 3rd and last token (max_tokens=3).
    s, per_step = _stream(Options(max_tokens=3, stop="END"), [([E], ()), ([N], ()), ([D_C3], ())])
    assert "END" not in s.text
    assert s.finish_reason is FinishReason.STOP_SEQUENCE
    assert s.stop_matched == "END"
    assert s.text == ""


def test_stop_string_completed_by_a_token_with_a_trailing_partial_character():
    # "D" waits with its partial character; the stop string is seen when the character completes.
    s, per_step = _stream(Options(stop="END"), [([E], ()), ([N], ()), ([D_C3], ()), ([A9], ())])
    assert s.stop_matched == "END"
    assert s.text == ""
    assert s.generated_tokens == (E, N, D_C3, A9)


def test_stream_without_detokenize_has_no_text():
    s, per_step = _stream(Options(max_tokens=3), [([1, 2, 3], (1, 2))], detokenize=None)
    assert per_step == [("", "", "")]
    assert s.text == ""


def test_stream_invariant_over_a_long_mixed_run():
    opts = Options(max_tokens=40, stop=("END", "xx"))
    plan = [
        ([A, E], (A,)),
        ([E, N, C3, B], (E, N, B)),  # C3 rejects the draft's B
        ([A9, X], (A9,)),
        ([A, E2, X82, XAC, N], (A, E2, X82, XAC)),
        ([E, N, EN], (E, N)),
        ([D], ()),
    ]
    s, per_step = _stream(opts, plan)
    assert per_step == [
        ("a", ""),
        ("E", "", ""),
        ("EN\u00e9", ""),
        ("xa", "", "", "\u20ac", "N"),
        ("", "", "EN"),  # "NENEN": the first "EN" can no longer start "END"; the last is held
        ("",),  # D completes "END": the held "EN" is cut, nothing more is released
    ]
    assert s.stop_matched == "END"
    assert s.text == "aEEN\u00e9xa\u20acNEN"
    assert s.generated_tokens == (A, E, E, N, C3, A9, X, A, E2, X82, XAC, N, E, N, EN, D)


# --------------------------------------------------------------------------------------------------------------
# Logprobs


def _ref_logprobs(row) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = float(x.max())
    return x - (m + math.log(math.fsum(math.exp(v - m) for v in x)))


def _ref_top(row, n):
    lp = _ref_logprobs(row)
    order = sorted(range(len(lp)), key=lambda i: (-lp[i], i))[:n]
    return [(i, lp[i]) for i in order]


def _check_record(rec: TokenLogprob, row, token, n):
    lp = _ref_logprobs(row)
    assert rec.token_id == token
    assert rec.logprob == pytest.approx(lp[token], rel=1e-12, abs=1e-12)
    ref = _ref_top(row, n)
    assert [t for t, _ in rec.top] == [t for t, _ in ref]
    for (_, got), (_, want) in zip(rec.top, ref, strict=True):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_logprobs_plain_step_matches_float64_reference_with_ties_to_lowest_id():
    row = np.array([1.0, 3.0, 2.0, 3.0, 0.5] + [-1.0] * (V - 5), dtype=np.float32)
    s = start(Options(top_logprobs=3))
    s2, commits, _, _, _ = step(s, row, None, ())
    assert s2.generated_tokens == (1,)
    assert len(s2.logprobs) == 1
    rec = s2.logprobs[0]
    _check_record(rec, row, 1, 3)
    assert [t for t, _ in rec.top] == [1, 3, 2]
    assert commits[0].logprob == rec
    assert rec.top[0][1] == rec.logprob


def test_logprobs_top_n_cut_inside_a_tie_takes_lowest_ids():
    row = np.zeros(V, np.float32)
    row[[9, 4, 12, 2]] = 7.0
    s2, _, _, _, _ = step(start(Options(top_logprobs=2)), row, None, ())
    assert s2.generated_tokens == (2,)
    assert [t for t, _ in s2.logprobs[0].top] == [2, 4]
    _check_record(s2.logprobs[0], row, 2, 2)


def test_logprobs_top_n_larger_than_vocab_lists_every_id():
    row = np.arange(V, dtype=np.float32)[::-1].copy()
    s2, _, _, _, _ = step(start(Options(top_logprobs=100)), row, None, ())
    assert len(s2.logprobs[0].top) == V
    assert [t for t, _ in s2.logprobs[0].top] == list(range(V))
    _check_record(s2.logprobs[0], row, 0, V)
    assert math.fsum(math.exp(lp) for _, lp in s2.logprobs[0].top) == pytest.approx(1.0, abs=1e-12)


def test_logprobs_with_large_logits_are_stable():
    row = np.zeros(V, np.float32)
    row[5] = 1000.0
    row[6] = 999.0
    s2, _, _, _, _ = step(start(Options(top_logprobs=2)), row, None, ())
    _check_record(s2.logprobs[0], row, 5, 2)
    assert math.isfinite(s2.logprobs[0].logprob)


def test_logprobs_come_from_the_row_that_produced_each_token():
    rng = np.random.default_rng(7)
    base = rng.standard_normal(V).astype(np.float32)
    base[4] = 10.0
    r0 = rng.standard_normal(V).astype(np.float32)
    r0[5] = 9.0
    r1 = rng.standard_normal(V).astype(np.float32)
    r1[11] = 8.0  # bonus (draft[1] = 6 is rejected)
    r2 = rng.standard_normal(V).astype(np.float32)
    s = start(Options(top_logprobs=4))
    s2, commits, _, _, _ = step(s, base, np.stack([r0, r1, r2]), (4, 5, 6))
    assert s2.generated_tokens == (4, 5, 11)
    assert len(s2.logprobs) == 3
    for rec, row, tok, commit in zip(s2.logprobs, [base, r0, r1], [4, 5, 11], commits, strict=True):
        _check_record(rec, row, tok, 4)
        assert commit.logprob == rec


def test_logprobs_one_record_per_committed_token_across_steps_and_mid_block_finish():
    s = start(Options(top_logprobs=1, eos_token_ids=6))
    s, _, _ = run(s, [3])
    s, _, _ = run(s, [4, 5], draft=(4,))
    s, commits, _ = run(s, [7, 6, 8, 9], draft=(7, 6, 8))
    assert s.generated_tokens == (3, 4, 5, 7, 6)
    assert [r.token_id for r in s.logprobs] == list(s.generated_tokens)
    assert all(len(r.top) == 1 and r.top[0][0] == r.token_id for r in s.logprobs)
    assert len(commits) == 2 and all(c.logprob is not None for c in commits)


def test_no_logprobs_by_default():
    s, commits, _ = run(start(), [4, 5], draft=(4,))
    assert s.logprobs == ()
    assert all(c.logprob is None for c in commits)


def test_step_from_picks_refuses_logprobs():
    with pytest.raises(ValueError, match="logprobs"):
        step_from_picks(start(Options(top_logprobs=1)), [4], (), vocab_size=V)


# --------------------------------------------------------------------------------------------------------------
# Tie guard


def _row_margin(pick: int, margin: float, second: int | None = None) -> np.ndarray:
    """Argmax ``pick`` at 3.0, runner-up (``second``, default the last id) at 3.0 - margin, the rest 0."""
    r = np.zeros(V, np.float32)
    second = V - 1 if second is None else second
    r[second] = 3.0 - margin
    r[pick] = 3.0
    return r


def test_tie_guard_ends_acceptance_before_a_narrow_margin():
    s = start(Options(tie_margin=0.5))
    base = _row_margin(4, 2.0)
    rows = np.stack([_row_margin(5, 2.0), _row_margin(6, 0.25), _row_margin(7, 2.0)])
    s2, commits, rewind_to, _, _ = step(s, base, rows, (4, 5, 6))
    assert s2.generated_tokens == (4, 5)  # 6 (picked with margin 0.25) is not committed
    assert rewind_to == s2.kv_len == s.kv_len + 2
    assert s2.stats.tie_guard_stops == 1
    assert s2.stats.accepted_tokens == 2
    assert not s2.plain_step_next
    assert draft_budget(s2) > 0


def test_tie_guard_on_the_bonus_token():
    s = start(Options(tie_margin=0.5))
    base = _row_margin(4, 2.0)
    rows = np.stack([_row_margin(5, 0.0, second=9)])  # exact tie 5/9 in the bonus row
    s2, _, _, _, _ = step(s, base, rows, (4,))
    assert s2.generated_tokens == (4,)
    assert s2.stats.tie_guard_stops == 1


def test_tie_guard_on_a_rejection_correction():
    s = start(Options(tie_margin=0.5))
    base = _row_margin(4, 2.0)
    rows = np.stack([_row_margin(8, 0.1), _row_margin(7, 2.0)])  # draft[1] = 5 rejected; correction 8 is close
    s2, _, _, _, _ = step(s, base, rows, (4, 5))
    assert s2.generated_tokens == (4,)
    assert s2.stats.tie_guard_stops == 1


def test_tie_guard_on_the_first_pick_commits_nothing_and_asks_for_a_plain_step():
    s = start(Options(tie_margin=0.5))
    s = run(s, [1])[0]
    base = _row_margin(4, 0.1)
    rows = np.stack([_row_margin(5, 2.0)])
    s2, commits, rewind_to, _, _ = step(s, base, rows, (4,))
    assert commits == ()
    assert s2.generated_tokens == s.generated_tokens == (1,)
    assert rewind_to == s.kv_len == s2.kv_len
    assert s2.plain_step_next
    assert draft_budget(s2) == 0
    assert s2.finish_reason is None
    assert s2.stats.tie_guard_stops == 1
    assert s2.stats.steps == s.stats.steps + 1
    assert s2.stats.steps == s.stats.steps + 1
    assert s2.stats.proposed_tokens == 1 and s2.stats.accepted_tokens == 0
    with pytest.raises(ValueError, match="budget of 0"):
        step(s2, base, rows, (4,))
    # The plain step decides the exact tie by the lowest id, unguarded.
    tie = _row_margin(4, 0.0, second=9)
    s3, commits, _, _, _ = step(s2, tie, None, ())
    assert tokens(commits) == (4,)
    assert not s3.plain_step_next
    assert draft_budget(s3) > 0
    assert s3.stats.tie_guard_stops == 1


def test_plain_step_is_never_guarded():
    s = start(Options(tie_margin=10.0))
    s2, commits, _, _, _ = step(s, _row_margin(3, 0.0, second=8), None, ())
    assert tokens(commits) == (3,)
    assert s2.stats.tie_guard_stops == 0


def test_margin_equal_to_the_threshold_is_committed():
    s = start(Options(tie_margin=0.5))
    s2, commits, _, _, _ = step(s, _row_margin(4, 0.5), _row_margin(5, 0.5)[None, :], (4,))
    assert s2.generated_tokens == (4, 5)
    assert s2.stats.tie_guard_stops == 0


def test_tie_guard_off_by_default_even_for_exact_ties():
    s = start()
    s2, _, _, _, _ = step(s, _row_margin(4, 0.0, second=9), _row_margin(5, 0.0, second=9)[None, :], (4,))
    assert s2.generated_tokens == (4, 5)
    assert s2.stats.tie_guard_stops == 0


def test_tie_guard_counts_every_stop():
    s = start(Options(tie_margin=0.5, max_tokens=50))
    narrow = _row_margin(4, 0.1)
    s, c, _, _, _ = step(s, narrow, _row_margin(5, 2.0)[None, :], (4,))  # stop 1: nothing committed
    assert c == ()
    s, c, _, _, _ = step(s, narrow, None, ())  # plain: commits 4
    s, c, _, _, _ = step(s, _row_margin(5, 2.0), np.stack([_row_margin(6, 0.1)]), (5,))  # stop 2
    assert tokens(c) == (5,)
    assert s.stats.tie_guard_stops == 2
    assert s.generated_tokens == (4, 5)


def test_step_from_picks_tie_guard_with_margins():
    s = start(Options(tie_margin=0.5))
    s2, commits, rewind_to, _, _ = step_from_picks(s, [4, 5, 6], (4, 5), margins=[2.0, 2.0, 0.1], vocab_size=V)
    assert tokens(commits) == (4, 5)
    assert s2.stats.tie_guard_stops == 1
    s3, commits, rewind_to, _, _ = step_from_picks(
        s, [4, 5, 6], (4, 5), margins=np.array([0.1, 2.0, 2.0], np.float32), vocab_size=V
    )
    assert commits == () and rewind_to == s.kv_len and draft_budget(s3) == 0
    s4, commits, _, _, _ = step_from_picks(s, [4, 5, 6], (4, 5), vocab_size=V)  # no margins: no guard
    assert tokens(commits) == (4, 5, 6)
    s5, commits, _, _, _ = step_from_picks(s, [4], (), margins=[0.0], vocab_size=V)  # plain: never guarded
    assert tokens(commits) == (4,)


# --------------------------------------------------------------------------------------------------------------
# step_from_picks == step


def _pick_row(pick: int, margin: float) -> np.ndarray:
    r = np.zeros(V, np.float32)
    r[pick] = 2.0 + margin
    r[(pick + 1) % V if margin > 0 else V - 1] = 2.0  # margin 0: exact tie with a higher id
    return r


@pytest.mark.parametrize(
    "options",
    [
        Options(max_tokens=12),
        Options(max_tokens=30, eos_token_ids=[B], tie_margin=0.3),
        Options(max_tokens=30, stop=("END", "\u00e9x")),
        Options(max_tokens=30, stop=[(X, X)], max_context=len(PROMPT) + 12),
    ],
    ids=["max_tokens", "eos_tie_guard", "stop_strings", "stop_seq_max_context"],
)
def test_step_from_picks_equals_step(options):
    plan = [  # (picks with margins, draft)
        ([(A, 1.0)], ()),
        ([(E, 1.0), (N, 0.1), (C3, 1.0)], (E, N)),
        ([(A9, 1.0), (X, 1.0), (X, 1.0)], (A9, X)),
        ([(X, 0.0)], ()),
        ([(A, 0.2), (B, 1.0)], (A,)),
        ([(B, 1.0)], ()),
        ([(E, 1.0), (N, 1.0), (D, 1.0), (A, 1.0)], (E, N, D)),
        ([(C, 1.0)], ()),
    ]
    s_logits = start(options, detokenize=detok)
    s_ids = start(options, detokenize=detok)
    for picks, draft in plan:
        if s_logits.finished:
            break
        draft = draft[: draft_budget(s_logits)]
        picks = picks[: len(draft) + 1]
        rows = [_pick_row(p, m) for p, m in picks]
        a = step(s_logits, rows[0], np.stack(rows[1:]) if draft else None, draft)
        margins = [float(np.sort(r)[-1] - np.sort(r)[-2]) for r in rows]
        b = step_from_picks(s_ids, [p for p, _ in picks], draft, margins=margins, vocab_size=V)
        assert a == b
        s_logits, s_ids = a[0], b[0]
    assert s_logits == s_ids


# --------------------------------------------------------------------------------------------------------------
# Bad input


def test_empty_prompt():
    with pytest.raises(ValueError, match="prompt_tokens is empty"):
        DecodeState.start([], Options())


def test_prompt_as_text():
    with pytest.raises(ValueError, match="not text"):
        DecodeState.start("hello", Options())
    with pytest.raises(ValueError, match="not text"):
        DecodeState.start(b"hello", Options())


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_prompt_with_a_non_token(bad):
    with pytest.raises(ValueError, match="prompt_tokens"):
        DecodeState.start([1, bad], Options())


def test_prompt_as_numpy_array_is_accepted():
    s = DecodeState.start(np.array([3, 1, 4], dtype=np.int64), Options())
    assert s.prompt_tokens == (3, 1, 4)
    assert all(type(t) is int for t in s.prompt_tokens)


def test_options_must_be_options():
    with pytest.raises(ValueError, match="options must be"):
        DecodeState.start([1], {"max_tokens": 3})


def test_detokenize_must_be_callable():
    with pytest.raises(ValueError, match="detokenize must be"):
        DecodeState.start([1], Options(), "not callable")


def test_draft_id_outside_the_vocabulary():
    s = start()
    with pytest.raises(ValueError, match=f"token id {V}, outside the vocabulary"):
        step(s, onehot(1), stack([1]), (V,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_draft(s, (1, 2, V + 5), V)
    with pytest.raises(ValueError, match="draft: -1 is not a token id"):
        step(s, onehot(1), stack([1]), (-1,))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logit_at_the_base_pick(bad):
    base = onehot(3)
    base[7] = bad
    with pytest.raises(ValueError, match="row 0 is not finite"):
        step(start(), base, None, ())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logit_at_a_verify_pick(bad):
    """A verify row that is not finite ends the block before it: the picks before it are committed, and the next
    step is plain, whose 1-token pass refuses the row exactly where plain decoding refuses it."""
    rows = stack([5, 6])
    rows[1, 2] = bad
    s, commits, rewind_to, _, _ = step(start(), onehot(4), rows, (4, 5))
    assert tokens(commits) == (4, 5)  # both accepted draft tokens, no bonus
    assert s.stats.accepted_tokens == 2
    assert s.plain_step_next and draft_budget(s) == 0
    assert rewind_to == s.kv_len
    plain_row = onehot(6)
    plain_row[2] = bad
    with pytest.raises(ValueError, match="row 0 is not finite"):
        step(s, plain_row, None, ())


def test_non_finite_margin_from_device_picks_ends_the_block_like_a_row():
    s, commits, _, _, _ = step_from_picks(start(), [4, 5, 6], (4, 5), vocab_size=V, margins=[1.0, 1.0, float("nan")])
    assert tokens(commits) == (4, 5) and s.plain_step_next
    with pytest.raises(ValueError, match="not finite"):
        step_from_picks(s, [6], (), vocab_size=V, margins=[float("nan")])


def test_all_minus_inf_row_is_refused():
    with pytest.raises(ValueError, match="not finite"):
        step(start(), np.full(V, -np.inf, np.float32), None, ())


def test_rows_shape_must_match_the_draft():
    s = start()
    with pytest.raises(ValueError, match=r"rows must have shape \[2, 20\]"):
        step(s, onehot(4), stack([5]), (4, 5))
    with pytest.raises(ValueError, match=r"rows must have shape \[1, 20\]"):
        step(s, onehot(4), np.zeros((1, V + 1), np.float32), (4,))
    with pytest.raises(ValueError, match=r"rows must have shape \[1, 20\]"):
        step(s, onehot(4), onehot(5), (4,))  # 1-D instead of [1, vocab]
    with pytest.raises(ValueError, match="rows must have shape"):
        step(s, onehot(4), None, (4,))


def test_rows_must_be_empty_for_an_empty_draft():
    s = start()
    with pytest.raises(ValueError, match="rows must be empty for an empty draft"):
        step(s, onehot(4), stack([5]), ())
    # None and a [0, vocab] array are both fine.
    assert step(s, onehot(4), np.empty((0, V), np.float32), ())[0].generated_tokens == (4,)


def test_base_logits_must_be_one_dimensional():
    s = start()
    with pytest.raises(ValueError, match="base_logits must have shape"):
        step(s, onehot(4)[None, :], None, ())
    with pytest.raises(ValueError, match="base_logits must have shape"):
        step(s, np.float32(1.0), None, ())
    with pytest.raises(ValueError, match="base_logits must have shape"):
        step(s, np.empty(0, np.float32), None, ())


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "8"])
def test_max_tokens_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_tokens"):
        Options(max_tokens=bad)


@pytest.mark.parametrize("bad", [-1, [1, -2], "7", 1.0, [True]])
def test_eos_ids_must_be_token_ids(bad):
    with pytest.raises(ValueError, match="eos_token_ids"):
        Options(eos_token_ids=bad)


def test_stop_sequences_must_be_non_empty_token_sequences():
    with pytest.raises(ValueError, match="stop: an empty token-id sequence"):
        Options(stop=[()])
    with pytest.raises(ValueError, match="stop: an empty token-id sequence"):
        Options(stop=[(1, 2), []])
    with pytest.raises(ValueError, match="neither a string nor a sequence of token ids"):
        Options(stop=[1, 2])  # flat, not a sequence of sequences
    with pytest.raises(ValueError, match="stop: -2 is not a token id"):
        Options(stop=[(1, -2)])
    with pytest.raises(ValueError, match="stop: b'ab' is bytes"):
        Options(stop=[b"ab"])


def test_stop_strings_must_be_non_empty_strings():
    with pytest.raises(ValueError, match="stop: an empty string"):
        Options(stop="")
    with pytest.raises(ValueError, match="stop: an empty string"):
        Options(stop=["ok", ""])
    with pytest.raises(ValueError, match="stop: 3 is neither"):
        Options(stop=["ok", 3])
    with pytest.raises(ValueError, match="stop must be a string"):
        Options(stop=5)
    with pytest.raises(ValueError, match="lone surrogate"):
        Options(stop="a\ud800")
    with pytest.raises(ValueError, match="at most 64"):
        Options(stop=["x"] * 65)


def test_none_means_the_default():
    """A JSON null or an unset flag: ``None`` for an option whose default is not None is that default."""
    assert Options(max_tokens=None, stop=None, tie_margin=None, top_logprobs=None) == Options()


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        DecodeState.start([1, 2], Options(stop="END"))


@pytest.mark.parametrize("bad", [0, -1, True, 4.0])
def test_max_context_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_context"):
        Options(max_context=bad)


def test_prompt_longer_than_max_context():
    with pytest.raises(ValueError, match="the prompt has 4 tokens but max_context is 3"):
        DecodeState.start([1, 2, 3, 4], Options(max_context=3))


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_top_logprobs_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="top_logprobs"):
        Options(top_logprobs=bad)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_tie_margin_must_be_finite_non_negative(bad):
    with pytest.raises(ValueError, match="tie_margin"):
        Options(tie_margin=bad)


def test_tie_margin_accepts_ints_and_numpy_floats():
    assert Options(tie_margin=1).tie_margin == 1
    assert Options(tie_margin=np.float32(0.25)).tie_margin == pytest.approx(0.25)


def test_draft_longer_than_the_budget():
    s = start(Options(max_tokens=3))
    with pytest.raises(ValueError, match="a draft of 3 tokens exceeds this step's budget of 2"):
        step(s, onehot(1), stack([1, 2, 3]), (1, 2, 3))
    with pytest.raises(ValueError, match="exceeds this step's budget of 2"):
        step_from_picks(s, [1, 2, 3, 4], (1, 2, 3), vocab_size=V)
    with pytest.raises(ValueError, match="exceeds this step's budget of 2"):
        check_draft(s, (1, 2, 3), V)
    assert check_draft(s, [np.int64(1), 2], V) == (1, 2)


def test_stepping_a_finished_state():
    s, _, _ = run(start(Options(max_tokens=1)), [4])
    assert s.finished
    with pytest.raises(ValueError, match="already finished"):
        run(s, [4])
    with pytest.raises(ValueError, match="already finished"):
        step_from_picks(s, [4], (), vocab_size=V)
    with pytest.raises(ValueError, match="already finished"):
        check_draft(s, (), V)


def test_step_from_picks_argument_checks():
    s = start()
    with pytest.raises(ValueError, match=r"picks must hold K \+ 1 = 3 ids, got 2"):
        step_from_picks(s, [1, 2], (1, 2), vocab_size=V)
    with pytest.raises(ValueError, match="margins must hold 2 values, got 1"):
        step_from_picks(s, [1, 2], (1,), margins=[1.0], vocab_size=V)
    with pytest.raises(ValueError, match="picks"):
        step_from_picks(s, [-1], (), vocab_size=V)
    with pytest.raises(ValueError, match="draft"):
        step_from_picks(s, [1, 2], (-4,), vocab_size=V)


# --------------------------------------------------------------------------------------------------------------
# Options converters, Stats, FinishReason


def test_options_defaults():
    o = Options()
    assert o.max_tokens == 128
    assert o.eos_token_ids == frozenset()
    assert o.stop_token_sequences == ()
    assert o.stop_strings == ()
    assert o.max_context is None
    assert o.top_logprobs == 0
    assert o.tie_margin == 0.0


def test_options_single_eos_id():
    assert Options(eos_token_ids=2).eos_token_ids == frozenset({2})
    assert Options(eos_token_ids=np.int64(7)).eos_token_ids == frozenset({7})
    assert Options(eos_token_ids=0).eos_token_ids == frozenset({0})


def test_options_eos_list_becomes_frozenset():
    o = Options(eos_token_ids=[2, 3, 2])
    assert o.eos_token_ids == frozenset({2, 3})
    assert isinstance(o.eos_token_ids, frozenset)
    assert Options(eos_token_ids=None).eos_token_ids == frozenset()


def test_options_single_stop_string():
    assert Options(stop="END").stop_strings == ("END",)
    assert Options(stop=None).stop_strings == ()


def test_options_stop_lists_become_tuples():
    o = Options(stop=["a", [1, 2], "bc", (3,), np.array([4, 5])])
    assert o.stop_strings == ("a", "bc")
    assert o.stop_token_sequences == ((1, 2), (3,), (4, 5))
    assert all(type(t) is int for seq in o.stop_token_sequences for t in seq)
    assert Options(stop=None).stop_token_sequences == ()


def test_options_are_frozen_and_comparable():
    o = Options(eos_token_ids=[1], stop=["x"])
    assert o == Options(eos_token_ids={1}, stop=("x",))
    with pytest.raises(AttributeError):
        o.max_tokens = 3  # type: ignore[misc]


def test_stats_acceptance_rate():
    assert Stats().acceptance_rate == 0.0
    assert Stats(proposed_tokens=4, accepted_tokens=3).acceptance_rate == 0.75


def test_finish_reason_str():
    assert str(FinishReason.EOS_TOKEN) == "eos_token"
    assert FinishReason("context_full") is FinishReason.CONTEXT_FULL
    assert FinishReason.MAX_TOKENS == "max_tokens"


def test_finish_reason_in_openai_words():
    assert FinishReason.EOS_TOKEN.openai == FinishReason.STOP_SEQUENCE.openai == "stop"
    assert FinishReason.MAX_TOKENS.openai == FinishReason.CONTEXT_FULL.openai == "length"


def test_a_cached_prefix_is_reused_up_to_all_but_the_last_prompt_token_and_only_before_the_prompt_pass():
    from ortspec.core.prefix import common_prefix_length, resident_tokens, reuse_score, reusing

    state = DecodeState.start([A, B, C], Options(max_tokens=3), cached_prefix=9)
    assert state.cached_prefix == 2  # the last prompt token is always run: its row picks the first token
    assert reusing(state, 1).cached_prefix == 1 and reusing(state, 0).cached_prefix == 0
    with pytest.raises(ValueError, match="cached_prefix"):
        reusing(state, -1)
    logits = np.zeros(V, np.float32)
    logits[D] = 1.0
    stepped = step(state, logits, None, ()).state
    with pytest.raises(ValueError, match="prompt pass has run"):
        reusing(stepped, 1)
    assert resident_tokens(stepped, 99) == (A, B, C) and resident_tokens(stepped, 2) == (A, B)
    assert common_prefix_length([A, B, C], [A, B, D]) == 2 and reuse_score([A, B, C], [A, B, D]) == 1
    assert reuse_score((), [A]) == 0 and reuse_score([B, B], [A]) == -2
