"""A shared-KV drafter with fused features (EAGLE-3's: its first step reads the final hidden state and the residual
streams entering chosen target layers, through a fuse): its folder's validation, its drafts against an independent
numpy reference on the target's live hidden rows and KV, the target it refuses, and the Engine opening the target
with those streams, speculative output equal to plain, alone and batched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from ortspec.adapters.tools.drafter_graph import DRAFTER_METADATA, FUSED_FEATURES  # noqa: E402
from ortspec.backends.onnx import BackendConfig, OrtBackend  # noqa: E402
from ortspec.backends.onnx.drafter import DrafterError, DrafterFolder, SharedKvProposer  # noqa: E402
from ortspec.core import DraftContext  # noqa: E402
from tests.support.drafters import make_random_drafter  # noqa: E402


@pytest.fixture(scope="module")
def fused_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("fused") / "d", seed=3, fused_layers=(1,))


@pytest.fixture(scope="module")
def plain_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("plain") / "d", seed=3)


def _backend(tiny_model_dir, features=(1,)) -> OrtBackend:
    return OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=128, hidden_features=features))


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 384, n)]


def _reference_fuse(folder: Path, row: np.ndarray) -> np.ndarray:
    """The folder's fuse applied to a hidden row in float64, read from the files (no ortspec code)."""
    meta = json.loads((folder / DRAFTER_METADATA).read_text())["speculative"]
    hidden, fused = meta["backbone_hidden_size"], meta["fused_features"]
    parts = 1 + len(fused["layers"])
    table = np.fromfile(folder / fused["file"], "<f4").astype(np.float64).reshape(parts * hidden + 1, hidden)
    x = row.astype(np.float64).reshape(parts, hidden)
    x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + fused["eps"])
    return x.reshape(-1) @ table[:-1] + table[-1]


def test_the_first_step_reads_the_fused_row(tiny_model_dir, fused_dir, plain_dir):
    """The fused drafter's draft is the plain head's draft from the fused state: both heads have the same weights
    (same seed) and differ only in their first step's state."""
    backend = _backend(tiny_model_dir)
    fused = SharedKvProposer.open(backend, fused_dir)
    plain = SharedKvProposer.open(backend, plain_dir)
    assert fused.folder.fusion is not None and fused.folder.fusion.layers == (1,)
    hidden = fused.folder.hidden_size
    seen = []
    for length in (3, 17, 40):
        context = _ids(length, seed=length)
        backend.reset()
        backend.decode(context[:-1], 0)
        row = np.array(backend.hidden_row(length - 2))
        assert row.shape == (2 * hidden,)
        state = _reference_fuse(fused_dir, row).astype(np.float32)
        assert np.abs(fused.folder.fusion.apply(row) - state).max() <= 1e-4
        assert np.abs(fused._fuse.run(None, {"row": row[None]})[0][0] - state).max() <= 1e-4  # what drafts read
        draft = fused.propose(DraftContext(context, 4, slot=0))
        # the plain head, fed the fused state as its hidden state, drafts the same: the row is the backend's own
        # buffer (a host view), whose first H values are what a plain head reads
        backend.hidden_row(length - 2)[:hidden] = state
        assert plain.propose(DraftContext(context, 4, slot=0)) == draft
        seen.append(draft)
    assert len(set(seen)) > 1


def test_a_target_without_the_streams_is_refused_by_name(tiny_model_dir, fused_dir, plain_dir):
    with pytest.raises(DrafterError, match=r"hidden_features=\(1,\)"):
        SharedKvProposer.open(_backend(tiny_model_dir, features=()), fused_dir)
    # a plain drafter reads the final hidden state of a row that carries more
    backend = _backend(tiny_model_dir)
    context = _ids(12, seed=1)
    backend.decode(context[:-1], 0)
    with_streams = SharedKvProposer.open(backend, plain_dir).propose(DraftContext(context, 4, slot=0))
    alone = _backend(tiny_model_dir, features=())
    alone.decode(context[:-1], 0)
    assert SharedKvProposer.open(alone, plain_dir).propose(DraftContext(context, 4, slot=0)) == with_streams


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.update(layers=[0]), "layers must be a non-empty list of distinct decoder layers >= 1"),
        (lambda f: f.update(layers=[1, 1]), "distinct"),
        (lambda f: f.update(eps=0), r"eps must be a number in \(0, 1\)"),
        (lambda f: f.update(file="missing.f32"), "file must name a file"),
    ],
)
def test_folder_errors_name_the_key(fused_dir, tmp_path, change, message):
    import shutil

    folder = Path(shutil.copytree(fused_dir, tmp_path / "d"))
    meta = json.loads((folder / DRAFTER_METADATA).read_text())
    change(meta["speculative"]["fused_features"])
    (folder / DRAFTER_METADATA).write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match=message):
        DrafterFolder.load(folder)


