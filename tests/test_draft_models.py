"""An Engine's draft model (``adapters/engine/draft_models.py``, ``Engine.from_dir(target, draft_model=DIR)``,
``speculative="draft-model"``): the vocabulary check at load, and the Engine on a pair of tiny random models built
from one config with different seeds (one vocabulary): its outputs are plain decoding's, alone and many at once,
greedy and sampled, on every surface that names it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ortspec.backends.draft_model import DraftModelProposer
from ortspec.core import LookupOrDraft

pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A draft model for ``tiny_model_dir``: the same config and tokenizer, other weights (seed 1). The tokenizer
    files are the target's own (a tokenizer trained again need not number its tokens alike)."""
    from tests.support.models import make_tiny_model

    draft = make_tiny_model(tmp_path_factory.mktemp("draft-model") / "tiny-seed1", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy2(tiny_model_dir / name, draft / name)
    return draft


@pytest.fixture(scope="module")
def engine(tiny_model_dir, draft_dir, tmp_path_factory):
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import BackendConfig

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        engine = Engine.from_dir(
            tiny_model_dir, BackendConfig(threads=1), drafter=False, draft_model=draft_dir, batch_slots=2
        )
        yield engine
        engine.close()


def _copy(folder: Path, to: Path, *, tokenizer=None, model=None) -> Path:
    """``folder`` copied to ``to``, its ``tokenizer.json`` and ``genai_config.json``'s ``model`` section edited in
    place by ``tokenizer(data)`` and ``model(section)``."""
    shutil.copytree(folder, to)
    for name, edit, key in (("tokenizer.json", tokenizer, None), ("genai_config.json", model, "model")):
        if edit is None:
            continue
        data = json.loads((to / name).read_text(encoding="utf-8"))
        edit(data if key is None else data[key])
        (to / name).write_text(json.dumps(data), encoding="utf-8")
    return to


def _swap_ids(data: dict) -> None:
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def _one_more(data: dict) -> None:
    data["added_tokens"].append(dict(data["added_tokens"][0], id=384, content="<|extra|>"))


def _not_special(data: dict) -> None:
    data["added_tokens"][2]["special"] = False


def test_a_draft_folder_of_the_same_vocabulary_passes(tiny_model_dir, draft_dir):
    from ortspec.adapters.engine.draft_models import check_same_vocabulary, vocabulary_differences
    from ortspec.backends.onnx import ModelFolder

    target, draft = ModelFolder.load(tiny_model_dir), ModelFolder.load(draft_dir)
    assert vocabulary_differences(target, draft) == []
    check_same_vocabulary(target, draft)


@pytest.mark.parametrize(
    ("edits", "says"),
    [
        ({"tokenizer": _swap_ids}, "2 token ids differ (target id vs draft id; None: absent): "),
        ({"tokenizer": _not_special}, "1 special tokens differ (target id vs draft id; None: absent): '<|im_end|>': 2"),
        ({"model": lambda m: m.update(eos_token_id=[1])}, "EOS ids: target [0], draft [1]"),
        ({"model": lambda m: m.update(vocab_size=400)}, "vocab_size (genai_config.json): target 384, draft 400"),
        ({"tokenizer": _one_more}, "tokenizer.json size: target 384 tokens, draft 385"),
    ],
    ids=["swapped ids", "special tokens", "eos", "logits width", "a token more"],
)
def test_a_draft_folder_of_another_vocabulary_is_refused_naming_what_differs(tiny_model_dir, tmp_path, edits, says):
    from ortspec.adapters.engine.draft_models import VocabularyMismatch, check_same_vocabulary
    from ortspec.backends.onnx import ModelFolder

    other = _copy(tiny_model_dir, tmp_path / "other", **edits)
    with pytest.raises(VocabularyMismatch) as info:
        check_same_vocabulary(ModelFolder.load(tiny_model_dir), ModelFolder.load(other))
    message = str(info.value)
    assert says in message and str(other) in message and "does not have the vocabulary of" in message
    assert isinstance(info.value, ValueError)


def test_engine_from_dir_refuses_a_draft_model_of_another_vocabulary(tiny_model_dir, tmp_path):
    from ortspec.adapters.engine import Engine
    from ortspec.adapters.engine.draft_models import VocabularyMismatch
    from ortspec.backends.onnx import BackendConfig

    other = _copy(tiny_model_dir, tmp_path / "other", tokenizer=_swap_ids)
    with pytest.raises(VocabularyMismatch, match="token ids differ"):
        Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), drafter=False, draft_model=other, batch_slots=2)


def test_the_engine_opens_one_draft_slot_per_slot_and_its_lone_slot(engine):
    proposer = engine.draft_model
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.backend.slots == engine.batch.slots + 1 == engine.lone_slot + 1 == 3
    assert proposer.target_vocab == engine.backend.vocab_size and proposer.stop_ids == engine.eos_token_ids
    # its runs alternate with the target's: a pool left spinning would take a core from the target's next pass
    options = proposer.backend.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):", "The cat sat on the mat. The cat", "x = [1, 2, 3]"]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}], ids=["greedy", "sampled"])
def test_draft_model_output_is_plain_decoding_alone_and_many_at_once(engine, sampling):
    options = dict(max_tokens=24, ignore_eos=True, **sampling)
    plain = [engine.generate(p, speculative=None, **options) for p in PROMPTS]
    alone = [engine.generate(p, speculative="draft-model", draft_width=4, **options) for p in PROMPTS]
    many = engine.generate_many(PROMPTS, speculative="draft-model", draft_width=4, **options)
    auto = engine.generate_many(PROMPTS, speculative="auto", **options)  # the lookup or the draft model, priced
    for want, one, batched, chosen in zip(plain, alone, many, auto, strict=True):
        assert one.token_ids == batched.token_ids == chosen.token_ids == want.token_ids
    assert sum(r.stats.proposed_tokens for r in alone) > 0
    assert not engine.draft_model.broken


