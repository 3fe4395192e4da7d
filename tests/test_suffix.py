"""The suffix proposer's rules (core/suffix.py): longest match, counts, the draft-length rule, the snapshot's
memory cap and eviction, and snapshot isolation."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ortspec.core.proposers import DraftContext
from ortspec.core.suffix import SEPARATOR, DraftRule, SuffixProposer, SuffixSnapshot
from ortspec.core.tokens import Shared
from ortspec.core.tree import DraftTree


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # "1 2 3" was followed by 40 long ago; "9 3" (a 1-token match of the tail "... 2 3") more recently by 50
    context = [1, 2, 3, 40, 41, 7, 9, 3, 50, 51, 8, 1, 2, 3]
    draft, matched = SuffixProposer().match(context, 8)
    assert matched == 3
    assert draft[:2] == (40, 41)


def test_the_most_frequent_continuation_wins_over_the_most_recent():
    context = [5, 6, 70, 0, 5, 6, 70, 0, 5, 6, 70, 0, 5, 6, 80, 0, 5, 6]
    draft, matched = SuffixProposer(DraftRule(min_prob=0.5)).match(context, 1)
    assert draft == (70,)  # 3 of 4 occurrences of "0 5 6" went on with 70, the latest with 80


def test_the_path_stops_when_its_probability_drops_below_the_floor():
    # after "1 2": 3 then 4 (twice), 3 then 5 (twice): p(3) = 1, p(3 4) = 0.5
    context = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 5, 9, 1, 2]
    rule = DraftRule(anchor=2, max_match=2, spec_factor=8.0)
    assert SuffixProposer(attrs.evolve(rule, min_prob=0.6)).propose(DraftContext(context, 8)) == (3,)
    assert SuffixProposer(attrs.evolve(rule, min_prob=0.4)).propose(DraftContext(context, 8))[:2] in ((3, 4), (3, 5))


def test_the_draft_length_follows_the_match_length():
    context = [*range(100, 120), 1, 2, *range(100, 104)]  # the tail "100..103" matches 4 tokens (1 2 stops it)
    rule = DraftRule(spec_factor=1.5, max_draft=16)
    draft, matched = SuffixProposer(rule).match(context, 16)
    assert matched == 4
    assert draft == tuple(range(104, 110))  # floor(1.5 * 4) = 6 tokens
    assert SuffixProposer(rule).propose(DraftContext(context, 3)) == (104, 105, 106)  # and never past the width


SOURCE = list(range(100, 130))  # a 30-token stretch of the prompt, which the output copies with an edit


def test_after_an_edit_the_copy_resumes_where_it_was():
    # the output copied SOURCE[:8], wrote 7 (not SOURCE[8]: a rename), then SOURCE[9]; its tail matches 1 token
    context = [*SOURCE, 1, 2, 3, *SOURCE[:8], 7, SOURCE[9]]
    draft, matched = SuffixProposer().match(context, 16)
    assert matched == 8  # aligned by the 8 tokens before the edit
    assert draft == tuple(SOURCE[10:26])  # min(width, floor(2 * 8)) tokens of the copy after the edit
    plain, plain_matched = SuffixProposer(DraftRule(resync_back=0)).match(context, 16)
    assert plain_matched == 1 and plain == tuple(SOURCE[10:12])  # floor(2 * 1) tokens


def test_a_resync_needs_a_long_enough_match_before_the_edit_and_a_resumption_in_reach():
    short = [*SOURCE, 1, 2, 3, *SOURCE[3:8], 7, SOURCE[9]]  # 5 tokens copied before the edit: < resync_match
    assert SuffixProposer().match(short, 16)[1] == 1
    far = [*SOURCE, 1, 2, 3, *SOURCE[:8], 7, SOURCE[29]]  # the copy would resume 21 tokens on: past the reach
    assert SuffixProposer(DraftRule(resync_reach=8)).match(far, 16)[1] == 1
    draft, matched = SuffixProposer(DraftRule(resync_reach=32)).match(far, 16)
    assert matched == 8 and draft[:3] == (1, 2, 3)  # what followed SOURCE[29]
    edited_long_ago = [*SOURCE, 1, 2, 3, *SOURCE[:8], 7, 5, 6, 4, SOURCE[9]]  # the copy stopped 5 tokens back
    assert SuffixProposer(DraftRule(resync_back=4)).match(edited_long_ago, 16)[1] == 1
    assert SuffixProposer(DraftRule(resync_back=5)).match(edited_long_ago, 16) == (tuple(SOURCE[10:26]), 8)


def test_a_long_match_drafts_by_the_suffix_rule_not_the_resync():
    context = [*SOURCE, 1, 2, 3, *SOURCE[:12]]  # the tail itself matches 12 tokens
    draft, matched = SuffixProposer().match(context, 16)
    assert matched == 12 and draft == tuple(SOURCE[12:28])


def test_a_context_match_runs_on_into_its_own_draft():
    assert SuffixProposer().propose(DraftContext([7, 8, 7, 8, 7, 8], 6)) == (7, 8, 7, 8, 7, 8)


def test_no_draft_without_a_match_or_width():
    assert SuffixProposer().propose(DraftContext([1, 2, 3, 4], 8)) == ()
    assert SuffixProposer().propose(DraftContext([1, 2, 1, 2], 0)) == ()
    assert SuffixProposer().propose(DraftContext([], 4)) == ()


def test_the_snapshot_drafts_what_followed_in_earlier_documents():
    snapshot = SuffixSnapshot().with_document([11, 12, 13, 14, 15, 16])
    proposer = SuffixProposer(cache=snapshot)
    draft, matched = proposer.match([1, 2, 11, 12, 13], 8)
    assert matched == 3 and draft == (14, 15, 16)  # and stops at the document's end (its separator)
    assert SuffixProposer().propose(DraftContext([1, 2, 11, 12, 13], 8)) == ()


def test_no_match_crosses_a_document_boundary():
    snapshot = SuffixSnapshot().with_document([1, 2, 3]).with_document([4, 5, 6])
    assert SEPARATOR in snapshot.corpus
    draft, matched = SuffixProposer(cache=snapshot).match([9, 3, 4], 8)
    assert matched == 1 and draft == (5, 6)  # "3 4" never occurred: a separator lies between them


def test_the_memory_cap_evicts_the_oldest_documents():
    snapshot = SuffixSnapshot(max_tokens=40, keep=0.5)
    for i in range(20):
        snapshot = snapshot.with_document(range(100 * i, 100 * i + 5))
        assert len(snapshot) <= 40
        assert list(snapshot.corpus[-6:]) == [*range(100 * i, 100 * i + 5), SEPARATOR]
        assert snapshot.corpus[snapshot.starts[0]] % 100 == 0
        assert [snapshot.corpus[s - 1] for s in snapshot.starts[1:]] == [SEPARATOR] * (snapshot.documents - 1)
    assert snapshot.documents < 20


def test_a_document_over_the_cap_keeps_its_last_tokens():
    snapshot = SuffixSnapshot(max_tokens=10, keep=1.0).with_document([1, 2]).with_document(range(50))
    assert list(snapshot.corpus) == [*range(41, 50), SEPARATOR]
    assert snapshot.starts == (0,)


def test_a_snapshot_is_unchanged_by_what_is_added_after_it():
    context = [1, 2, 11, 12]
    old = SuffixSnapshot(max_tokens=30).with_document([11, 12, 13, 14])
    before = SuffixProposer(cache=old).propose(DraftContext(context, 8))
    new = old
    for _ in range(10):  # the same tail followed by something else, many times, then evictions
        new = new.with_document([11, 12, 99, 98])
    assert SuffixProposer(cache=old).propose(DraftContext(context, 8)) == before == (13, 14)
    assert list(old.corpus) == [11, 12, 13, 14, SEPARATOR]
    assert SuffixProposer(cache=new).propose(DraftContext(context, 8)) == (99, 98)


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="min_prob"):
        DraftRule(min_prob=1.5)
    with pytest.raises(ValueError, match="spec_factor"):
        DraftRule(spec_factor=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixSnapshot(max_tokens=1)


tokens = st.lists(st.integers(0, 5), max_size=60)


@settings(max_examples=60, deadline=None)
@given(tokens, st.lists(st.integers(0, 5), min_size=1, max_size=8), st.integers(1, 10))
def test_a_growing_shared_context_drafts_as_a_fresh_one(prefix, steps, width):
    """The index a ``Shared`` context carries (grown one step at a time) answers as one built from scratch."""
    shared = Shared([]).with_head(tuple(prefix))
    proposer = SuffixProposer(DraftRule(anchor=3, occurrences=4, levels=2))
    for token in steps:
        assert proposer.propose(DraftContext(shared, width)) == proposer.propose(DraftContext(tuple(shared), width))
        shared = shared.extended([token])


# -- the Engine's suffix cache (a tiny random model) ------------------------------------------------------------------

PROMPT = "the cat sat on the mat and then"


@pytest.fixture
def engine(tiny_model_dir):
    from ortspec import BackendConfig, Engine

    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


def test_an_engine_drafts_a_finished_output_for_the_next_request_and_outputs_stay_plain(engine):
    from ortspec.adapters.engine.suffix_cache import SuffixCache

    engine.suffix_cache = SuffixCache()  # a fresh one: earlier tests drafted from the Engine's own
    plain = engine.generate(PROMPT, max_tokens=24, ignore_eos=True, speculative=None)
    assert engine.suffix_cache.tokens == 0  # nothing is recorded before a request drafts by suffix
    first = engine.generate(PROMPT, max_tokens=24, ignore_eos=True, speculative="suffix", draft_width=8)
    assert engine.suffix_cache.tokens > len(first.token_ids)
    second = engine.generate(PROMPT, max_tokens=24, ignore_eos=True, speculative="suffix", draft_width=8)
    assert first.token_ids == second.token_ids == plain.token_ids
    assert second.stats.accepted_tokens >= 16  # the first one's output, drafted from the cache
    assert second.stats.steps < plain.stats.steps


def test_streams_and_batches_record_what_they_finished(engine):
    from ortspec.adapters.engine.suffix_cache import PROMPT_TAIL

    engine.suffix_cache.snapshot()  # recording on
    text = "".join(engine.stream(PROMPT, max_tokens=10, ignore_eos=True, speculative="suffix"))
    assert text == engine.generate(PROMPT, max_tokens=10, ignore_eos=True).text
    recorded = engine.suffix_cache.tokens
    assert recorded >= 10
    prompts = [PROMPT, "a b a b a b", "hello there"]
    many = engine.generate_many(prompts, max_tokens=9, ignore_eos=True, speculative="suffix", draft_width=4)
    assert [r.token_ids for r in many] == [engine.generate(p, max_tokens=9, ignore_eos=True).token_ids for p in prompts]
    assert engine.suffix_cache.tokens - recorded >= 3 * 9
    assert PROMPT_TAIL > 0


def test_an_unknown_speculative_name_lists_the_names(engine):
    from ortspec import ArgumentError

    with pytest.raises(ArgumentError, match="suffix"):
        engine.generate(PROMPT, max_tokens=2, speculative="suffixes")


def test_the_server_and_batch_offer_suffix():
    from ortspec.adapters.batch.records import record_options
    from ortspec.adapters.serve.settings import ServerSettings

    assert ServerSettings(model_name="m", speculative="suffix").speculative == "suffix"
    assert record_options({"speculative": "suffix"}, ["speculative"]) == {"speculative": "suffix"}
    with pytest.raises(ValueError, match="'suffix'"):  # the message lists every name
        record_options({"speculative": "suffixes"}, ["speculative"])


def test_the_cache_takes_outputs_from_many_threads_while_others_take_snapshots():
    import threading

    from ortspec.adapters.engine.suffix_cache import PROMPT_TAIL, SuffixCache

    cache = SuffixCache(max_tokens=100_000)
    first = cache.snapshot()
    start = threading.Barrier(8)
    snapshots = []

    def add(k: int) -> None:
        start.wait()
        for i in range(50):
            cache.add([1] * PROMPT_TAIL, [k, i, k, i])

    def take() -> None:
        start.wait()
        snapshots.extend(cache.snapshot() for _ in range(200))

    threads = [threading.Thread(target=add, args=(k,)) for k in range(6)]
    threads += [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = cache.snapshot()
    assert final.documents == 6 * 50 and len(final) == 6 * 50 * (PROMPT_TAIL + 4 + 1)
    assert len(first) == 0  # a snapshot is a value: what came later is not in it
    for s in snapshots:  # each one a consistent prefix of the final corpus
        assert list(s.corpus) == list(final.corpus[: len(s)])
        assert s.starts == final.starts[: s.documents]


def test_with_branches_and_a_node_budget_the_suffix_lookup_drafts_its_matches_continuations_as_a_tree():
    # (1, 2, 3) occurs three times before the end, followed by 9 9, 7 7 and 9 9; the longest match is the one
    # followed by 7 7 (preceded by 9 9 like the context's end)
    context = (1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3, 9, 9, 1, 2, 3)
    rule = DraftRule(branches=3, min_prob=0.0)
    chain = SuffixProposer(rule).propose(DraftContext(context, 2))
    assert (
        chain == (7, 7)
        and SuffixProposer(DraftRule(min_prob=0.0, branches=1)).propose(DraftContext(context, 2, nodes=4)) == chain
    )
    tree = SuffixProposer(rule).propose(DraftContext(context, 2, nodes=4))
    assert tree == DraftTree((7, 7, 9, 9), (-1, 0, -1, 2))  # the best path first, then the other continuation
    agreeing = (4, 5, 6, 4, 5, 6, 4, 5)  # every match continues alike: a chain
    assert SuffixProposer(rule).propose(DraftContext(agreeing, 3, nodes=9)) == (6, 4, 5)
