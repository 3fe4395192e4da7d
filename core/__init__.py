"""The pure core: decoding rules, proposers and width policies. No I/O, no devices."""

from .proposers import PromptLookup, Proposer
from .state import (
    Commit,
    DecodeState,
    FinishReason,
    Options,
    Stats,
    TokenLogprob,
    check_draft,
    draft_budget,
    step,
    step_ids,
)
from .width import AdditiveWidth, CostAwareWidth, FixedWidth, WidthPolicy

__all__ = [
    "AdditiveWidth",
    "CostAwareWidth",
    "Commit",
    "DecodeState",
    "FinishReason",
    "FixedWidth",
    "Options",
    "PromptLookup",
    "Proposer",
    "Stats",
    "TokenLogprob",
    "WidthPolicy",
    "check_draft",
    "draft_budget",
    "step",
    "step_ids",
]
