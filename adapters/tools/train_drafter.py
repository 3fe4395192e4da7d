"""``ortspec train-drafter``: train a shared-KV draft head for a target model folder, on this machine, from data
made on this machine, and write it as a drafter folder (``ortspec.backends.onnx.drafter``'s contract).

The recipe (docs/drafter.md has the reasons and the numbers):

1. **Data** (:mod:`ortspec.adapters.tools.drafter_data`): chat prompts built from local text, continued greedily by the
   target's own ONNX graph in batches, keeping per position its final hidden state, its greedy pick, the residual
   stream entering the drafter's layer L (the target's last layer by default) and layer L's keys and values.
2. **Draft vocabulary**: the ``draft_vocab`` target ids the target picks most often in that data (ties broken by
   id, i.e. by BPE merge rank), so a draft step's LM head is a few percent of the target's.
3. **Initialisation**: the head's attention, MLP and norms are copies of the target's layer L and final norm; its
   LM head is the target's (tied) embedding rows of the draft vocabulary (kept frozen); its input projection
   ``fc`` is a ridge regression from ``(rms(embedding of token p), rms(hidden state at p - 1))`` to the residual
   stream entering layer L at p. With the true residual, the copied layer reading layer L's KV alone (query-only,
   no KV of its own) reproduces the target's pick most of the time; the regression is what the head must learn.
4. **Training** (torch, CPU): teacher-forced tokens, the head's own projected state fed back for ``steps`` steps
   from every position at once (step k at query position p reads token p + k and predicts the target's pick
   there, attending to layer L's KV of positions < p only, as at inference), cross-entropy on the draft vocabulary
   plus a regression of the projected state on the target's hidden state; AdamW, cosine decay over a time budget.
5. **Export**: the weights go into the ONNX graph of :mod:`ortspec.adapters.tools.drafter_graph`; the exported graph is
   checked against the torch head on held-out positions.

Everything is bounded by ``minutes`` (data ``data_share`` of it, the rest training), so the command ends on time
whatever the machine's load; the record (``training`` in ``drafter.json``) says what it reached.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ortspec.adapters.engine.cache import drafter_dir
from ortspec.adapters.tools.drafter_data import TargetSequence, collect
from ortspec.adapters.tools.drafter_graph import (
    WEIGHT_FORMATS,
    DrafterSpec,
    HeadWeights,
    quantize_weights,
    write_drafter_folder,
)
from ortspec.adapters.tools.drafter_head import torch_head
from ortspec.adapters.tools.folders import replace_folder
from ortspec.adapters.tools.target_tables import TargetTables
from ortspec.backends.onnx import ModelFolder
from ortspec.backends.onnx.drafter import target_fingerprint


@attrs.frozen(kw_only=True)
class TrainConfig:
    """One training run's settings. ``minutes``: the whole budget (data + training + export); ``data_share``: its
    part for data; ``layer``: the target layer read (None: the last); ``draft_vocab``: the head's output ids;
    ``steps``: recurrent steps trained; ``batch``: prompts per target batch; ``max_new``: tokens generated per
    prompt; ``train_batch``: sequences per optimisation step; ``lr``: the peak learning rate (``fc``; the copied
    layer gets ``lr * copied_lr_scale``); ``state_loss``: weight of the projected-state regression; ``step_decay``:
    step k's loss weight is ``step_decay ** k``; ``prompt_weight``: loss weight of positions inside the prompt
    (the drafter drafts only after it); ``holdout``: share of sequences kept for evaluation; ``weights``: how the
    exported graph stores its MatMul weights (``int8``, default: a quarter of the bytes a draft step reads;
    ``fp32``: the trained values as they are)."""

    minutes: float = 30.0
    data_share: float = 0.4
    layer: int | None = None
    draft_vocab: int = 8192
    steps: int = 3
    batch: int = 16
    max_new: int = 160
    train_batch: int = 8
    lr: float = 1e-3
    copied_lr_scale: float = 0.3
    weight_decay: float = 0.01
    state_loss: float = 0.1
    step_decay: float = 0.7
    prompt_weight: float = 0.3
    ridge: float = 1e-2
    holdout: float = 0.08
    num_speculative_tokens: int = 4
    seed: int = 0
    threads: int | None = None
    weights: str = attrs.field(default="int8", validator=attrs.validators.in_(WEIGHT_FORMATS))


# --------------------------------------------------------------------------------------------------------------
# Draft vocabulary and initial weights
# --------------------------------------------------------------------------------------------------------------


def rank_vocabulary(sequences: Sequence[TargetSequence], vocab: int, size: int) -> np.ndarray:
    """The ``size`` target ids picked most often in ``sequences`` (generated positions count 1, prompt positions
    0.25), ties broken by the lower id; int64 ``[min(size, vocab)]``."""
    counts = np.zeros(vocab, np.float64)
    for s in sequences:
        start = max(s.prompt_len - 1, 0)
        np.add.at(counts, s.labels[start:], 1.0)
        np.add.at(counts, s.labels[:start], 0.25)
    order = np.lexsort((np.arange(vocab), -counts))  # most picked first, then by id
    return order[: min(size, vocab)].astype(np.int64)


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def ridge_fc(
    sequences: Sequence[TargetSequence], embedding: np.ndarray, eps: float, ridge: float
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """``fc`` ``[2H, H]`` and ``fc_bias`` ``[H]`` minimising ``|[rms(E[t_p]), rms(h_{p-1})] @ fc + b - r_p|^2 +
    ridge * tr(X^T X) / 2H * |fc|^2`` over every position p >= 1 of ``sequences``, and the fit's R^2."""
    hidden = embedding.shape[1]
    gram = np.zeros((2 * hidden + 1, 2 * hidden + 1), np.float64)
    cross = np.zeros((2 * hidden + 1, hidden), np.float64)
    total = 0
    sum_y = np.zeros(hidden)
    sum_y2 = np.zeros(hidden)
    for s in sequences:
        x = np.concatenate(
            [_rms(embedding[s.tokens[1:]], eps), _rms(s.hidden[:-1], eps), np.ones((len(s) - 1, 1), np.float32)],
            axis=1,
        ).astype(np.float64)
        y = s.residual[1:].astype(np.float64)
        gram += x.T @ x
        cross += x.T @ y
        total += len(y)
        sum_y += y.sum(0)
        sum_y2 += (y * y).sum(0)
    penalty = ridge * np.trace(gram[:-1, :-1]) / (2 * hidden)
    regularised = gram + penalty * np.diag([1.0] * (2 * hidden) + [0.0])
    solution = np.linalg.solve(regularised, cross)
    residual_ss = float(np.einsum("ij,ij->", solution, gram @ solution) - 2 * np.einsum("ij,ij->", solution, cross))
    residual_ss += float(sum_y2.sum())
    total_ss = float((sum_y2 - sum_y**2 / max(total, 1)).sum())
    fit = {"positions": float(total), "r2": 1.0 - residual_ss / total_ss if total_ss > 0 else 0.0}
    return solution[:-1].astype(np.float32), solution[-1].astype(np.float32), fit


