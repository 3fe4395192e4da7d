"""The recipe of ``ortspec train-drafter``: one run's settings as counts and a seed, never a time budget, so the same
command on the same kind of machine makes the same drafter (docs/drafter.md says what is bit-reproducible).

The defaults are the recipe of the drafter shipped with the package for SmolLM2-135M-Instruct
(``ortspec/drafters/``; its record is in its ``drafter.json`` and in docs/drafter.md)."""

from __future__ import annotations

import attrs

from ortspec.adapters.tools.drafter_graph import WEIGHT_FORMATS
from ortspec.backends.onnx.config import feature_layers
from ortspec.backends.onnx.drafter import check_stop_below

_positive = attrs.validators.gt(0)


@attrs.frozen(kw_only=True)
class TrainConfig:
    """One training run's settings.

    Data: ``sequences`` prompts continued by the target (``max_new`` new tokens at most each, ``batch`` prompts per
    target batch), of which ``heldout`` (chosen by ``seed``) are kept out of training to measure acceptance on.
    Training: ``updates`` optimiser updates of ``train_batch`` sequences each (the learning rate's cosine decay runs
    over them), the held-out acceptance measured every ``eval_every`` updates. ``seed`` fixes every random choice:
    the prompts and their order, the held-out split, the batch order (torch's generator is seeded too).

    ``minutes``: an optional safety bound (None: none, the default): data stops after ``data_share`` of it, training
    before the export's reserve; a run it cuts short says so in its record and no longer depends on the counts
    alone. ``threads``: onnxruntime's and torch's thread count (None: torch's default, recorded). ``layer``: the
    target layer read (None: the last); ``draft_vocab``: the head's output ids; ``steps``: recurrent steps trained;
    ``lr``: the peak learning rate (``fc``; the copied layer gets ``lr * copied_lr_scale``); ``state_loss``: weight
    of the projected-state regression; ``step_decay``: step k's loss weight is ``step_decay ** k``;
    ``prompt_weight``: loss weight of positions inside the prompt (the drafter drafts only after it);
    ``stop_below``: recorded in the drafter (``ortspec.stop_below``), the probability below which its head's pick is
    not drafted (its default chosen by measurement: docs/drafter.md, "Confidence stop"); ``weights``:
    how the exported graph stores its MatMul weights (``int8``, default: a quarter of the bytes a draft step reads;
    ``fp32``: the trained values as they are); ``feature_layers``: the target layers whose residual streams the
    head's first step reads too, through a trained fuse (EAGLE-3's fused features; empty: the final hidden state
    alone; docs/drafter.md)."""

    sequences: int = attrs.field(default=1536, validator=_positive)
    heldout: int = attrs.field(default=64, validator=_positive)
    max_new: int = attrs.field(default=160, validator=_positive)
    batch: int = attrs.field(default=16, validator=_positive)
    updates: int = attrs.field(default=1200, validator=attrs.validators.ge(0))
    train_batch: int = attrs.field(default=8, validator=_positive)
    eval_every: int = attrs.field(default=150, validator=_positive)
    seed: int = 0
    minutes: float | None = None
    data_share: float = 0.4
    threads: int | None = None
    layer: int | None = None
    draft_vocab: int = 8192
    steps: int = 3
    lr: float = 1e-3
    copied_lr_scale: float = 0.3
    weight_decay: float = 0.01
    state_loss: float = 0.1
    step_decay: float = 0.7
    prompt_weight: float = 0.3
    stop_below: float = attrs.field(default=0.2, validator=lambda _i, _a, value: check_stop_below(value))
    ridge: float = 1e-2
    num_speculative_tokens: int = 4
    weights: str = attrs.field(default="int8", validator=attrs.validators.in_(WEIGHT_FORMATS))
    feature_layers: tuple[int, ...] = attrs.field(default=(), converter=feature_layers)

    def __attrs_post_init__(self) -> None:
        if self.heldout >= self.sequences:
            raise ValueError(f"heldout ({self.heldout}) must be fewer than sequences ({self.sequences})")


def default(name: str):
    """The recipe's default for the field ``name`` (the command line's defaults are these)."""
    return getattr(attrs.fields(TrainConfig), name).default
