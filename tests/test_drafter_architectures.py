"""``ortspec train-drafter`` on every architecture the builder writes (``tests.support.architectures``, fp32, with
hidden states): the head copies layer L faithfully (its layer, fed the target's residual stream and KV, gives the
target's final hidden state) on every architecture it serves; a representative few are trained by the tiny recipe
and speculate exactly; LFM2 (its last layer carries a convolution state) is refused before any data is collected,
by train-drafter, the CLI and the Engine; the cost estimate is printed; a drafter whose recorded fingerprint does
not fit the target is refused naming what differs."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")),
    reason="building the tiny models needs the convert extra: pip install 'ortspec[convert]'",
)

from ortspec.backends.onnx import BackendConfig, ModelFolder  # noqa: E402
from ortspec.backends.onnx.drafter import DrafterError, DrafterSupportError, drafter_support  # noqa: E402

SERVED = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "granite", "olmo", "smollm3",
          "granitemoehybrid"]  # fmt: skip
TRAINED = SERVED  # every one: QK norms, soft caps, sandwich norms, GELU, windows, residual multipliers
TINY_RECIPE = dict(
    sequences=12, heldout=4, batch=4, max_new=24, updates=6, eval_every=3, draft_vocab=200, steps=2, train_batch=4
)


@pytest.fixture(scope="session")
def arch_hs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("arch-hidden")


def _build(root: Path, arch: str) -> Path:
    from tests.support.architectures import make_tiny_arch_model

    return make_tiny_arch_model(root / f"{arch}-fp32", arch, "fp32", hidden_states=True)


def test_every_architecture_is_served_or_refused(arch_hs_root):
    from tests.support.architectures import ARCHITECTURES

    for arch in ARCHITECTURES:
        reason = drafter_support(ModelFolder.load(_build(arch_hs_root, arch)))
        assert (reason is None) == (arch in SERVED), (arch, reason)
    lfm2 = ModelFolder.load(_build(arch_hs_root, "lfm2"))
    assert "lfm2: layer 2 is a 'conv' layer: it carries a recurrent state, not a KV cache" in drafter_support(lfm2)
    assert "recurrent state" in drafter_support(lfm2, 1)  # its attention layer: the data step cannot run it
    assert drafter_support(lfm2, 1, training=False) is None  # a drafter may read it


@pytest.mark.parametrize("arch", SERVED)
def test_the_copied_layer_is_the_targets(arch_hs_root, arch):
    """The head's layer (initialised from layer L = the last) fed the residual stream entering layer L at p and
    layer L's KV of positions <= p gives the target's final hidden state at p."""
    import torch

    from ortspec.adapters.engine.target_tables import TargetTables
    from ortspec.adapters.tools.drafter_data import TargetRunner
    from ortspec.adapters.tools.drafter_head import torch_head
    from ortspec.adapters.tools.train_drafter import initial_weights
    from ortspec.backends.onnx.drafter_support import layer_plan

    folder = ModelFolder.load(_build(arch_hs_root, arch))
    layer = folder.num_layers - 1
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, folder.vocab_size, 30)]
    record = TargetRunner(folder, layer, threads=1).run([prompt], 20, eos=())[0]
    tables = TargetTables(folder)
    hidden = record.residual.shape[1]
    ids = np.arange(folder.vocab_size)
    weights = initial_weights(tables, layer_plan(folder), ids, np.zeros((2 * hidden, hidden)), np.zeros(hidden))
    head = torch_head(weights, folder.num_kv_heads)
    n = len(record)
    positions = torch.arange(n)[None]
    allowed = (torch.arange(n)[None, :] <= torch.arange(n)[:, None])[None]
    with torch.no_grad():
        state = head.layer(
            torch.from_numpy(record.residual)[None], positions,
            torch.from_numpy(record.keys)[None], torch.from_numpy(record.values)[None], allowed,
        )[0].numpy()  # fmt: skip
    np.testing.assert_allclose(state, record.hidden[:, :hidden], atol=2e-4, rtol=1e-3)


def _train(folder: Path, out: Path, progress=None, **overrides) -> Path:
    from ortspec.adapters.tools.drafter_recipe import TrainConfig
    from ortspec.adapters.tools.train_drafter import train_drafter

    config = TrainConfig(**{**TINY_RECIPE, "stop_below": 0.0, **overrides}, threads=1)
    return train_drafter(folder, out, config, progress=progress)


@pytest.mark.parametrize("arch", TRAINED)
def test_a_trained_drafter_speculates_exactly(arch_hs_root, tmp_path, arch):
    from ortspec.adapters.engine import Engine

    folder = _build(arch_hs_root, arch)
    said: list[str] = []
    drafter = _train(folder, tmp_path / "drafter", progress=said.append, weights="fp32")
    line = next(m for m in said if m.startswith("train-drafter: about "))
    minutes = float(re.match(r"train-drafter: about ([0-9.]+) minutes on this machine \(data ~", line).group(1))
    assert minutes > 0 and math.isfinite(minutes)
    assert said.index(line) < next(i for i, m in enumerate(said) if m.startswith("data: "))
    engine = Engine.from_dir(folder, BackendConfig(threads=1, max_length=256), drafter=drafter)
    for prompt in ("The quick brown fox jumps over the lazy dog.", "Return an iterator over the values"):
        plain = engine.generate(prompt, max_tokens=40, ignore_eos=True)
        spec = engine.generate(prompt, max_tokens=40, ignore_eos=True, speculative="shared-kv", draft_width=3)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.stats.proposed_tokens > 0


def test_a_refused_target_is_refused_before_any_data(arch_hs_root, tmp_path, monkeypatch, capsys):
    from ortspec.adapters.cli.main import main
    from ortspec.adapters.tools import drafter_data

    folder = _build(arch_hs_root, "lfm2")
    monkeypatch.setattr(drafter_data, "collect", lambda *a, **k: pytest.fail("data collected"))
    with pytest.raises(DrafterSupportError, match="layer 2 is a 'conv' layer"):
        _train(folder, tmp_path / "d")
    assert main(["train-drafter", "--model", str(folder), "--out", str(tmp_path / "d")]) != 0
    assert "layer 2 is a 'conv' layer" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_the_engine_refuses_a_drafter_for_a_layer_without_kv(arch_hs_root, tmp_path):
    from ortspec.adapters.engine import Engine
    from tests.support.drafters import make_random_drafter

    folder = _build(arch_hs_root, "lfm2")
    drafter = make_random_drafter(folder, tmp_path / "d", target_layer=2)
    with pytest.raises(DrafterError, match="layer 2 is a 'conv' layer.*reads layer L's KV"):
        Engine.from_dir(folder, BackendConfig(threads=1), drafter=drafter)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("vocab_size", 999, "vocabulary: 999 recorded, 384 here"),
        ("hidden_size", 96, "hidden size: 96 recorded, 64 here"),
        ("num_layers", 7, "layer count: 7 recorded, 2 here"),
    ],
)
def test_a_drafter_for_another_shape_is_refused_naming_it(tiny_model_dir, tmp_path, key, value, message):
    from ortspec.backends.onnx import OrtBackend
    from ortspec.backends.onnx.drafter import SharedKvProposer
    from ortspec.backends.onnx.fingerprint import target_fingerprint
    from tests.support.drafters import make_random_drafter

    drafter = make_random_drafter(tiny_model_dir, tmp_path / "d", seed=1)
    path = drafter / "drafter.json"
    meta = json.loads(path.read_text())
    meta.setdefault("ortspec", {})["target"] = {**target_fingerprint(tiny_model_dir), key: value}
    path.write_text(json.dumps(meta))
    backend = OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=64))
    with pytest.raises(DrafterError, match=f"made for another target .*{re.escape(message)}"):
        SharedKvProposer.open(backend, drafter)
    shutil.rmtree(drafter)