def initial_weights(
    tables: TargetTables, layer: int, draft_ids: np.ndarray, fc: np.ndarray, fc_bias: np.ndarray
) -> HeadWeights:
    """The head as initialised (see the module docstring, step 3)."""
    f = tables.folder
    target_layer = tables.layer(layer)
    cos, sin = tables.rope()
    embedding = tables.embedding()
    hidden = embedding.shape[1]
    return HeadWeights(
        heads=f.num_attention_heads,
        head_size=f.head_size,
        eps=tables.eps,
        norm_embed=np.ones(hidden),
        norm_hidden=np.ones(hidden),
        fc=fc,
        fc_bias=fc_bias,
        norm_attn=target_layer.norm_attn,
        wq=target_layer.wq,
        wo=target_layer.wo,
        norm_mlp=target_layer.norm_mlp,
        w_gate=target_layer.w_gate,
        w_up=target_layer.w_up,
        w_down=target_layer.w_down,
        norm_out=tables.final_norm(),
        lm_head=np.ascontiguousarray(embedding[draft_ids].T),
        cos=cos,
        sin=sin,
    )


# --------------------------------------------------------------------------------------------------------------
# The batches the torch head (drafter_head.py) trains on
# --------------------------------------------------------------------------------------------------------------

TRAINED = ("norm_embed", "norm_hidden", "fc", "fc_bias")  # at lr; the copied layer's parameters at a scaled lr


