"""bench/ceiling.py's perfect copier and perfect drafter count passes as their contracts say."""

from __future__ import annotations

from bench.ceiling import copy_passes, perfect_passes


def test_copier_drafts_the_longest_verbatim_continuation():
    # output[0] comes from the prompt's pass; then 1..5 is copied (5 drafts) and 7 is the pass's own pick
    assert copy_passes([], [1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 5, 7]) == [5]
    # nothing to copy: one token per pass
    assert copy_passes([], [1, 2], [7, 8, 9]) == [0, 0]


def test_copier_caps_drafts_and_never_drafts_the_last_token():
    prompt = list(range(40))
    assert copy_passes([], prompt, [99, *prompt], max_draft=16) == [16, 16, 5]


def test_copier_reads_earlier_texts_but_no_match_spans_two_of_them():
    # [2, 3] is not in any one text: only [2] is copied, 3 is the pass's pick, 4 the next pass's
    assert copy_passes([[1, 2], [3, 4]], [], [0, 2, 3, 4]) == [1, 0]
    # the output so far is visible too, up to the token before the pass
    assert copy_passes([], [], [5, 6, 5, 6, 5, 6, 0]) == [0, 2, 1]


def test_perfect_drafter():
    assert perfect_passes(41, max_draft=16) == [16, 16, 5]
    assert perfect_passes(1) == []
    assert perfect_passes(2) == [0]


def test_anchored_copier_continues_an_occurrence_of_the_token_before_the_draft():
    # 1, 2, 3 is in the prompt after 8, not after 0: the anchored copier drafts nothing after 0, then 2, 3 after 1
    prompt, output = [8, 1, 2, 3], [0, 1, 2, 3, 9]
    assert copy_passes([], prompt, output) == [3]
    assert copy_passes([], prompt, output, anchor=1) == [0, 2]
    assert copy_passes([], [0, 1, 2, 3], output, anchor=1) == [3]


def test_lookup_replay_verifies_each_draft_against_the_output():
    from bench.ceiling import lookup_passes
    from ortspec.core import PromptLookup

    # after the output's 1, prompt lookup drafts what followed the prompt's 1: 2, 3, 8, 9 (2 agree, then 7 is the
    # pass's own pick); nothing follows an earlier 7 (a plain pass); after 8 it drafts 9, cut to the one token left
    passes = lookup_passes(PromptLookup(ngram=1, max_draft=4), [5, 1, 2, 3, 8, 9], [1, 2, 3, 7, 8, 9, 0])
    assert passes == [4, 0, 1]
    # drafts are cut to the tokens left minus one, like the copier's
    assert lookup_passes(PromptLookup(ngram=1), [1, 2, 3, 4, 5], [1, 2, 3]) == [1]


def test_tree_replay_follows_the_branch_the_output_takes_and_counts_its_nodes():
    from bench.ceiling import lookup_passes
    from ortspec.core import DraftRule, PromptLookup, SuffixProposer

    # after the output's 6 1, the prompt holds two continuations of 1: "2 3 9" (the most recent) and "4 5 9"; the
    # output takes the older one. The chain drafts "2 3" and misses (its pass commits only 4), then "5 9 1" after
    # "1 4"; the tree verifies both (6 nodes) in one pass and commits 4 5 and the pass's own 0. The 8s repeat.
    prompt, output = [1, 4, 5, 9, 1, 2, 3, 9], [6, 1, 4, 5, 0, 8, 8, 8, 8, 8]
    assert lookup_passes(SuffixProposer(DraftRule(branches=1)), prompt, output, max_draft=3) == [0, 2, 3, 0, 0, 2]
    tree = lookup_passes(SuffixProposer(DraftRule(branches=3)), prompt, output, 3, nodes=6)
    assert tree == [0, 6, 0, 0, 2]
    # a proposer without trees is replayed as its chains are
    lookup = PromptLookup(ngram=1, max_draft=4)
    prompt, output = [5, 1, 2, 3, 8, 9], [1, 2, 3, 7, 8, 9, 0]
    assert lookup_passes(lookup, prompt, output, 4, nodes=8) == lookup_passes(lookup, prompt, output, 4)
