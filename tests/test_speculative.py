"""What ``speculative`` means (``core/speculative.py``): the one factory maps each name to its proposer and width
policy, and every surface (the library, the command line, the server's request options, batch records) reaches
it with the same name and gets the same proposer."""

from __future__ import annotations

import attrs
import pytest

from ortspec.core import (
    CostAwareWidth,
    DraftRule,
    FixedWidth,
    LookupOrDraft,
    PromptLookup,
    SuffixProposer,
)
from ortspec.core.checks import ArgumentError
from ortspec.core.speculative import (
    DEFAULT_SPECULATIVE,
    SPECULATIVE_CHOICES,
    Prices,
    Sources,
    needs_prices,
    speculation,
    speculative_value,
)
from ortspec.core.width import TreeBudget

PRICES = Prices((1.0, 1.1, 1.2, 1.3, 1.5), draft_cost=0.2, draft_model_cost=0.3, draft_model_read_cost=0.05)
TREE = TreeBudget(PRICES.pass_costs)  # what sizes a lookup's tree drafts


class Drafter:
    max_draft = 3

    def propose(self, draft_context):
        return ()


def test_each_name_is_its_proposer_and_width_policy():
    drafter = Drafter()
    with_drafter, without = Sources(drafter=drafter, drafter_max_draft=drafter.max_draft), Sources()
    assert speculation(None, "auto", without) == (None, 1)
    assert speculation(None, 4, without) == (None, 4)
    lookup, width = speculation("prompt-lookup", "auto", without, PRICES)
    assert isinstance(lookup, PromptLookup) and width == CostAwareWidth(PRICES.pass_costs)
    suffix, width = speculation("suffix", 5, without)
    assert isinstance(suffix, SuffixProposer) and width == 5
    alone, width = speculation("auto", "auto", without, PRICES)  # no drafter: the suffix lookup alone
    assert isinstance(alone, SuffixProposer) and width == CostAwareWidth(PRICES.pass_costs)
    auto, width = speculation("auto", "auto", with_drafter, PRICES)
    assert isinstance(auto, LookupOrDraft) and auto.drafter is drafter and isinstance(auto.lookup, SuffixProposer)
    assert width == FixedWidth(len(PRICES.pass_costs) - 1)  # the request's width only caps each source's policy
    assert auto.drafter_policy == CostAwareWidth(PRICES.pass_costs[:4], draft_cost=0.2)  # up to its widest draft
    assert auto.lookup_policy == CostAwareWidth(PRICES.pass_costs)  # the lookup drafts chains: no tree budget
    capped, width = speculation("auto", 2, with_drafter, PRICES)
    assert isinstance(capped, LookupOrDraft) and capped.drafter_policy is not None and width == FixedWidth(2)
    head, width = speculation("shared-kv", "auto", with_drafter, PRICES)
    assert head is drafter and width == CostAwareWidth(PRICES.pass_costs[:4], draft_cost=0.2)
    own = PromptLookup(ngram=2)
    assert speculation(own, 3, without) == (own, 3)
    draft_model = Drafter()
    with_model = Sources(draft_model=draft_model, draft_model_max_draft=2, context_tokens=40)
    model, width = speculation("draft-model", "auto", with_model, PRICES)  # priced at its own step, to its widest
    # and at its read of the request's context, all of it unread at the start
    priced = CostAwareWidth(PRICES.pass_costs[:3], draft_cost=0.3, read_cost=0.05, unread=40)
    assert model is draft_model and width == priced
    assert speculation("draft-model", 4, with_model) == (draft_model, 4)
    auto, _ = speculation("auto", "auto", with_model, PRICES)  # the suffix lookup or the draft model
    assert isinstance(auto, LookupOrDraft) and auto.drafter is None and auto.draft_model is draft_model
    assert auto.draft_model_policy == priced
    both = attrs.evolve(with_model, drafter=drafter, drafter_max_draft=drafter.max_draft)
    auto, _ = speculation("auto", "auto", both, PRICES)  # all three sources, each priced at its own step
    assert auto.drafter is drafter and auto.draft_model is draft_model
    assert auto.drafter_policy == CostAwareWidth(PRICES.pass_costs[:4], draft_cost=0.2)
    assert auto.draft_model_policy == priced


def test_bad_names_and_missing_sources_are_refused_naming_speculative():
    for bad in ("medusa", "", 3, object()):
        with pytest.raises(ArgumentError) as info:
            speculation(bad, "auto", Sources(), PRICES)
        assert info.value.argument == "speculative"
    with pytest.raises(ArgumentError, match="needs a drafter"):
        speculation("shared-kv", "auto", Sources(), PRICES)
    with pytest.raises(ArgumentError, match="needs a draft model") as info:
        speculation("draft-model", "auto", Sources(drafter=Drafter()), PRICES)
    assert info.value.argument == "speculative"
    with pytest.raises(ValueError, match="Prices"):
        speculation("prompt-lookup", "auto", Sources())