@attrs.frozen(eq=False)
class Batch:
    """Sequences padded to one length N (torch tensors): ``tokens``/``labels`` (draft ids, -1 outside the draft
    vocabulary) ``[B, N]``, ``hidden`` ``[B, N, H]``, ``keys``/``values`` ``[B, kv_heads, N, D]``, ``weight``
    ``[B, N]`` (0 past a sequence's end, ``prompt_weight`` for the prompt's positions)."""

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
    [B, N-1], target hidden [B, N-1, H])``, positions where p + k runs past the sequence having weight 0."""
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
        out.append((logits, state, batch.labels[:, index], weight, batch.hidden[:, index]))
        picks = logits.argmax(-1)
    return out


def step_losses(head, embedding, batch: Batch, cfg: TrainConfig):
    """The training loss of ``batch`` (see the module docstring, step 4) and per-step top-1 accuracies on the
    weighted positions."""
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


def evaluate(head, embedding, to_target, sequences: Sequence[TargetSequence], to_draft, steps: int) -> dict[str, Any]:
    """Acceptance on ``sequences`` as the driver would see it, at every position p after the prompt: the head
    drafts ``steps`` tokens chained on its own picks from (token p, hidden p - 1); a draft is accepted up to its
    first pick that differs from the target's greedy continuation. Returns ``top1`` (the first pick's accuracy),
    ``accepted_by_width`` (mean tokens accepted from drafts of width k = 1..steps), ``acceptance_by_width``
    (accepted / drafted) and ``positions``."""
    import torch

    accepted = np.zeros(steps)
    count = 0
    with torch.no_grad():
        for start in range(0, len(sequences), 8):
            chunk = sequences[start : start + 8]
            batch = Batch.of(chunk, to_draft, 0.0)  # prompt positions weigh 0: only generated text is scored
            run = unroll(head, embedding, batch, steps, own_picks=True, to_target=to_target)
            alive = run[0][3] > 0
            count += int(alive.sum())
            streak = alive.clone()
            for k, (logits, _, labels, weight, _) in enumerate(run):
                # an unknown label (outside the draft vocabulary, -1) never equals a pick
                streak = streak & (logits.argmax(-1) == labels) & (weight > 0)
                accepted[k] += float(streak.sum())
    first = accepted[0] / max(count, 1)
    by_width = [float(accepted[: k + 1].sum() / max(count, 1)) for k in range(steps)]
    return {
        "positions": count,
        "top1": float(first),
        "accepted_by_width": by_width,
        "acceptance_by_width": [a / (k + 1) for k, a in enumerate(by_width)],
    }


def train_head(
    head,
    embedding,
    train: Sequence[TargetSequence],
    to_draft: np.ndarray,
    cfg: TrainConfig,
    seconds: float,
    say: Callable[[str], None],
) -> list[dict[str, float]]:
    """AdamW on ``train`` until ``seconds`` have passed (cosine decay of the learning rate over that time, after
    a short warm-up); returns the curve: per logged interval the mean loss and per-step accuracies."""
    import torch

    rng = np.random.default_rng(cfg.seed)
    copied = [p for n, p in head.named_parameters() if n not in TRAINED]
    own = [p for n, p in head.named_parameters() if n in TRAINED]
    optimiser = torch.optim.AdamW(
        [{"params": own, "lr": cfg.lr}, {"params": copied, "lr": cfg.lr * cfg.copied_lr_scale}],
        weight_decay=cfg.weight_decay,
    )
    base = [g["lr"] for g in optimiser.param_groups]
    order = sorted(range(len(train)), key=lambda i: len(train[i]))  # batches of similar lengths pad little
    batches = [order[i : i + cfg.train_batch] for i in range(0, len(order), cfg.train_batch)]
    t0 = time.perf_counter()
    curve: list[dict[str, float]] = []
    window: list[tuple[float, list[float]]] = []
    done = 0
    epoch = 0
    while True:
        rng.shuffle(batches)
        for indices in batches:
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return curve
            fraction = elapsed / seconds
            scale = min(1.0, (done + 1) / 20) * 0.5 * (1 + math.cos(math.pi * fraction))
            for group, lr in zip(optimiser.param_groups, base, strict=True):
                group["lr"] = lr * scale
            loss, accuracies = step_losses(
                head, embedding, Batch.of([train[i] for i in indices], to_draft, cfg.prompt_weight), cfg
            )
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimiser.step()
            done += 1
            window.append((float(loss.detach()), accuracies))
            if len(window) == 10:
                point = {
                    "seconds": round(time.perf_counter() - t0, 1),
                    "updates": done,
                    "epoch": epoch,
                    "loss": round(float(np.mean([w[0] for w in window])), 4),
                    **{f"top1_step{k}": round(float(np.mean([w[1][k] for w in window])), 4) for k in range(cfg.steps)},
                }
                curve.append(point)
                say(
                    f"train: {point['seconds']:.0f} s, {done} updates (epoch {epoch}), loss {point['loss']:.3f}, "
                    + ", ".join(f"step {k} top-1 {point[f'top1_step{k}']:.3f}" for k in range(cfg.steps))
                )
                window = []
        epoch += 1


# --------------------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------------------


def check_export(folder: Path, head, embedding, hold: Sequence[TargetSequence], to_draft, target: ModelFolder):
    """Run the exported graph (onnxruntime) and the torch head on the same inputs (held-out positions, teacher
    forced: token p, hidden p - 1, KV < p) and return the largest logit difference and how often the picks agree."""
    import onnxruntime as ort
    import torch

    from ortspec.backends.onnx.drafter import DrafterFolder

    drafter = DrafterFolder.load(folder)
    session = ort.InferenceSession(str(drafter.model_path), providers=["CPUExecutionProvider"])
    keys_in, values_in = drafter.groups[0].input_names(target.num_kv_heads)
    worst, agree, total = 0.0, 0, 0
    for s in hold[:4]:
        for p in range(max(1, s.prompt_len), len(s), 17):
            embeds = np.concatenate([embedding[s.tokens[p]], s.hidden[p - 1]])[None, None].astype(np.float32)
            feeds: dict[str, np.ndarray] = {"inputs_embeds": embeds, "position_ids": np.array([[p]], np.int64)}
            for h in range(target.num_kv_heads):
                feeds[keys_in[h]] = np.ascontiguousarray(s.keys[h : h + 1, :p][None])
                feeds[values_in[h]] = np.ascontiguousarray(s.values[h : h + 1, :p][None])
            logits = session.run([drafter.logits_name], feeds)[0][0, 0]
            with torch.no_grad():
                ref, _ = head(
                    torch.from_numpy(embeds[:, :, : drafter.hidden_size]),
                    torch.from_numpy(embeds[:, :, drafter.hidden_size :]),
                    torch.tensor([[p]]),
                    torch.from_numpy(s.keys[None, :, :p]),
                    torch.from_numpy(s.values[None, :, :p]),
                    torch.ones(1, 1, p, dtype=torch.bool),
                )
            ref = ref[0, 0].numpy()
            worst = max(worst, float(np.abs(logits - ref).max()))
            agree += int(np.argmax(logits) == np.argmax(ref))
            total += 1
    return {"max_logit_diff": worst, "picks_agree": agree, "checked": total}


@attrs.frozen(eq=False)
class _Fitted:
    """A trained head and what its export needs: the target's input-embedding table ``[V, H]``, the draft vocabulary
    (``draft_ids``: the target id of each logits column), ``to_draft`` (target id -> draft index, -1 outside it) and
    the held-out sequences the export is checked on."""

    head: Any
    embedding: np.ndarray
    draft_ids: np.ndarray
    to_draft: np.ndarray
    hold: list[TargetSequence]


def train_drafter(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    config: TrainConfig | None = None,
    *,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Train a drafter for the target folder ``model_dir`` (which must have the ``hidden_states`` output) and write
    it to ``out_dir`` (default ``ortspec.adapters.engine.cache.drafter_dir``), replacing what is there only once the new
    folder is complete. Returns the folder. The record of the run is ``ortspec.training`` in its ``drafter.json``.
    Sets torch's thread count for this process (``config.threads``, default: torch's own) and its seed."""
    import torch

    cfg = config or TrainConfig()
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    target = ModelFolder.load(model_dir)
    layer = target.num_layers - 1 if cfg.layer is None else cfg.layer
    if not 1 <= layer < target.num_layers:
        raise ValueError(f"layer must be in [1, {target.num_layers}), got {layer}")
    dest = Path(out_dir) if out_dir is not None else drafter_dir(target.path)
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    budget = 60.0 * cfg.minutes
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    say(f"train-drafter: target {target.path}, layer {layer}, budget {cfg.minutes:g} min")
    sequences = collect(
        target,
        layer,
        seconds=budget * cfg.data_share,
        batch=cfg.batch,
        max_new=cfg.max_new,
        seed=cfg.seed,
        threads=threads,
        progress=say,
    )
    t_data = time.perf_counter() - t_start
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(sequences))
    held = max(1, int(round(cfg.holdout * len(sequences))))
    hold = [sequences[i] for i in order[:held]]
    train = [sequences[i] for i in order[held:]]
    if not train:
        raise ValueError("the data budget produced too few sequences to train on; give train-drafter more minutes")
    export_reserve = 60.0 + 0.02 * budget
    fitted, results = _fit(target, layer, train, hold, cfg, t_start + budget - export_reserve, say)
    t_train = time.perf_counter() - t_start - t_data

    record = {
        "recipe": "ortspec.adapters.tools.train_drafter (docs/drafter.md)",
        "config": attrs.asdict(cfg),
        "target_layer": layer,
        "data": {
            "sequences": len(sequences),
            "train_sequences": len(train),
            "heldout_sequences": len(hold),
            "positions": int(sum(len(s) for s in sequences)),
            "generated_positions": int(sum(len(s) - s.prompt_len for s in sequences)),
            "seconds": round(t_data, 1),
        },
        **results,
        "train_seconds": round(t_train, 1),
        "threads": threads,
        "load_average_at_start": load_before,
    }
    _export(dest, fitted, target, layer, cfg, record, t_start)
    export_check, total_seconds = record["export_check"], record["total_seconds"]
    checks = [(name, export_check[name]) for name in ("fp32", "int8") if name in export_check] or [
        ("fp32", export_check)
    ]
    say(
        f"train-drafter: wrote {dest} in {total_seconds:.0f} s (export check, picks agreeing with the torch head: "
        + "; ".join(
            f"{name} {c['picks_agree']}/{c['checked']}, max logit difference {c['max_logit_diff']:.2g}"
            for name, c in checks
        )
        + ")"
    )
    return dest


