"""Drafter folders for tests and benchmarks (not shipped): :func:`make_random_drafter` writes a shared-KV drafter
with random weights for a target folder through the product's writer (``ortspec.adapters.tools.drafter_graph``), so
the contract's wiring runs without a trained head."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ortspec.adapters.engine.target_tables import TargetTables
from ortspec.adapters.tools.drafter_graph import DrafterSpec, HeadWeights, write_drafter_folder
from ortspec.backends.onnx import ModelFolder
from ortspec.backends.onnx.drafter_folder import FeatureFusion
from ortspec.backends.onnx.fingerprint import target_fingerprint


def make_random_drafter(
    target: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    draft_vocab: int | None = None,
    intermediate: int | None = None,
    target_layer: int | None = None,
    num_speculative_tokens: int = 4,
    fused_layers: tuple[int, ...] = (),
) -> Path:
    """A drafter folder with random weights for the target folder ``target`` (the contract's wiring, not its
    quality: its drafts are mostly wrong). It reads the target's last layer (or ``target_layer``), predicts the first
    ``draft_vocab`` target ids (default: all; fewer makes a ``draft_to_target`` map of scattered ids, so the map is
    not the identity) and has an MLP of ``intermediate`` (default ``2 * hidden``); with ``fused_layers`` its first
    step reads those layers' residual streams too, through a random fuse. Same arguments, same folder. Returns
    ``out_dir``."""
    folder = ModelFolder.load(target)
    tables = TargetTables(folder)
    embedding = tables.embedding()
    vocab, hidden = embedding.shape
    cos, sin = tables.rope()
    heads, size = folder.num_attention_heads, folder.head_size
    inter = intermediate or 2 * hidden
    rng = np.random.default_rng(seed)

    def randn(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    if draft_vocab is None or draft_vocab >= vocab:
        mapping = None
        columns = vocab
    else:
        step = next(k for k in (7, 11, 13, 17, 19, 23) if np.gcd(k, vocab) == 1)
        mapping = (np.arange(draft_vocab, dtype=np.int64) * step + 3) % vocab  # distinct ids, not in order
        columns = draft_vocab
    weights = HeadWeights(
        heads=heads,
        head_size=size,
        eps=tables.eps,
        norm_embed=np.ones(hidden),
        norm_hidden=np.ones(hidden),
        fc=randn(2 * hidden, hidden, scale=1 / np.sqrt(2 * hidden)),
        fc_bias=np.zeros(hidden),
        norm_attn=np.ones(hidden),
        wq=randn(hidden, heads * size, scale=1 / np.sqrt(hidden)),
        wo=randn(heads * size, hidden, scale=1 / np.sqrt(heads * size)),
        norm_mlp=np.ones(hidden),
        w_gate=randn(hidden, inter, scale=1 / np.sqrt(hidden)),
        w_up=randn(hidden, inter, scale=1 / np.sqrt(hidden)),
        w_down=randn(inter, hidden, scale=1 / np.sqrt(inter)),
        norm_out=np.ones(hidden),
        lm_head=randn(hidden, columns, scale=3 / np.sqrt(hidden)),
        cos=cos,
        sin=sin,
    )
    spec = DrafterSpec(
        layer=folder.num_layers - 1 if target_layer is None else target_layer,
        kv_heads=folder.num_kv_heads,
        num_speculative_tokens=num_speculative_tokens,
        verifier={"name_or_path": folder.path.name},
        extra={"target": target_fingerprint(folder.path), "weights": f"random (seed {seed})"},
    )
    fusion = None
    if fused_layers:
        parts = 1 + len(fused_layers)
        fuse = randn(parts * hidden, hidden, scale=1 / np.sqrt(parts * hidden))
        fusion = FeatureFusion(tuple(fused_layers), tables.eps, fuse, randn(hidden, scale=0.1))
    return write_drafter_folder(out_dir, weights, spec, embedding=embedding, draft_to_target=mapping, fusion=fusion)
