"""``ortspec train-drafter``: train a shared-KV draft head for a target model folder, on this machine, from data
made on this machine, and write it as a drafter folder (``ortspec.backends.onnx.drafter``'s contract).

The recipe (docs/drafter.md has the reasons and the numbers):

1. **Data** (:mod:`ortspec.adapters.tools.drafter_data`): chat prompts built from local text, continued greedily by the
   target's own ONNX graph in batches, keeping per position its final hidden state, its greedy pick, the residual
   stream entering the drafter's layer L (the target's last layer by default) and layer L's keys and values.
2. **Draft vocabulary**: the ``draft_vocab`` target ids the target picks most often in that data (ties broken by
   id, i.e. by BPE merge rank), so a draft step's LM head has ``draft_vocab`` columns, not the target's vocabulary.
3. **Initialisation**: the head's attention, MLP and norms are copies of the target's layer L and final norm; its
   LM head is the target's (tied) embedding rows of the draft vocabulary (kept frozen); its input projection
   ``fc`` is a ridge regression from ``(rms(embedding of token p), rms(hidden state at p - 1))`` to the residual
   stream entering layer L at p, the input the copied layer gets in the target (the fit's R^2 is in the record:
   ``ridge_init``). The head reads layer L's KV alone (query-only, no KV of its own).
4. **Training** (torch, CPU; :mod:`ortspec.adapters.tools.drafter_training`): teacher-forced tokens, the head's own
   projected state fed back for ``steps`` steps from every position at once (step k at query position p reads token
   p + k and predicts the target's pick there, attending to layer L's KV of positions < p only, as at inference),
   cross-entropy on the draft vocabulary plus a regression of the projected state on the target's hidden state;
   AdamW, cosine decay over a fixed number of updates; the held-out acceptance measured every ``eval_every``.
5. **Export**: the weights go into the ONNX graph of :mod:`ortspec.adapters.tools.drafter_graph`; the exported graph is
   checked against the torch head on held-out positions.

The run is set by counts and a seed (:class:`~ortspec.adapters.tools.drafter_recipe.TrainConfig`), not by the clock;
the record (``training`` in ``drafter.json``) holds the settings, what was reached, and apart, under ``timing``,
what the clock said (seconds, load average), the only part that differs between two runs of the same recipe.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ortspec.adapters.engine.cache import drafter_dir
from ortspec.adapters.engine.folders import replace_folder
from ortspec.adapters.engine.target_tables import TargetTables
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.tools.drafter_data import TargetRunner, TargetSequence, collect
from ortspec.adapters.tools.drafter_estimate import estimate_cost
from ortspec.adapters.tools.drafter_graph import (
    DrafterSpec,
    HeadWeights,
    quantize_weights,
    write_drafter_folder,
)
from ortspec.adapters.tools.drafter_head import recipe_head
from ortspec.adapters.tools.drafter_recipe import TrainConfig
from ortspec.adapters.tools.drafter_training import TrainingRun, TrainingSet, train_head
from ortspec.backends.onnx import ModelFolder
from ortspec.backends.onnx.drafter_support import LayerPlan, layer_plan
from ortspec.backends.onnx.fingerprint import target_fingerprint

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
    ridge * tr(X^T X) / 2H * |fc|^2`` over every position p >= 1 of ``sequences``, and the fit's R^2 (``h``: the
    final hidden state, a hidden row's first H values)."""
    hidden = embedding.shape[1]
    gram = np.zeros((2 * hidden + 1, 2 * hidden + 1), np.float64)
    cross = np.zeros((2 * hidden + 1, hidden), np.float64)
    total = 0
    sum_y = np.zeros(hidden)
    sum_y2 = np.zeros(hidden)
    for s in sequences:
        x = np.concatenate(
            [
                _rms(embedding[s.tokens[1:]], eps),
                _rms(s.hidden[:-1, :hidden], eps),
                np.ones((len(s) - 1, 1), np.float32),
            ],
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
    tables: TargetTables, plan: LayerPlan, draft_ids: np.ndarray, fc: np.ndarray, fc_bias: np.ndarray
) -> HeadWeights:
    """The head as initialised (see the module docstring, step 3): the target's layer ``plan.layer`` as ``plan``
    reads it."""
    f = tables.folder

    def weight(role: str) -> np.ndarray | None:
        name = plan.weights.get(role)
        return None if name is None else np.asarray(tables.tensor(name), np.float32)

    embedding = tables.embedding()
    hidden = embedding.shape[1]
    qkv = weight("wqkv")
    assert qkv is not None  # layer_plan names every required weight
    return HeadWeights(
        heads=f.num_attention_heads,
        head_size=f.head_size,
        eps=tables.eps,
        norm_embed=np.ones(hidden),
        norm_hidden=np.ones(hidden),
        fc=fc,
        fc_bias=fc_bias,
        norm_attn=weight("norm_attn"),
        wq=np.ascontiguousarray(qkv[:, : f.num_attention_heads * f.head_size]),
        wo=weight("wo"),
        norm_mlp=weight("norm_mlp"),
        w_gate=weight("w_gate"),
        w_up=weight("w_up"),
        w_down=weight("w_down"),
        norm_out=tables.final_norm(),
        lm_head=np.ascontiguousarray(embedding[draft_ids].T),
        cos=tables.tensor(plan.cos).astype(np.float32),
        sin=tables.tensor(plan.sin).astype(np.float32),
        scale=plan.scale,
        softcap=plan.softcap,
        window=plan.window,
        residual_scale=plan.residual_scale,
        activation=plan.activation,
        q_norm=weight("q_norm"),
        norm_post_attn=weight("norm_post_attn"),
        norm_post_mlp=weight("norm_post_mlp"),
    )