def test_when_prices_are_needed_and_the_one_default():
    assert not needs_prices(None, "auto") and needs_prices("suffix", "auto") and not needs_prices("suffix", 4)
    assert needs_prices("auto", 4)  # each of auto's sources is priced, whatever the width
    assert DEFAULT_SPECULATIVE in SPECULATIVE_CHOICES and speculative_value("none") is None


# -- every surface reaches the same proposer for the same name ------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("onnx")
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import BackendConfig
    from tests.support.drafters import make_random_drafter

    drafter_dir = make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter") / "d", seed=1, draft_vocab=300)
    # the target's own folder as its draft model: the same vocabulary
    config = BackendConfig(threads=1)
    return Engine.from_dir(tiny_model_dir, config, drafter=drafter_dir, draft_model=tiny_model_dir, batch_slots=2)


def _kind(engine, request) -> tuple[str, bool]:
    """What a request drafts with, as the scheduler submits it: the proposer's class name, and whether it reads the
    target's state in its sequence's slot (``reads_target_state``: it drafts with the Engine's drafter)."""
    proposer = request.proposer
    return "none" if proposer is None else type(proposer).__name__, request.reads_target_state


def _library(engine, name):
    from ortspec.adapters.engine.options import GenerationOptions

    return engine.request("a b a b", GenerationOptions(speculative=name, max_tokens=4))


def _command_line(engine, name):
    from ortspec.adapters.cli.engine_args import generation_kwargs, speculative
    from ortspec.adapters.cli.main import build_parser
    from ortspec.adapters.engine.options import GenerationOptions

    args = build_parser().parse_args(["generate", "a b a b", "--speculative", name, "--max-tokens", "4"])
    options = GenerationOptions(speculative=speculative(args), **generation_kwargs(args))
    return engine.request(args.prompt, options)


def _batch_record(engine, name):
    import json

    from ortspec.adapters.batch.records import option_fields, parse_record
    from ortspec.adapters.engine.options import GenerationOptions

    task = parse_record(
        json.dumps({"id": 1, "prompt": "a b a b", "speculative": name}), 1, {"max_tokens": 4}, option_fields()
    )
    return engine.request(task.prompt, GenerationOptions(**task.options))


EXPECTED = {
    "none": ("none", False),
    "prompt-lookup": ("PromptLookup", False),
    "suffix": ("SuffixProposer", False),
    "shared-kv": ("SlotDrafters", True),  # the batched Engine's drafter: it drafts in the slot its context names
    "auto": ("LookupOrDraft", True),
    "draft-model": ("DraftModelProposer", False),  # its own KV: it reads nothing of the target's slot
}


@pytest.mark.parametrize("surface", [_library, _command_line, _batch_record], ids=["library", "cli", "batch"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_surface_drafts_a_name_with_the_same_proposer(engine, surface, name):
    assert _kind(engine, surface(engine, name)) == EXPECTED[name]


def test_prompt_lookup_settings_on_the_command_line_need_prompt_lookup(engine):
    from ortspec.adapters.cli.engine_args import speculative
    from ortspec.adapters.cli.main import build_parser

    args = build_parser().parse_args(["generate", "x", "--speculative", "prompt-lookup", "--ngram", "2"])
    assert speculative(args) == PromptLookup(ngram=2, max_draft=16, min_ngram=1)
    args = build_parser().parse_args(["generate", "x", "--speculative", "suffix", "--ngram", "2"])
    with pytest.raises(ValueError, match="--ngram: prompt lookup's settings need --speculative prompt-lookup"):
        speculative(args)
    assert speculative(build_parser().parse_args(["generate", "x", "--speculative", "suffix"])) == "suffix"


def test_a_lookup_that_drafts_trees_gets_a_tree_budget_and_one_that_drafts_chains_none():
    branching = Sources(rule=DraftRule(branches=3))
    lookup, width = speculation("suffix", "auto", branching, PRICES)
    assert isinstance(lookup, SuffixProposer) and width == CostAwareWidth(PRICES.pass_costs, tree=TREE)
    drafter = Drafter()
    with_drafter = Sources(rule=DraftRule(branches=3), drafter=drafter, drafter_max_draft=drafter.max_draft)
    auto, _ = speculation("auto", "auto", with_drafter, PRICES)
    assert isinstance(auto, LookupOrDraft) and auto.lookup_policy.tree == TREE
    _, chain_width = speculation("prompt-lookup", "auto", Sources(), PRICES)
    assert isinstance(chain_width, CostAwareWidth) and chain_width.tree is None