def _fit(
    target: ModelFolder,
    layer: int,
    train: list[TargetSequence],
    hold: list[TargetSequence],
    cfg: TrainConfig,
    deadline: float,
    say: Callable[[str], None],
) -> tuple[_Fitted, dict[str, Any]]:
    """Rank the draft vocabulary on ``train``, initialise the head (ridge ``fc``, the target's layer ``layer``),
    train it until ``deadline`` (a ``time.perf_counter()`` value), and evaluate it on ``hold`` before and after.
    Returns the head with what its export needs, and the record's entries about the fit."""
    import torch

    tables = TargetTables(target)
    embedding = tables.embedding()
    draft_ids = rank_vocabulary(train, target.vocab_size, cfg.draft_vocab)
    to_draft = np.full(target.vocab_size, -1, np.int64)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    generated = np.concatenate([s.labels[s.prompt_len :] for s in hold]) if hold else np.zeros(0, np.int64)
    coverage = float(np.isin(generated, draft_ids).mean()) if len(generated) else None
    fc, fc_bias, fit = ridge_fc(train, embedding, tables.eps, cfg.ridge)
    weights = initial_weights(tables, layer, draft_ids, fc, fc_bias)
    head = torch_head(weights, target.num_kv_heads)
    table = torch.from_numpy(np.ascontiguousarray(embedding))
    to_target = torch.from_numpy(draft_ids)
    width = cfg.num_speculative_tokens
    before = evaluate(head, table, to_target, hold, to_draft, width)
    say(f"init: ridge R^2 {fit['r2']:.3f}; held-out top-1 {before['top1']:.3f}, accepted {before['accepted_by_width']}")

    seconds = max(0.0, deadline - time.perf_counter())
    curve = train_head(head, table, train, to_draft, cfg, seconds, say) if seconds > 0 else []
    after = evaluate(head, table, to_target, hold, to_draft, width)
    say(f"trained: held-out top-1 {after['top1']:.3f}, accepted by width {after['accepted_by_width']}")
    results = {
        "draft_vocab": {"size": len(draft_ids), "heldout_coverage_of_target_picks": coverage},
        "ridge_init": fit,
        "heldout_before_training": before,
        "heldout_after_training": after,
        "curve": curve,
    }
    return _Fitted(head, embedding, draft_ids, to_draft, hold), results


