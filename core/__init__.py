"""The pure core: decoding rules, proposers and width policies. No I/O, no devices, no process state."""

from .constraint import Grammar, Matcher
from .declare import Bounds, OptionSpec, option, options_of, spec
from .forced import ForcedTokens
from .lookup_or_draft import LookupOrDraft
from .options import Limits, Options
from .proposers import MAX_DRAFT, DraftContext, Learner, NgramIndex, PromptLookup, Proposer
from .sampling import DraftPicker, Sampling
from .state import (
    Commit,
    DecodeState,
    FinishReason,
    Stats,
    StepOutcome,
    TokenLogprob,
    check_draft,
    check_prompt_fits,
    delivered,
    draft_budget,
    draft_width,
    step,
    step_from_picks,
    take_draft,
)
from .suffix import DraftRule, SuffixProposer, SuffixSnapshot
from .tree import DraftTree, tree_mask
from .width import (
    AdditiveWidth,
    CostAwareWidth,
    FixedWidth,
    PricedWidth,
    WidthPolicy,
    marginal_row_cost,
    mean_row_cost,
    pass_cost,
)

__all__ = [
    "MAX_DRAFT",
    "AdditiveWidth",
    "Bounds",
    "Commit",
    "CostAwareWidth",
    "DecodeState",
    "DraftContext",
    "DraftPicker",
    "DraftRule",
    "DraftTree",
    "FinishReason",
    "FixedWidth",
    "ForcedTokens",
    "Grammar",
    "Learner",
    "Limits",
    "LookupOrDraft",
    "Matcher",
    "NgramIndex",
    "OptionSpec",
    "Options",
    "PromptLookup",
    "Proposer",
    "Sampling",
    "Stats",
    "StepOutcome",
    "SuffixProposer",
    "SuffixSnapshot",
    "TokenLogprob",
    "PricedWidth",
    "WidthPolicy",
    "marginal_row_cost",
    "mean_row_cost",
    "pass_cost",
    "check_draft",
    "check_prompt_fits",
    "delivered",
    "draft_budget",
    "draft_width",
    "option",
    "options_of",
    "spec",
    "step",
    "step_from_picks",
    "take_draft",
    "tree_mask",
]