def test_draft_model_width_auto_is_priced_by_its_measured_step(engine):
    prices = engine.measurements.prices()
    assert prices.draft_model_cost > 0 and prices.draft_cost == 0.0  # no shared-KV drafter here
    request = engine.request("a b a b", _options(speculative="draft-model"))
    assert request.proposer is engine.draft_model and not request.reads_target_state
    assert request.draft_width.draft_cost == prices.draft_model_cost
    # its catch-up is priced too: a read per context token, the whole prompt unread at the start
    assert prices.draft_model_read_cost > 0 and request.draft_width.read_cost == prices.draft_model_read_cost
    assert request.draft_width.unread == len(request.ids) > 0
    auto = engine.request("a b a b", _options()).proposer  # the default, "auto", drafts with the draft model too
    assert isinstance(auto, LookupOrDraft) and auto.draft_model is engine.draft_model and auto.drafter is None
    assert auto.draft_model_policy.draft_cost == prices.draft_model_cost


def test_draft_model_read_cost_is_measured_by_whole_rereads(engine):
    from ortspec.adapters.engine.measurements import measure_read_cost, probe_ids

    measured, proposer = engine.measurements, engine.draft_model
    ids, fed = probe_ids(engine.backend.vocab_size, 40), proposer.tokens_fed
    result = measure_read_cost(measured.backend, proposer, ids, repeats=3, slot=measured._drafter_slot)
    assert result["context_tokens"] == 40 and result["read_s"] > 0 and result["decode_step_s"] > 0
    assert result["cost"] == pytest.approx(result["read_s"] / 40 / result["decode_step_s"])
    assert proposer.tokens_fed - fed >= 3 * 40  # each timed propose read the whole context
    assert measured.backend.current_len() == 0


def _options(**kwargs):
    from ortspec.adapters.engine.options import GenerationOptions

    return GenerationOptions(max_tokens=4, **kwargs)


def test_without_a_draft_model_the_name_is_refused_naming_speculative(tiny_model_dir):
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import BackendConfig
    from ortspec.core.checks import ArgumentError

    with Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), drafter=False, batch_slots=1) as plain:
        assert plain.draft_model is None
        with pytest.raises(ArgumentError, match="needs a draft model") as info:
            plain.request("x", _options(speculative="draft-model"))
        assert info.value.argument == "speculative"


def test_every_command_that_opens_an_engine_takes_draft_model():
    from ortspec.adapters.cli.engine_args import draft_model
    from ortspec.adapters.cli.main import build_parser

    parser = build_parser()
    for argv in (["generate", "x"], ["demo"], ["bench"], ["serve"], ["batch", "in.jsonl", "out.jsonl"]):
        args = parser.parse_args([*argv, "--draft-model", "DIR", "--speculative", "draft-model"])
        assert draft_model(args) == "DIR" and args.speculative == "draft-model"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "sampled"])
def test_the_target_as_its_own_draft_model_drafts_its_picks(tiny_model_dir, tmp_path, monkeypatch, sampling):
    """The target's own folder as its draft model drafts what the target picks (greedy, or coupled to the
    request's sampling): nearly every draft token is accepted, and the output is plain decoding's."""
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import BackendConfig

    monkeypatch.setenv("ORTSPEC_CACHE", str(tmp_path))
    config = BackendConfig(threads=1)
    with Engine.from_dir(tiny_model_dir, config, drafter=False, draft_model=tiny_model_dir, batch_slots=1) as same:
        options = dict(max_tokens=32, ignore_eos=True, **sampling)
        spec = same.generate(PROMPTS[0], speculative="draft-model", draft_width=4, **options)
        assert spec.token_ids == same.generate(PROMPTS[0], speculative=None, **options).token_ids
        assert spec.stats.proposed_tokens > 0 and spec.stats.acceptance_rate >= 0.9


def test_a_batch_run_opens_the_draft_model_only_when_a_record_drafts_with_it(tmp_path):
    from ortspec.adapters.batch.job import BatchJob
    from ortspec.adapters.batch.records import option_fields, parse_record
    from ortspec.adapters.batch.worker import WorkerSettings

    job = BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", draft_model="DIR")
    names = ("draft-model", "suffix")
    tasks = [parse_record(json.dumps({"id": i, "prompt": "x", "speculative": s}), i, {}, option_fields())
             for i, s in enumerate(names)]  # fmt: skip
    assert WorkerSettings.of(job, 1, {}, tasks).draft_model == "DIR"
    assert WorkerSettings.of(job, 1, {}, tasks[1:]).draft_model is None
    default = [parse_record(json.dumps({"id": 9, "prompt": "x"}), 9, {}, option_fields())]  # the job's default
    assert WorkerSettings.of(job, 1, {"speculative": "draft-model"}, default).draft_model == "DIR"


def test_a_server_whose_default_is_the_draft_model_needs_one(tiny_model_dir):
    pytest.importorskip("fastapi")
    from ortspec.adapters.engine import Engine
    from ortspec.adapters.serve.app import make_pool
    from ortspec.adapters.serve.metrics import Metrics
    from ortspec.adapters.serve.settings import ServerSettings
    from ortspec.backends.onnx import BackendConfig
    from ortspec.core.checks import ArgumentError

    settings = ServerSettings(model_name="tiny", speculative="draft-model")
    with Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), drafter=False, batch_slots=1) as plain:
        with pytest.raises(ArgumentError, match="needs a draft model"):
            make_pool(plain, settings, Metrics())
