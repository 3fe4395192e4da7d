"""The drafter shipped with the package: made from a trained folder without the target's input-embedding table,
found for a model folder whose fingerprint it records (and skipped silently for any other), materialised once into
the cache with the table read from the model folder's graph and checked against the recorded shape and hash; and
the real one (``ortspec/drafters/``) opening on the default model with output equal to plain decoding."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")

from ortspec.adapters.engine import shipped  # noqa: E402
from ortspec.adapters.engine.drafters import find_drafter  # noqa: E402
from ortspec.backends.onnx import BackendConfig  # noqa: E402
from ortspec.backends.onnx.drafter import DrafterError, DrafterFolder  # noqa: E402
from tests.support.drafters import make_random_drafter  # noqa: E402


@pytest.fixture()
def shipped_setup(tiny_model_dir, tmp_path, monkeypatch):
    """A model folder (a copy of the tiny model), a trained drafter for it, its shipped form in a shipped root of
    its own, and an empty cache."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    trained = make_random_drafter(model, tmp_path / "trained", seed=3, draft_vocab=120)
    root = tmp_path / "shipped"
    shipped.package_drafter(trained, root / "tiny")
    monkeypatch.setattr(shipped, "shipped_root", lambda: root)
    monkeypatch.setenv("ORTSPEC_CACHE", str(tmp_path / "cache"))
    return model, trained, root / "tiny"


def test_the_shipped_form_has_no_table_but_names_it(shipped_setup):
    _, trained, packaged = shipped_setup
    assert not (packaged / "input_embedding.f32").exists()
    assert {p.name for p in packaged.iterdir()} == {p.name for p in trained.iterdir()} - {"input_embedding.f32"}
    source = json.loads((packaged / "drafter.json").read_text())["ortspec"]["input_embedding"]
    assert source["source"] == "target" and source["shape"] == list(DrafterFolder.load(trained).embedding().shape)


def test_a_fitting_model_gets_the_shipped_drafter_materialised_once(shipped_setup):
    model, trained, _ = shipped_setup
    found = find_drafter(model)
    assert found is not None and found.parent.parent == Path(shipped.cache_root())
    assert np.array_equal(DrafterFolder.load(found).embedding(), DrafterFolder.load(trained).embedding())
    stamp = (found / "input_embedding.f32").stat().st_mtime_ns
    assert find_drafter(model) == found and (found / "input_embedding.f32").stat().st_mtime_ns == stamp  # kept

    from ortspec.adapters.engine import Engine

    engine = Engine.from_dir(model, BackendConfig(threads=1))
    assert engine.drafter is not None and engine.drafter.folder.path == found
    plain = engine.generate("The quick brown fox", max_tokens=24, ignore_eos=True)
    spec = engine.generate("The quick brown fox", max_tokens=24, ignore_eos=True, speculative="shared-kv")
    assert spec.token_ids == plain.token_ids and spec.stats.proposed_tokens > 0


def test_the_models_own_and_the_trained_drafter_come_first(shipped_setup):
    from ortspec.adapters.engine.cache import drafter_dir

    model, trained, _ = shipped_setup
    shutil.copytree(trained, drafter_dir(model))
    assert find_drafter(model) == drafter_dir(model)
    shutil.copytree(trained, model / "drafter")
    assert find_drafter(model) == model / "drafter"


def test_another_model_is_skipped_silently(shipped_setup):
    model, _, _ = shipped_setup
    config = model / "genai_config.json"
    config.write_text(config.read_text() + "\n")  # another config: another fingerprint
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_drafter(model) is None
        from ortspec.adapters.engine import Engine

        assert Engine.from_dir(model, BackendConfig(threads=1)).drafter is None
    assert not (Path(shipped.cache_root()) / "drafters").exists()  # nothing materialised


def test_a_table_that_differs_from_the_recorded_one_is_refused(shipped_setup):
    model, _, packaged = shipped_setup
    meta = json.loads((packaged / "drafter.json").read_text())
    meta["ortspec"]["input_embedding"]["shape"][0] += 1
    (packaged / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="input-embedding table is"):
        find_drafter(model)
    meta["ortspec"]["input_embedding"]["shape"][0] -= 1
    meta["ortspec"]["input_embedding"]["sha256"] = "0" * 64
    (packaged / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="differs from the shipped drafter's"):
        find_drafter(model)
    from ortspec.adapters.engine import Engine

    with pytest.warns(RuntimeWarning, match="differs from the shipped drafter's"):
        assert Engine.from_dir(model, BackendConfig(threads=1)).drafter is None  # the engine stays usable
    assert not list((Path(shipped.cache_root()) / "drafters").iterdir())  # no half-written folder left


@pytest.mark.real_model
def test_the_shipped_drafter_opens_on_the_default_model_and_is_exact(real_model_dir):
    """The package's own drafter fits the default model (materialised in the user cache, once), and decoding with it
    equals plain decoding."""
    from ortspec.adapters.engine import Engine

    found = shipped.shipped_drafter(real_model_dir)
    assert found is not None and found.name.startswith("shipped-SmolLM2-135M-Instruct-")
    engine = Engine.from_dir(real_model_dir, BackendConfig(threads=2), drafter=found)
    assert engine.drafter is not None and engine.drafter.folder.path == found
    prompt = "Write a short story about a lonely lighthouse keeper."
    plain = engine.generate(prompt, chat=True, max_tokens=48)
    spec = engine.generate(prompt, chat=True, max_tokens=48, speculative="shared-kv", draft_width=4)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stats.accepted_tokens > 0