# --------------------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------------------


def check_export(folder: Path, head, embedding, hold: Sequence[TargetSequence], to_draft, target: ModelFolder):
    """Run the exported graph (onnxruntime) and the torch head on the same inputs (held-out positions, teacher
    forced: token p, hidden row p - 1, KV < p; with fused features, the graph gets the folder's fuse of the row as the
    runtime computes it, the torch head the row) and return the largest logit difference and how often the picks
    agree."""
    import onnxruntime as ort
    import torch

    from ortspec.backends.onnx.drafter import DrafterFolder

    drafter = DrafterFolder.load(folder)
    session = ort.InferenceSession(str(drafter.model_path), providers=["CPUExecutionProvider"])
    keys_in, values_in = drafter.groups[0].input_names(target.num_kv_heads)
    worst, agree, total = 0.0, 0, 0
    for s in hold[:4]:
        for p in range(max(1, s.prompt_len), len(s), 17):
            row = s.hidden[p - 1]
            state = drafter.fusion.apply(row) if drafter.fusion is not None else row
            embeds = np.concatenate([embedding[s.tokens[p]], state])[None, None].astype(np.float32)
            feeds: dict[str, np.ndarray] = {"inputs_embeds": embeds, "position_ids": np.array([[p]], np.int64)}
            for h in range(target.num_kv_heads):
                feeds[keys_in[h]] = np.ascontiguousarray(s.keys[h : h + 1, :p][None])
                feeds[values_in[h]] = np.ascontiguousarray(s.values[h : h + 1, :p][None])
            logits = session.run([drafter.logits_name], feeds)[0][0, 0]
            with torch.no_grad():
                ref, _ = head(
                    torch.from_numpy(embeds[:, :, : drafter.hidden_size]),
                    torch.from_numpy(np.asarray(row, np.float32)[None, None]),
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
    """A trained head and what its export needs: the :class:`TrainingSet` it was trained and measured on and the
    draft vocabulary (``draft_ids``: the target id of each logits column)."""

    head: Any
    data: TrainingSet
    draft_ids: np.ndarray


def train_drafter(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    config: TrainConfig | None = None,
    *,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Train a drafter for the target folder ``model_dir`` (which must have the ``hidden_states`` output) by the
    recipe ``config`` and write it to ``out_dir`` (default ``ortspec.adapters.engine.cache.drafter_dir``), replacing
    what is there only once the new folder is complete. Returns the folder. The record of the run is
    ``ortspec.training`` in its ``drafter.json``. Sets torch's thread count for this process (``config.threads``,
    default: torch's own) and its seed."""
    import torch

    cfg = config or TrainConfig()
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    target = ModelFolder.load(model_dir)
    layer = target.num_layers - 1 if cfg.layer is None else cfg.layer
    if not 1 <= layer < target.num_layers:
        raise ValueError(f"layer must be in [1, {target.num_layers}), got {layer}")
    if any(f >= target.num_layers for f in cfg.feature_layers):
        raise ValueError(f"feature_layers must be in [1, {target.num_layers}), got {list(cfg.feature_layers)}")
    plan = layer_plan(target, layer)  # DrafterSupportError before anything is collected
    dest = Path(out_dir) if out_dir is not None else drafter_dir(target.path)
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    bound = None if cfg.minutes is None else 60.0 * cfg.minutes
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    say(
        f"train-drafter: target {target.path}, layer {layer}, {cfg.sequences} sequences ({cfg.heldout} held out), "
        f"{cfg.updates} updates of {cfg.train_batch}, seed {cfg.seed}, {threads} threads"
        + (f", safety bound {cfg.minutes:g} min" if bound is not None else "")
    )
    runner = TargetRunner(target, layer, threads=threads, features=cfg.feature_layers)
    say(estimate_cost(runner, plan, cfg, Tokenizer.from_folder(target.path)).line())
    torch.manual_seed(cfg.seed)  # the probe drew from torch's generator
    deadline = None if bound is None else t_start + bound * cfg.data_share
    sequences = collect(target, layer, cfg, threads=threads, deadline=deadline, progress=say, runner=runner)
    del runner
    t_data = time.perf_counter() - t_start
    order = np.random.default_rng(cfg.seed).permutation(len(sequences))
    held = min(cfg.heldout, len(sequences) - 1)
    hold = [sequences[i] for i in np.sort(order[:held])]
    train = [sequences[i] for i in np.sort(order[held:])]
    if not train or not hold:
        raise ValueError("the safety bound left too few sequences to train on; raise --minutes or drop it")
    deadline = None if bound is None else t_start + bound - (60.0 + 0.02 * bound)  # the export's reserve
    fitted, results, run = _fit(target, layer, train, hold, cfg, deadline, say)
    t_train = time.perf_counter() - t_start - t_data

    record = {
        "recipe": "ortspec.adapters.tools.train_drafter (docs/drafter.md)",
        "config": attrs.asdict(cfg),
        "target_layer": layer,
        "threads": threads,
        "data": {
            "sequences": len(sequences),
            "train_sequences": len(train),
            "heldout_sequences": len(hold),
            "positions": int(sum(len(s) for s in sequences)),
            "generated_positions": int(sum(len(s) - s.prompt_len for s in sequences)),
        },
        **results,
        "timing": {
            "data_seconds": round(t_data, 1),
            "train_seconds": round(t_train, 1),
            "curve_seconds": run.seconds,
            "load_average_at_start": load_before,
        },
    }
    _export(dest, fitted, target, layer, cfg, record, t_start)
    export_check, timing = record["export_check"], record["timing"]
    checks = [(name, export_check[name]) for name in ("fp32", "int8") if name in export_check] or [
        ("fp32", export_check)
    ]
    say(
        f"train-drafter: wrote {dest} in {timing['total_seconds']:.0f} s, load average {timing['load_average_at_end']}"
        " (export check, picks agreeing with the torch head: "
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
    deadline: float | None,
    say: Callable[[str], None],
) -> tuple[_Fitted, dict[str, Any], TrainingRun]:
    """Rank the draft vocabulary on ``train``, initialise the head (ridge ``fc``, the target's layer ``layer``),
    train it for ``cfg.updates`` updates (stopping early only past ``deadline``, a ``time.perf_counter()`` value),
    measuring it on ``hold`` as it goes. Returns the head with what its export needs, the record's entries about
    the fit and the run."""
    import torch

    tables = TargetTables(target)
    embedding = tables.embedding()
    draft_ids = rank_vocabulary(train, target.vocab_size, cfg.draft_vocab)
    to_draft = np.full(target.vocab_size, -1, np.int64)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    generated = np.concatenate([s.labels[s.prompt_len :] for s in hold]) if hold else np.zeros(0, np.int64)
    coverage = float(np.isin(generated, draft_ids).mean()) if len(generated) else None
    fc, fc_bias, fit = ridge_fc(train, embedding, tables.eps, cfg.ridge)
    weights = initial_weights(tables, layer_plan(target, layer), draft_ids, fc, fc_bias)
    head = recipe_head(weights, target.num_kv_heads, cfg.feature_layers, tables.eps)
    table = torch.from_numpy(np.ascontiguousarray(embedding))
    data = TrainingSet(
        embedding=table, to_draft=to_draft, to_target=torch.from_numpy(draft_ids), train=train, hold=hold
    )
    say(f"init: ridge R^2 {fit['r2']:.3f}")
    run = train_head(head, data, cfg, deadline, say)
    results = {
        "draft_vocab": {"size": len(draft_ids), "heldout_coverage_of_target_picks": coverage},
        "ridge_init": fit,
        "updates": run.updates,
        "cut_short_by_safety_bound": run.cut_short,
        "heldout_before_training": run.heldout[0],
        "heldout_after_training": run.heldout[-1],
        "heldout_curve": run.heldout,
        "curve": run.curve,
    }
    return _Fitted(head, data, draft_ids), results, run


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
    positions (and, with int8 weights, the quantized graph too), complete ``record`` (``export_check``; under
    ``timing``, ``total_seconds`` since ``t_start`` and the load average at the end) in its ``drafter.json``, then
    replace ``dest`` with it."""
    import shutil
    import tempfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    spec = DrafterSpec(
        layer=layer,
        kv_heads=target.num_kv_heads,
        num_speculative_tokens=cfg.num_speculative_tokens,
        verifier={"name_or_path": target.path.name, "architectures": ["llama"]},
        extra={"target": target_fingerprint(target.path), "stop_below": cfg.stop_below, "training": record},
    )
    head, embedding, hold, to_draft = fitted.head, fitted.data.embedding.numpy(), fitted.data.hold, fitted.data.to_draft
    try:
        fusion = head.fusion() if cfg.feature_layers else None
        write_drafter_folder(
            staged, head.weights(), spec, embedding=embedding, draft_to_target=fitted.draft_ids, fusion=fusion
        )
        export_check = check_export(staged, head, embedding, hold, to_draft, target)
        if cfg.weights == "int8":
            # the float32 graph must equal the torch head; the int8 one is then measured against it
            export_check = {"fp32": export_check, **quantize_weights(staged)}
            export_check["int8"] = check_export(staged, head, embedding, hold, to_draft, target)
        record["export_check"] = export_check
        record["timing"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
        record["timing"]["load_average_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        meta_path = staged / "drafter.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        meta["ortspec"]["training"] = record
        meta_path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        replace_folder(staged, dest)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
