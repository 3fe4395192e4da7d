"""Training the shared-KV draft head in torch (step 4 of ``ortspec train-drafter``'s recipe, docs/drafter.md):
the padded batches, the head unrolled over its own projected state, the loss, the held-out acceptance, and the
optimiser loop, counted in updates (never in seconds, unless a safety bound cuts it short). torch is imported only
inside the functions."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from ortspec.adapters.tools.drafter_data import TargetSequence
from ortspec.adapters.tools.drafter_recipe import TrainConfig

# the copied target layer's parameters, trained at ``lr * copied_lr_scale``; every other parameter at ``lr``
COPIED = (
    "norm_attn",
    "wq",
    "wo",
    "norm_mlp",
    "w_gate",
    "w_up",
    "w_down",
    "norm_out",
    "q_norm",
    "norm_post_attn",
    "norm_post_mlp",
)
LOG_EVERY = 10  # updates per point of the training curve


@attrs.frozen(eq=False)
class TrainingSet:
    """What the head trains and is measured on: the target's input-embedding table ``embedding`` (torch ``[V, H]``),
    ``to_draft`` (numpy int64 ``[V]``: target id -> draft index, -1 outside the draft vocabulary), ``to_target``
    (torch int64 ``[V']``: draft index -> target id), the ``train`` sequences and the held-out ``hold`` ones."""

    embedding: Any
    to_draft: np.ndarray
    to_target: Any
    train: Sequence[TargetSequence]
    hold: Sequence[TargetSequence]


@attrs.frozen(eq=False)
class Batch:
    """Sequences padded to one length N (torch tensors): ``tokens``/``labels`` (draft ids, -1 outside the draft
    vocabulary) ``[B, N]``, ``hidden`` ``[B, N, H']`` (the final hidden state in its first H columns; a head whose
    first step reads more of the target's features, as docs/bench/fused-features.md measures, gets them after it),
    ``keys``/``values`` ``[B, kv_heads, N, D]``, ``weight`` ``[B, N]`` (0 past a sequence's end,
    ``prompt_weight`` for the prompt's positions)."""

    tokens: Any
    labels: Any
    hidden: Any
    keys: Any
    values: Any
    weight: Any

    @classmethod
    def of(cls, sequences: Sequence[TargetSequence], to_draft: np.ndarray, prompt_weight: float) -> Batch:
        import torch

        n = max(len(s) for s in sequences)
        b = len(sequences)
        kvh, _, size = sequences[0].keys.shape
        hidden = sequences[0].hidden.shape[1]
        tokens = np.zeros((b, n), np.int64)
        labels = np.full((b, n), -1, np.int64)
        hid = np.zeros((b, n, hidden), np.float32)
        keys = np.zeros((b, kvh, n, size), np.float32)
        values = np.zeros((b, kvh, n, size), np.float32)
        weight = np.zeros((b, n), np.float32)
        for i, s in enumerate(sequences):
            m = len(s)
            tokens[i, :m], labels[i, :m], hid[i, :m] = s.tokens, to_draft[s.labels], s.hidden
            keys[i, :, :m], values[i, :, :m] = s.keys, s.values
            weight[i, :m] = 1.0
            weight[i, : s.prompt_len] = prompt_weight  # the drafter is asked only from position prompt_len on
        return cls(*(torch.from_numpy(a) for a in (tokens, labels, hid, keys, values, weight)))


def unroll(head, embedding, batch: Batch, steps: int, *, own_picks: bool = False, to_target=None):
    """Run ``head`` for ``steps`` steps from every query position p in [1, N) at once. Step k reads token p + k
    (teacher-forced; with ``own_picks`` the head's own pick of step k - 1, mapped by ``to_target``) and the
    previous step's projected state (step 0: the target's hidden state at p - 1), at position p, attending to the
    KV of positions < p. Returns per step ``(logits [B, N-1, V'], state [B, N-1, H], labels [B, N-1], weight
    [B, N-1], target hidden [B, N-1, H])``, positions where p + k runs past the sequence having weight 0. The
    state regression's target is the final hidden state, the first H columns of ``batch.hidden``."""
    import torch

    b, n = batch.tokens.shape
    p = torch.arange(1, n)
    positions = p.expand(b, n - 1)
    allowed = (torch.arange(n)[None, :] < p[:, None]).expand(b, n - 1, n)
    state = batch.hidden[:, :-1]
    out = []
    picks = None
    for k in range(steps):
        index = (p + k).clamp(max=n - 1)
        tokens = batch.tokens[:, index]
        if own_picks and picks is not None:
            tokens = to_target[picks]
        logits, state = head(embedding[tokens], state, positions, batch.keys, batch.values, allowed)
        weight = batch.weight[:, index] * (p + k < n)
        out.append((logits, state, batch.labels[:, index], weight, batch.hidden[:, index, : state.shape[-1]]))
        picks = logits.argmax(-1)
    return out


def step_losses(head, embedding, batch: Batch, cfg: TrainConfig):
    """The training loss of ``batch`` (docs/drafter.md, step 4) and per-step top-1 accuracies on the weighted
    positions."""
    import torch
    from torch import nn

    total = torch.zeros(())
    accuracies = []
    for k, (logits, state, labels, weight, target) in enumerate(unroll(head, embedding, batch, cfg.steps)):
        known = labels >= 0
        w = weight * known
        ce = nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
        regress = nn.functional.smooth_l1_loss(state, target, reduction="none").mean(-1)
        denominator = weight.sum().clamp(min=1.0)
        loss = (ce * w).sum() / denominator + cfg.state_loss * (regress * weight).sum() / denominator
        total = total + cfg.step_decay**k * loss
        hits = ((logits.argmax(-1) == labels) & known).float()
        accuracies.append(float((hits * weight).sum() / denominator))
    return total, accuracies


def evaluate(head, data: TrainingSet, steps: int) -> dict[str, Any]:
    """Acceptance on ``data.hold`` as the driver would see it, at every position p after the prompt: the head
    drafts ``steps`` tokens chained on its own picks from (token p, hidden p - 1); a draft is accepted up to its
    first pick that differs from the target's greedy continuation. Returns ``top1`` (the first pick's accuracy),
    ``accepted_by_width`` (mean tokens accepted from drafts of width k = 1..steps), ``acceptance_by_width``
    (accepted / drafted) and ``positions``."""
    import torch

    accepted = np.zeros(steps)
    count = 0
    with torch.no_grad():
        for start in range(0, len(data.hold), 8):
            chunk = data.hold[start : start + 8]
            batch = Batch.of(chunk, data.to_draft, 0.0)  # prompt positions weigh 0: only generated text is scored
            run = unroll(head, data.embedding, batch, steps, own_picks=True, to_target=data.to_target)
            alive = run[0][3] > 0
            count += int(alive.sum())
            streak = alive.clone()
            for k, (logits, _, labels, weight, _) in enumerate(run):
                # an unknown label (outside the draft vocabulary, -1) never equals a pick
                streak = streak & (logits.argmax(-1) == labels) & (weight > 0)
                accepted[k] += float(streak.sum())
    first = accepted[0] / max(count, 1)
    by_width = [round(float(accepted[: k + 1].sum() / max(count, 1)), 4) for k in range(steps)]
    return {
        "positions": count,
        "top1": round(float(first), 4),
        "accepted_by_width": by_width,
        "acceptance_by_width": [round(a / (k + 1), 4) for k, a in enumerate(by_width)],
    }


@attrs.frozen
class TrainingRun:
    """What :func:`train_head` reached: ``updates`` done; ``curve`` (per ``LOG_EVERY`` updates: the mean loss and
    per-step teacher-forced top-1 on the training batches); ``heldout`` (per evaluation: ``updates`` and
    :func:`evaluate`'s result, the first at 0 updates, the last at the end); ``cut_short`` (the safety bound
    stopped it before ``updates``); ``seconds`` (the clock at each curve point, apart: it is not reproducible)."""

    updates: int
    curve: list[dict[str, float]]
    heldout: list[dict[str, Any]]
    cut_short: bool
    seconds: list[float]


def _learning_rate_scale(done: int, updates: int) -> float:
    """The learning rate's multiplier before update ``done`` (0-based) of ``updates``: a 20-update linear warm-up
    times a cosine decay from 1 to 0 over the run."""
    return min(1.0, (done + 1) / 20) * 0.5 * (1 + math.cos(math.pi * done / max(updates, 1)))


def train_head(head, data: TrainingSet, cfg: TrainConfig, deadline: float | None, say: Callable[[str], None]):
    """AdamW on ``data.train`` for ``cfg.updates`` updates (batches of similar lengths, their order shuffled each
    epoch by ``cfg.seed``), the held-out acceptance measured every ``cfg.eval_every`` updates and at the end;
    stops early only past ``deadline`` (a ``time.perf_counter()`` value, None: never). Returns a
    :class:`TrainingRun`."""
    import torch

    rng = np.random.default_rng(cfg.seed)
    named = list(head.named_parameters())  # a copied layer's parameter by its own name, wherever the head nests it
    copied = [p for n, p in named if n.rsplit(".", 1)[-1] in COPIED]
    own = [p for n, p in named if n.rsplit(".", 1)[-1] not in COPIED]
    optimiser = torch.optim.AdamW(
        [{"params": own, "lr": cfg.lr}, {"params": copied, "lr": cfg.lr * cfg.copied_lr_scale}],
        weight_decay=cfg.weight_decay,
    )
    base = [g["lr"] for g in optimiser.param_groups]
    train = data.train
    order = sorted(range(len(train)), key=lambda i: (len(train[i]), i))  # batches of similar lengths pad little
    batches = [order[i : i + cfg.train_batch] for i in range(0, len(order), cfg.train_batch)]
    width = cfg.num_speculative_tokens
    t0 = time.perf_counter()
    curve: list[dict[str, float]] = []
    seconds: list[float] = []
    heldout = [{"updates": 0, **evaluate(head, data, width)}]
    window: list[tuple[float, list[float]]] = []
    done = epoch = 0
    cut_short = False
    while done < cfg.updates and not cut_short:
        rng.shuffle(batches)
        for indices in batches[: cfg.updates - done]:
            if deadline is not None and time.perf_counter() >= deadline:
                cut_short = True
                break
            for group, lr in zip(optimiser.param_groups, base, strict=True):
                group["lr"] = lr * _learning_rate_scale(done, cfg.updates)
            batch = Batch.of([train[i] for i in indices], data.to_draft, cfg.prompt_weight)
            loss, accuracies = step_losses(head, data.embedding, batch, cfg)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimiser.step()
            done += 1
            window.append((float(loss.detach()), accuracies))
            if len(window) == LOG_EVERY:
                point = {
                    "updates": done,
                    "epoch": epoch,
                    "loss": round(float(np.mean([w[0] for w in window])), 4),
                    **{f"top1_step{k}": round(float(np.mean([w[1][k] for w in window])), 4) for k in range(cfg.steps)},
                }
                curve.append(point)
                seconds.append(round(time.perf_counter() - t0, 1))
                say(
                    f"train: {seconds[-1]:.0f} s, {done} updates (epoch {epoch}), loss {point['loss']:.3f}, "
                    + ", ".join(f"step {k} top-1 {point[f'top1_step{k}']:.3f}" for k in range(cfg.steps))
                )
                window = []
            if done % cfg.eval_every == 0 and done < cfg.updates:
                heldout.append({"updates": done, **evaluate(head, data, width)})
                _say_heldout(say, heldout[-1])
        epoch += 1
    heldout.append({"updates": done, **evaluate(head, data, width)})
    _say_heldout(say, heldout[-1])
    return TrainingRun(updates=done, curve=curve, heldout=heldout, cut_short=cut_short, seconds=seconds)


def _say_heldout(say: Callable[[str], None], point: dict[str, Any]) -> None:
    accepted = " / ".join(f"{a:.2f}" for a in point["accepted_by_width"])
    say(f"held out at {point['updates']} updates: top-1 {point['top1']:.3f}, accepted per draft {accepted}")
