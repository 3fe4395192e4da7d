"""What ``ortspec train-drafter`` will cost on this machine, from a short measured probe before the run: one batch
of the data step's target passes (a prefill and a few decode steps), one training update and one held-out
measurement at the recipe's sizes, and the export's graph build, each scaled by the recipe's counts. An estimate of
the run's order of magnitude, not a promise: sequences that end early at an EOS make the data step cheaper."""

from __future__ import annotations

import math
import time

import attrs
import numpy as np

from ortspec.adapters.engine.target_tables import TargetTables
from ortspec.adapters.tools.drafter_data import TargetRunner, TargetSequence, prompt_batches
from ortspec.adapters.tools.drafter_graph import build_head_graph
from ortspec.adapters.tools.drafter_recipe import TrainConfig
from ortspec.backends.onnx.drafter_support import LayerPlan

PROBE_STEPS = 4  # decode steps timed per probe batch


@attrs.frozen
class CostEstimate:
    """Seconds each part of a run is expected to take here: ``data``, ``training`` (the ridge fit, the updates and
    the held-out measurements), ``export``."""

    data: float
    training: float
    export: float

    @property
    def total(self) -> float:
        return self.data + self.training + self.export

    def line(self) -> str:
        """``train-drafter: about N minutes on this machine (data ~A, training ~B, export ~C)``."""
        parts = ", ".join(f"{name} ~{_minutes(s)}" for name, s in (("data", self.data), ("training", self.training),
                                                                    ("export", self.export)))  # fmt: skip
        return f"train-drafter: about {_minutes(self.total)} minutes on this machine ({parts})"


def _minutes(seconds: float) -> str:
    m = max(seconds / 60.0, 0.01)
    return f"{m:.0f}" if m >= 10 else f"{m:.1f}" if m >= 0.1 else f"{m:.2f}"


def estimate_cost(runner: TargetRunner, plan: LayerPlan, cfg: TrainConfig, tokenizer) -> CostEstimate:
    """Time the probe (module docstring) on ``runner`` (the data step's target) and the head copied by ``plan``, and
    scale it by ``cfg``'s counts. Sets nothing in torch beyond what the run sets (threads, seed)."""
    prompts = next(prompt_batches(tokenizer, cfg.batch, cfg.seed))
    start = time.perf_counter()
    runner.run(prompts, 1, eos=())
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    probe = runner.run(prompts, 1 + PROBE_STEPS, eos=())
    step = max(time.perf_counter() - start - prefill, 0.0) / PROBE_STEPS
    batches = math.ceil(cfg.sequences / cfg.batch)
    data = batches * (prefill + (cfg.max_new - 1) * step)
    length = len(prompts[0]) + cfg.max_new
    update, evaluation, export = _probe_head(runner, plan, cfg, probe[0], length)
    evaluations = math.ceil(cfg.updates / cfg.eval_every) + 1
    training = cfg.updates * update + evaluations * evaluation * math.ceil(cfg.heldout / cfg.train_batch)
    return CostEstimate(data=data, training=training, export=export)


def _probe_head(
    runner: TargetRunner, plan: LayerPlan, cfg: TrainConfig, like: TargetSequence, length: int
) -> tuple[float, float, float]:
    """Seconds of one training update, of one held-out measurement of ``cfg.train_batch`` sequences, and of the
    export's graph build (twice with int8 weights), on the head ``plan`` copies and synthetic sequences of
    ``length`` positions shaped like ``like``."""
    import torch

    from ortspec.adapters.tools.drafter_head import recipe_head
    from ortspec.adapters.tools.drafter_training import Batch, step_losses, unroll
    from ortspec.adapters.tools.train_drafter import initial_weights

    folder = runner.folder
    tables = TargetTables(folder)
    hidden = like.residual.shape[1]
    draft_ids = np.arange(min(cfg.draft_vocab, folder.vocab_size), dtype=np.int64)
    weights = initial_weights(tables, plan, draft_ids, np.zeros((2 * hidden, hidden)), np.zeros(hidden))
    head = recipe_head(weights, folder.num_kv_heads, cfg.feature_layers, tables.eps)
    rng = np.random.default_rng(cfg.seed)
    kv_shape = (folder.num_kv_heads, length, folder.head_size)
    sequence = TargetSequence(
        tokens=rng.integers(0, folder.vocab_size, length),
        prompt_len=len(like.tokens) - PROBE_STEPS,
        labels=rng.integers(0, folder.vocab_size, length),
        hidden=rng.standard_normal((length, like.hidden.shape[1])).astype(np.float32),
        residual=rng.standard_normal((length, hidden)).astype(np.float32),
        keys=rng.standard_normal(kv_shape).astype(np.float32),
        values=rng.standard_normal(kv_shape).astype(np.float32),
    )
    to_draft = np.full(folder.vocab_size, -1, np.int64)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    embedding = torch.from_numpy(np.ascontiguousarray(tables.embedding()))
    batch = Batch.of([sequence] * cfg.train_batch, to_draft, cfg.prompt_weight)
    optimiser = torch.optim.AdamW(head.parameters(), lr=0.0)
    start = time.perf_counter()
    loss, _ = step_losses(head, embedding, batch, cfg)
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()
    update = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        unroll(
            head, embedding, batch, cfg.num_speculative_tokens, own_picks=True, to_target=torch.from_numpy(draft_ids)
        )
    evaluation = time.perf_counter() - start
    start = time.perf_counter()
    build_head_graph(weights, folder.num_kv_heads).SerializeToString()
    export = (time.perf_counter() - start) * (2 if cfg.weights == "int8" else 1)
    return update, evaluation, export
