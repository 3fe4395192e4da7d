"""``BackendConfig.hidden_features``: the residual streams entering chosen layers follow the final hidden state in
every hidden-state row (backends/onnx/graph_features.py), on each path a drafter reads them from (the default
binding with its kept positions, static shapes, a batch slot), and nothing else the graph computes changes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortspec.backends.base import BackendError
from ortspec.backends.onnx import BackendConfig, ModelFolder, OrtBackend
from ortspec.backends.onnx.batch import OrtBatchBackend
from ortspec.backends.onnx.graph_features import residual_output_name

TOL = 1e-4


def _reference(folder: Path, tokens: list[int], layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, final hidden states, residual stream entering ``layer``) at every position, from one plain run of
    the file with the residual added as an output."""
    import onnx
    import onnxruntime as ort

    mf = ModelFolder.load(folder)
    model = onnx.load(str(mf.model_path))
    name = residual_output_name(model, layer)
    model.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([tokens], np.int64), "attention_mask": np.ones((1, len(tokens)), np.int64)}
    for i in range(mf.num_layers):
        for past in (mf.past_key_pattern % i, mf.past_value_pattern % i):
            feeds[past] = np.zeros((1, mf.num_kv_heads, 0, mf.head_size), np.float32)
    logits, hidden, residual = sess.run([mf.logits_name, mf.hidden_states_name, name], feeds)
    return logits[0], hidden[0], residual[0]


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 384, size=n)]


@pytest.mark.parametrize("static", [False, True], ids=["kept-rows", "static-shapes"])
def test_hidden_rows_carry_the_residual_streams(tiny_model_dir, static):
    toks = _tokens(30, seed=3)
    ref_logits, ref_hidden, ref_residual = _reference(tiny_model_dir, toks, 1)
    cfg = BackendConfig(threads=1, prefill_chunk=8, hidden_features=(1,), static_shapes=static)
    b = OrtBackend.from_folder(tiny_model_dir, cfg)
    h = ref_hidden.shape[1]
    assert b.hidden_features == (1,) and b.hidden_size == 2 * h
    assert any("residual streams entering layers [1]" in r for r in b.rewrites)
    last = b.decode(toks[:20], 0).copy()
    row = np.asarray(b.hidden_row(19))
    assert row.shape == (2 * h,)
    assert np.abs(row[:h] - ref_hidden[19]).max() <= TOL and np.abs(row[h:] - ref_residual[19]).max() <= TOL
    rows = b.decode_verify(toks[20:], 20).copy()
    for p in (20, 25, 29):
        row = np.asarray(b.hidden_row(p))
        assert np.abs(row[:h] - ref_hidden[p]).max() <= TOL and np.abs(row[h:] - ref_residual[p]).max() <= TOL
    # the logits are what the file computes
    assert np.abs(last - ref_logits[19]).max() <= TOL and np.abs(rows - ref_logits[20:]).max() <= TOL


def test_a_batch_slot_carries_them_too(tiny_model_dir):
    toks = _tokens(24, seed=4)
    _, ref_hidden, ref_residual = _reference(tiny_model_dir, toks, 1)
    batch = OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, hidden_features=(1,)), slots=2)
    lone, target = batch.lone(), batch.slot_target(batch.slots)  # the lone slot, as a drafter reads it
    h = ref_hidden.shape[1]
    assert target.hidden_features == (1,) and target.hidden_size == 2 * h
    lone.decode(toks[:20], 0)
    lone.decode_verify(toks[20:], 20)
    for p in (20, 23):
        row = np.asarray(target.hidden_row(p))
        assert np.abs(row[:h] - ref_hidden[p]).max() <= TOL and np.abs(row[h:] - ref_residual[p]).max() <= TOL


def test_bad_feature_layers_are_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="feature layers must be distinct decoder layers >= 1"):
        BackendConfig(hidden_features=(0,))
    with pytest.raises(ValueError, match=r"feature layers must be distinct .*got \[1, 1\]"):
        BackendConfig(hidden_features=(1, 1))
    with pytest.raises(BackendError, match="layers.5/input_layernorm"):
        OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, hidden_features=(5,)))
