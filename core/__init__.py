"""The pure core: decoding rules, proposers and width policies. No I/O, no devices."""

from .proposers import LookupOrDraft, PromptLookup, Proposer
from .state import (
    Commit,
    DecodeState,
    FinishReason,
    Options,
    Stats,
    TokenLogprob,
    check_draft,
    delivered,
    draft_budget,
    step,
    step_from_picks,
)
from .width import AdditiveWidth, CostAwareWidth, FixedWidth, WidthPolicy

__all__ = [
    "AdditiveWidth",
    "CostAwareWidth",
    "Commit",
    "DecodeState",
    "FinishReason",
    "FixedWidth",
    "LookupOrDraft",
    "Options",
    "PromptLookup",
    "Proposer",
    "Stats",
    "TokenLogprob",
    "WidthPolicy",
    "check_draft",
    "delivered",
    "draft_budget",
    "step",
    "step_from_picks",
]