def test_a_fuse_file_of_the_wrong_size_is_refused(fused_dir, tmp_path):
    import shutil

    folder = Path(shutil.copytree(fused_dir, tmp_path / "d"))
    data = (folder / FUSED_FEATURES).read_bytes()
    (folder / FUSED_FEATURES).write_bytes(data[:-4])
    with pytest.raises(DrafterError, match=r"expected float32 \[\d+, \d+\]"):
        DrafterFolder.load(folder)


@pytest.mark.parametrize("batch_slots", [None, 2], ids=["alone", "batched"])
def test_the_engine_opens_the_target_with_the_streams_and_output_equals_plain(tiny_model_dir, fused_dir, batch_slots):
    from ortspec.adapters.engine import Engine

    engine = Engine.from_dir(
        tiny_model_dir, BackendConfig(threads=1, max_length=256), drafter=fused_dir, batch_slots=batch_slots
    )
    assert engine.backend_config.hidden_features == (1,)
    assert engine.drafter is not None  # the drafter opened on the target the Engine made for it
    for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}):
        for prompt in ("The quick brown fox jumps over the lazy dog.", "Return an iterator over the values"):
            plain = engine.generate(prompt, max_tokens=32, ignore_eos=True, **sampling)
            for speculative in ("shared-kv", "auto"):
                spec = engine.generate(prompt, max_tokens=32, ignore_eos=True, speculative=speculative,
                                       draft_width=3, **sampling)  # fmt: skip
                assert spec.token_ids == plain.token_ids
    assert engine.generate("Hello there", max_tokens=16, ignore_eos=True, speculative="shared-kv",
                           draft_width=3).stats.proposed_tokens > 0  # fmt: skip


def test_train_drafter_makes_a_fused_drafter_that_the_engine_runs_exactly(tiny_model_dir, tmp_path):
    """``TrainConfig(feature_layers=...)``: the data's hidden rows carry the streams, the head trains with a fuse,
    the folder holds it, the exported graph with the host's fuse computes the torch head, and an Engine runs it."""
    pytest.importorskip("torch")
    from ortspec.adapters.engine import Engine
    from ortspec.adapters.tools.drafter_recipe import TrainConfig
    from ortspec.adapters.tools.train_drafter import train_drafter

    recipe = TrainConfig(sequences=12, heldout=4, batch=4, max_new=24, updates=6, eval_every=3, draft_vocab=200,
                         steps=2, train_batch=4, threads=1, feature_layers=(1,), stop_below=0.0)  # fmt: skip
    folder = train_drafter(tiny_model_dir, tmp_path / "fused", recipe, progress=None)
    loaded = DrafterFolder.load(folder)
    assert loaded.fusion is not None and loaded.fusion.layers == (1,)
    assert not np.allclose(loaded.fusion.weight[loaded.hidden_size :], 0)  # the fuse learnt to read the stream
    record = json.loads((folder / DRAFTER_METADATA).read_text())["ortspec"]["training"]
    assert record["config"]["feature_layers"] == [1]
    check = record["export_check"]["fp32"]
    assert check["picks_agree"] == check["checked"] > 0 and check["max_logit_diff"] < 1e-3
    with pytest.raises(ValueError, match=r"feature_layers must be in \[1, 2\)"):
        train_drafter(tiny_model_dir, tmp_path / "bad", TrainConfig(feature_layers=(2,), sequences=12, heldout=4))
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1, max_length=256), drafter=folder)
    plain = engine.generate("The quick brown fox", max_tokens=24, ignore_eos=True)
    spec = engine.generate(
        "The quick brown fox", max_tokens=24, ignore_eos=True, speculative="shared-kv", draft_width=3
    )
    assert spec.token_ids == plain.token_ids and spec.stats.proposed_tokens > 0