def _export(
    dest: Path,
    fitted: _Fitted,
    target: ModelFolder,
    layer: int,
    cfg: TrainConfig,
    record: dict[str, Any],
    t_start: float,
) -> None:
    """Write the drafter folder beside ``dest``, check the exported graph against the torch head on the held-out
    positions (and, with int8 weights, the quantized graph too), complete ``record`` (``export_check``,
    ``total_seconds`` since ``t_start``) in its ``drafter.json``, then replace ``dest`` with it."""
    import shutil
    import tempfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    spec = DrafterSpec(
        layer=layer,
        kv_heads=target.num_kv_heads,
        num_speculative_tokens=cfg.num_speculative_tokens,
        verifier={"name_or_path": target.path.name, "architectures": ["llama"]},
        extra={"target": target_fingerprint(target.path), "training": record},
    )
    head, embedding, hold, to_draft = fitted.head, fitted.embedding, fitted.hold, fitted.to_draft
    try:
        write_drafter_folder(staged, head.weights(), spec, embedding=embedding, draft_to_target=fitted.draft_ids)
        export_check = check_export(staged, head, embedding, hold, to_draft, target)
        if cfg.weights == "int8":
            # the float32 graph must equal the torch head; the int8 one is then measured against it
            export_check = {"fp32": export_check, **quantize_weights(staged)}
            export_check["int8"] = check_export(staged, head, embedding, hold, to_draft, target)
        record["export_check"] = export_check
        record["total_seconds"] = round(time.perf_counter() - t_start, 1)
        meta_path = staged / "drafter.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        meta["ortspec"]["training"] = record
        meta_path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        replace_folder(staged, dest)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
