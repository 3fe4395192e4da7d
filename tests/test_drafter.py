"""The shared-KV drafter on tiny random models built on the fly: OrtBackend's hidden states and KV pointers, the
drafter folder's validation, the head against an independent numpy reference on the backend's live KV (bound in
place, never copied), the driver's promise, rejection costing nothing, exactness end to end (greedy and seeded
sampling, ``shared-kv`` and ``auto``), the Engine's discovery, the draft-cost measurement and the training
pipeline's data against the single-sequence backend."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from ortspec.adapters.tools.drafter_graph import DRAFTER_METADATA  # noqa: E402
from ortspec.backends.base import BackendError, HiddenStates  # noqa: E402
from ortspec.backends.onnx import BackendConfig, OrtBackend  # noqa: E402
from ortspec.backends.onnx.drafter import DrafterError, DrafterFolder, SharedKvProposer  # noqa: E402
from ortspec.core import DraftContext  # noqa: E402
from tests.support.drafters import make_random_drafter  # noqa: E402


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A random drafter for the tiny model with a reduced vocabulary (a scattered draft_to_target map)."""
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter") / "d", seed=1, draft_vocab=300)


@pytest.fixture(scope="module")
def full_vocab_drafter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter-full") / "d", seed=2)


@pytest.fixture()
def backend(tiny_model_dir) -> OrtBackend:
    return OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=128))


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, n)]


def promised_state(backend: OrtBackend, context: list[int]) -> None:
    """The state the driver promises a drafter: KV of every context token but the last, the last pass ending at
    the one before it."""
    backend.reset()
    backend.decode(context[:-1], 0)


# ----------------------------------------------------------------------------------------------------------------
# The numpy reference of the documented head (reads the weights from the ONNX file; shares no code with ortspec)
# ----------------------------------------------------------------------------------------------------------------


class ReferenceHead:
    def __init__(self, folder: Path, kv_heads: int) -> None:
        from onnx import numpy_helper

        meta = json.loads((folder / DRAFTER_METADATA).read_text())["speculative"]
        model = onnx.load(str(folder / meta["model"]))
        self.w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
        self.eps = float(self.w["eps"])
        self.hidden = meta["backbone_hidden_size"]
        self.kv_heads = kv_heads
        self.size = self.w["cos"].shape[1] * 2
        self.heads = self.w["wq"].shape[1] // self.size
        rows = (folder / meta["input_embedding"]).stat().st_size // (4 * self.hidden)
        self.embedding = np.fromfile(folder / meta["input_embedding"], "<f4").reshape(rows, self.hidden)
        mapping = meta.get("draft_to_target")
        self.to_target = np.fromfile(folder / mapping, "<i8") if mapping else np.arange(rows)

    def rms(self, x, weight):
        return x / np.sqrt(np.mean(x * x) + self.eps) * self.w[weight]

    def step(self, embed, state, position, keys, values):
        """One query: ``keys``/``values`` ``[kv_heads, kv_len, D]``; returns (logits, projected state)."""
        w, d = self.w, self.size
        u = np.concatenate([self.rms(embed, "norm_embed"), self.rms(state, "norm_hidden")]) @ w["fc"] + w["fc_bias"]
        q = (self.rms(u, "norm_attn") @ w["wq"]).reshape(self.heads, d)
        cos, sin = w["cos"][position], w["sin"][position]
        q = np.concatenate(
            [q[:, : d // 2] * cos - q[:, d // 2 :] * sin, q[:, d // 2 :] * cos + q[:, : d // 2] * sin], 1
        )
        out = np.zeros((self.heads, d))
        group = self.heads // self.kv_heads
        for h in range(self.heads):
            scores = keys[h // group] @ q[h] / np.sqrt(d)
            p = np.exp(scores - scores.max())
            out[h] = (p / p.sum()) @ values[h // group]
        u = u + out.reshape(-1) @ w["wo"]
        m = self.rms(u, "norm_mlp")
        gate = m @ w["w_gate"]
        u = u + (gate / (1 + np.exp(-gate)) * (m @ w["w_up"])) @ w["w_down"]
        state = self.rms(u, "norm_out")
        return state @ w["lm_head"], state

    def draft(self, token, hidden, position, keys, values, steps):
        out, state = [], hidden
        for _ in range(steps):
            logits, state = self.step(self.embedding[token].astype(np.float64), state, position, keys, values)
            token = int(self.to_target[int(np.argmax(logits))])
            out.append(token)
        return tuple(out)


def live_kv(backend: OrtBackend, layer: int) -> tuple[np.ndarray, np.ndarray]:
    n = backend.current_len()
    return backend.kv.keys[layer][0, :, :n].astype(np.float64), backend.kv.values[layer][0, :, :n].astype(np.float64)


# ----------------------------------------------------------------------------------------------------------------
# OrtBackend: hidden states and the buffers a drafter reads
# ----------------------------------------------------------------------------------------------------------------


def test_backend_hidden_states_are_the_lm_heads_input(tiny_model_dir, backend):
    from ortspec.adapters.engine.target_tables import TargetTables

    assert isinstance(backend, HiddenStates) and backend.hidden_size == 64
    lm_head = TargetTables(backend.folder).tensor("lm_head.MatMul.weight")
    ids = prompt_ids(20, backend.vocab_size)
    rows = backend.decode_verify(ids, 0).copy()
    for position in (0, 7, 19):
        np.testing.assert_allclose(backend.hidden_at(position) @ lm_head, rows[position], atol=2e-4)
    # only the last pass's positions, and only resident ones; a decode keeps its last position's row only
    backend.decode([5, 6], 20)
    with pytest.raises(BackendError, match="last pass computed positions"):
        backend.hidden_at(20)
    assert backend.hidden_at(21).shape == (64,)
    backend.rewind(20)
    backend.decode_verify([5, 6], 20)
    with pytest.raises(BackendError, match="last pass computed positions"):
        backend.hidden_at(19)
    assert backend.hidden_at(21).shape == (64,)
    backend.rewind(21)
    with pytest.raises(BackendError):
        backend.hidden_at(21)
    row = backend.hidden_at(20).copy()
    pointer = (ctypes.c_float * 64).from_address(backend.hidden_pointer(20))
    np.testing.assert_array_equal(np.frombuffer(pointer, np.float32), row)
    np.testing.assert_array_equal(backend.hidden_row(20), row)
    backend.reset()
    with pytest.raises(BackendError):
        backend.hidden_at(0)


def test_kv_pointer_addresses_each_heads_first_positions(backend):
    backend.decode(prompt_ids(10, backend.vocab_size), 0)
    head_size = backend.folder.head_size
    for layer in range(backend.folder.num_layers):
        for which, buffers in (("key", backend.kv.keys), ("value", backend.kv.values)):
            for head in range(backend.folder.num_kv_heads):
                raw = (ctypes.c_float * (10 * head_size)).from_address(backend.kv_pointer(layer, which, head))
                got = np.frombuffer(raw, np.float32).reshape(10, head_size)
                np.testing.assert_array_equal(got, buffers[layer][0, head, :10])
    with pytest.raises(ValueError):
        backend.kv_pointer(backend.folder.num_layers, "key", 0)
    with pytest.raises(ValueError):
        backend.kv_pointer(0, "query", 0)


@pytest.fixture(scope="module")
def no_hidden_model_dir(tmp_path_factory) -> Path:
    from tests.support.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-old") / "tiny", hidden_states=False)


def test_a_folder_without_hidden_states_is_refused_clearly(no_hidden_model_dir, drafter_dir):
    from ortspec.adapters.tools.convert import has_hidden_states, is_complete

    assert not has_hidden_states(no_hidden_model_dir / "model.onnx") and not is_complete(no_hidden_model_dir)
    backend = OrtBackend.from_folder(no_hidden_model_dir, BackendConfig(threads=1, max_length=64))
    assert backend.hidden_size == 0
    backend.decode([1, 2, 3], 0)
    with pytest.raises(BackendError, match="include_hidden_states"):
        backend.hidden_at(2)
    with pytest.raises(DrafterError, match="no 'hidden_states' output.*ortspec convert"):
        SharedKvProposer.open(backend, drafter_dir, check_fingerprint=False)


# ----------------------------------------------------------------------------------------------------------------
# The head and its binding
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_drafts_equal_the_reference_on_the_targets_kv(which, drafter_dir, full_vocab_drafter_dir, backend):
    folder = drafter_dir if which == "reduced" else full_vocab_drafter_dir
    proposer = SharedKvProposer.open(backend, folder)
    layer = proposer.folder.groups[0].layer
    reference = ReferenceHead(folder, backend.folder.num_kv_heads)
    for length in (2, 9, 40):
        context = prompt_ids(length, backend.vocab_size, seed=length)
        promised_state(backend, context)
        draft = proposer.propose(DraftContext(context, 6, slot=0))
        keys, values = live_kv(backend, layer)
        hidden = backend.hidden_at(length - 2).astype(np.float64)
        assert draft == reference.draft(context[-1], hidden, length - 1, keys, values, min(6, proposer.max_draft))
        assert all(0 <= t < backend.vocab_size for t in draft)
        assert backend.current_len() == length - 1  # the drafter touched nothing


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_coupled_drafts_are_the_targets_pick_rule_on_the_heads_rows(
    which, drafter_dir, full_vocab_drafter_dir, backend
):
    """Coupled to a sampled generation (the context's ``picker``), each draft token is the verify pass's pick (the
    core's ``StepContext`` of the prompt and generated tokens, at the token's row, the draft so far in the penalties)
    made from the reference head's logits scattered over the target vocabulary, ``-inf`` where the head cannot
    draft."""
    from ortspec.core.sampling import DraftPicker, Sampling, StepContext

    folder = drafter_dir if which == "reduced" else full_vocab_drafter_dir
    proposer = SharedKvProposer.open(backend, folder)
    layer = proposer.folder.groups[0].layer
    reference = ReferenceHead(folder, backend.folder.num_kv_heads)
    sampling = Sampling(temperature=1.5, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4, seed=11)
    differs = False
    for length, prompt_len in ((9, 4), (40, 33), (25, 24)):
        context = prompt_ids(length, backend.vocab_size, seed=length)
        promised_state(backend, context)
        draft = proposer.propose(DraftContext(context, 6, slot=0, picker=DraftPicker(sampling, prompt_len)))
        differs |= draft != proposer.propose(DraftContext(context, 6, slot=0))
        keys, values = live_kv(backend, layer)
        verify = StepContext(sampling, context[:prompt_len], context[prompt_len:])
        token, state, want = context[-1], backend.hidden_at(length - 2).astype(np.float64), []
        for i in range(min(6, proposer.max_draft)):
            embed = reference.embedding[token].astype(np.float64)
            logits, state = reference.step(embed, state, length - 1, keys, values)
            row = np.full(backend.vocab_size, -np.inf, np.float32)
            row[reference.to_target] = logits
            token = verify.pick(row, i, want, margin=False, top_n=0).token
            want.append(token)
        assert draft == tuple(want)
        assert backend.current_len() == length - 1
    assert differs  # at T 1.5 the coupled picks are not the argmax


def test_with_branches_the_drafter_hangs_the_heads_runners_up_beside_its_chain(drafter_dir, backend):
    """With ``branches`` and a context granting more nodes than the width, the draft is a tree: the chain it drafts
    alone as its first branch, then as leaves the head's runner-up tokens at each depth (the reference head's top
    ``branches`` there), the likeliest first by the chance of reaching and taking them; without the nodes, the
    chain."""
    from ortspec.core.tree import DraftTree

    proposer = SharedKvProposer.open(backend, drafter_dir, branches=3)
    reference = ReferenceHead(drafter_dir, backend.folder.num_kv_heads)
    layer = proposer.folder.groups[0].layer
    context = prompt_ids(20, backend.vocab_size, seed=5)
    promised_state(backend, context)
    chain = SharedKvProposer.open(backend, drafter_dir).propose(DraftContext(context, 4, slot=0))
    assert proposer.propose(DraftContext(context, 4, slot=0)) == chain  # no node budget: the chain
    assert proposer.propose(DraftContext(context, 4, slot=0, nodes=4)) == chain
    tree = proposer.propose(DraftContext(context, 4, slot=0, nodes=9))
    assert isinstance(tree, DraftTree) and tree.first_branch().tokens == chain and len(tree) == 4 + 5
    keys, values = live_kv(backend, layer)
    token, state, reach, expected = context[-1], backend.hidden_at(18).astype(np.float64), 1.0, []
    for depth, pick in enumerate(chain):
        logits, state = reference.step(reference.embedding[token].astype(np.float64), state, 19, keys, values)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = [int(j) for j in np.argsort(-probs, kind="stable")[:3]]
        ids = [int(reference.to_target[j]) for j in top]
        expected += [(-reach * probs[j], depth, t) for j, t in zip(top, ids, strict=True) if t != pick]
        reach *= probs[top[ids.index(pick)]] if pick in ids else 0.0
        token = pick
    expected.sort()
    siblings = [(tree.depths[j], tree.tokens[j]) for j in range(4, len(tree))]
    assert siblings == [(d, t) for _, d, t in expected[:5]]
    assert all(tree.parents[j] == tree.depths[j] - 1 for j in range(4, len(tree)))  # leaves beside the chain
    assert backend.current_len() == 19


def test_the_drafter_reads_the_cache_in_place(drafter_dir, backend):
    """Changing the backend's KV buffer (in place, same address) changes the next draft exactly as the reference
    says: the drafter reads the live buffer, not a copy."""
    proposer = SharedKvProposer.open(backend, drafter_dir)
    layer = proposer.folder.groups[0].layer
    reference = ReferenceHead(drafter_dir, backend.folder.num_kv_heads)
    context = prompt_ids(30, backend.vocab_size, seed=3)
    promised_state(backend, context)
    before = proposer.propose(DraftContext(context, 4, slot=0))
    rng = np.random.default_rng(0)
    for buffer in (backend.kv.keys[layer], backend.kv.values[layer]):
        buffer[0, :, :29] = rng.standard_normal(buffer[0, :, :29].shape).astype(np.float32) * 3
    after = proposer.propose(DraftContext(context, 4, slot=0))
    keys, values = live_kv(backend, layer)
    want = reference.draft(context[-1], backend.hidden_at(28).astype(np.float64), 29, keys, values, 4)
    assert after == want and after != before


def test_the_promise_is_checked(drafter_dir, backend):
    proposer = SharedKvProposer.open(backend, drafter_dir)
    context = prompt_ids(12, backend.vocab_size)
    promised_state(backend, context)
    with pytest.raises(DrafterError, match="holds 11 KV positions but the context has 13 tokens"):
        proposer.propose(DraftContext([*context, 5], 3, slot=0))
    assert proposer.propose(DraftContext(context, 0, slot=0)) == ()
    assert proposer.propose(DraftContext(context, 3)) == ()  # no slot: the target holds no state for the context
    assert proposer.propose(DraftContext([*context, 5], 3)) == ()  # (such as after tokens drafted in front)
    backend.reset()
    assert proposer.propose(DraftContext([7], 3, slot=0)) == ()  # nothing cached yet: nothing to read


def test_a_rejected_draft_costs_nothing(drafter_dir, backend):
    """The drafter owns no state that a rejection would have to undo: after a verify pass and a rewind, its next
    draft equals a fresh drafter's on a fresh backend in the same state."""
    proposer = SharedKvProposer.open(backend, drafter_dir)
    context = prompt_ids(16, backend.vocab_size, seed=5)
    promised_state(backend, context)
    draft = proposer.propose(DraftContext(context, 4, slot=0))
    base = backend.current_len()
    rows = backend.decode_verify([context[-1], *draft], base)
    pick = int(np.argmax(rows[0]))
    backend.rewind(base + 1)  # accept nothing: keep the pending token, drop the draft
    after = proposer.propose(DraftContext([*context, pick], 4, slot=0))
    fresh_backend = OrtBackend.from_folder(backend.folder, BackendConfig(threads=1, max_length=128))
    promised_state(fresh_backend, [*context, pick])
    assert after == SharedKvProposer.open(fresh_backend, drafter_dir).propose(DraftContext([*context, pick], 4, slot=0))
    assert not hasattr(proposer, "rewind")


def test_stop_below_drops_unconfident_picks(drafter_dir, backend):
    confident = SharedKvProposer.open(backend, drafter_dir, stop_below=0.999)
    context = prompt_ids(10, backend.vocab_size)
    promised_state(backend, context)
    assert confident.propose(DraftContext(context, 4, slot=0)) == ()  # a random head is never that sure


# ----------------------------------------------------------------------------------------------------------------
# Folder and graph validation
# ----------------------------------------------------------------------------------------------------------------


def copy_drafter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_metadata(folder: Path, change) -> None:
    path = folder / DRAFTER_METADATA
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["speculative"].update(proposal_type="eagle3"), "proposal_type must be 'shared_kv'"),
        (lambda m: m["speculative"].update(model="missing.onnx"), "speculative.model names missing.onnx"),
        # 65 divides no table of the tiny model's 384 x 64 float32 (2**15 * 3 bytes); 48 does (test below)
        (lambda m: m["speculative"].update(backbone_hidden_size=65), "not a whole number of float32 rows"),
        (lambda m: m["speculative"].update(vocab_size=299), "draft_to_target.i64 holds 2400 bytes; expected 299"),
        (lambda m: m["speculative"]["io"].update(kv_layout="per_group"), "needs one input per KV head"),
        (lambda m: m["speculative"].update(shared_kv=[]), "shared_kv must be a non-empty list"),
        (lambda m: m["speculative"]["shared_kv"][0].update(target_layers=["x"]), "target_layers must be"),
        (lambda m: m.pop("speculative"), "missing section 'speculative'"),
        (lambda m: m.setdefault("ortspec", {}).update(stop_below=1.5), "ortspec.stop_below must be a number in"),
    ],
)
def test_metadata_errors_name_the_file_and_key(drafter_dir, tmp_path, change, message):
    folder = copy_drafter(drafter_dir, tmp_path / "d")
    edit_metadata(folder, change)
    with pytest.raises(DrafterError, match=message) as info:
        DrafterFolder.load(folder)
    assert str(folder / DRAFTER_METADATA) in str(info.value)


def test_draft_map_errors(drafter_dir, tmp_path):
    folder = copy_drafter(drafter_dir, tmp_path / "d")
    mapping = np.fromfile(folder / "draft_to_target.i64", "<i8")
    mapping[1] = mapping[0]
    mapping.tofile(folder / "draft_to_target.i64")
    with pytest.raises(DrafterError, match="maps two draft ids to the same target id"):
        DrafterFolder.load(folder)
    mapping[1] = 10**6
    mapping.tofile(folder / "draft_to_target.i64")
    with pytest.raises(DrafterError, match="outside the target vocabulary"):
        DrafterFolder.load(folder)


def test_graph_errors_name_the_graph_and_tensor(tiny_model_dir, drafter_dir, tmp_path, backend):
    """A graph in the seed's one-tensor-per-group layout, a graph missing a head's input, and a drafter for
    another target (layer out of range, fingerprint) are refused with the file and the tensor named."""
    seed_layout = copy_drafter(drafter_dir, tmp_path / "seed")
    model = onnx.load(str(seed_layout / "drafter.onnx"))
    for value in model.graph.input:
        if value.name == "shared_kv.full_attention.key.0":
            value.name = "shared_kv.full_attention.key"
    for node in model.graph.node:
        node.input[:] = ["shared_kv.full_attention.key" if i == "shared_kv.full_attention.key.0" else i
                         for i in node.input]  # fmt: skip
    onnx.save(model, str(seed_layout / "drafter.onnx"))
    with pytest.raises(DrafterError, match=r"drafter.onnx: input 'shared_kv.full_attention.key' takes all KV heads"):
        SharedKvProposer.open(backend, seed_layout)

    other_layer = copy_drafter(drafter_dir, tmp_path / "layer")
    edit_metadata(other_layer, lambda m: m["speculative"]["shared_kv"][0].update(target_layers=[7]))
    with pytest.raises(DrafterError, match="reads target layer 7 but the target has 2 layers"):
        SharedKvProposer.open(backend, other_layer)

    renamed = copy_drafter(drafter_dir, tmp_path / "renamed")
    edit_metadata(renamed, lambda m: m["speculative"]["shared_kv"][0].update(key_input="shared_kv.other.key"))
    with pytest.raises(DrafterError, match=r"drafter.onnx: the graph has no input named 'shared_kv.other.key.0'"):
        SharedKvProposer.open(backend, renamed)

    narrower = copy_drafter(drafter_dir, tmp_path / "narrower")  # 48 divides the table: only the target tells
    edit_metadata(narrower, lambda m: m["speculative"].update(backbone_hidden_size=48))
    assert DrafterFolder.load(narrower).target_vocab == 512
    with pytest.raises(DrafterError, match="backbone_hidden_size 48 differs from the target's 64"):
        SharedKvProposer.open(backend, narrower)

    foreign = copy_drafter(drafter_dir, tmp_path / "foreign")
    edit_metadata(foreign, lambda m: m["ortspec"]["target"].update(config_sha256="0" * 64))
    with pytest.raises(DrafterError, match="made for another target"):
        SharedKvProposer.open(backend, foreign)
    SharedKvProposer.open(backend, foreign, check_fingerprint=False)


# ----------------------------------------------------------------------------------------------------------------
# End to end: exactness, the Engine, the costs
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture()
def engine(tiny_model_dir, drafter_dir):
    from ortspec.adapters.engine import Engine

    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1, max_length=256), drafter=drafter_dir)


@pytest.mark.parametrize("speculative", ["shared-kv", "auto"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_speculative_with_the_drafter_equals_plain(engine, speculative, sampling):
    prompts = ["The quick brown fox jumps over the lazy dog.", "Return an iterator over the values"]
    for prompt in prompts:
        plain = engine.generate(prompt, max_tokens=40, ignore_eos=True, **sampling)
        for width in ("auto", 3):
            spec = engine.generate(prompt, max_tokens=40, ignore_eos=True, speculative=speculative,
                                   draft_width=width, **sampling)  # fmt: skip
            assert spec.token_ids == plain.token_ids and spec.text == plain.text
            if speculative == "shared-kv" and width == 3:
                assert spec.stats.proposed_tokens > 0  # the drafter drafted, the verify pass judged


def test_the_folders_stop_below_is_the_drafters_alone_and_batched(tiny_model_dir, drafter_dir, tmp_path):
    """A drafter opens with the ``stop_below`` its folder records (none: 0), on an Engine alone and on every slot
    of a batched one; an explicit value overrides it."""
    from ortspec.adapters.engine import Engine

    assert DrafterFolder.load(drafter_dir).stop_below == 0.0
    sure = copy_drafter(drafter_dir, tmp_path / "sure")
    edit_metadata(sure, lambda m: m.setdefault("ortspec", {}).update(stop_below=0.4))
    config = BackendConfig(threads=1, max_length=128)
    assert Engine.from_dir(tiny_model_dir, config, drafter=sure).drafter.stop_below == 0.4
    with Engine.from_dir(tiny_model_dir, config, drafter=sure, batch_slots=2) as batched:
        drafters = batched.drafter  # SlotDrafters: slots 0 and 1, and the lone slot 2
        assert {drafters.for_slot(s).stop_below for s in (0, 1, 2)} == {0.4}
    backend = OrtBackend.from_folder(tiny_model_dir, config)
    assert SharedKvProposer.open(backend, sure, stop_below=0.0).stop_below == 0.0


def test_engine_finds_the_drafter_beside_the_model(tiny_model_dir, drafter_dir, tmp_path):
    from ortspec.adapters.engine import Engine

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    assert Engine.from_dir(model, BackendConfig(threads=1)).drafter is None
    with pytest.raises(ValueError, match="speculative='shared-kv' needs a drafter"):
        Engine.from_dir(model, BackendConfig(threads=1)).generate("hi", max_tokens=2, speculative="shared-kv")
    shutil.copytree(drafter_dir, model / "drafter")
    found = Engine.from_dir(model, BackendConfig(threads=1))
    from ortspec.backends.onnx.slot_drafters import SlotDrafters

    assert isinstance(found.drafter, SlotDrafters) and found.drafter.folder.path == model / "drafter"  # batched
    assert Engine.from_dir(model, BackendConfig(threads=1), drafter=False).drafter is None


def test_draft_cost_is_measured_and_the_backend_left_reset(tiny_model_dir, drafter_dir):
    from ortspec.adapters.engine.measurements import measure_draft_cost, probe_ids

    backend = OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=128))
    proposer = SharedKvProposer.open(backend, drafter_dir)
    result = measure_draft_cost(backend, proposer, probe_ids(backend.vocab_size, 50), width=3, repeats=3)
    assert result["tokens"] == 3 and result["step_s"] > 0 and result["decode_step_s"] > 0
    assert result["cost"] == pytest.approx(result["step_s"] / result["decode_step_s"])
    assert backend.current_len() == 0
    # a batched Engine's drafter (SlotDrafters) is measured on the batch's lone slot, the context naming that slot
    from ortspec.backends.onnx import OrtBatchBackend
    from ortspec.backends.onnx.slot_drafters import SlotDrafters

    batch = OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=128), slots=2)
    lone, drafters = batch.lone(), SlotDrafters.open(batch, drafter_dir)
    ids = probe_ids(batch.vocab_size, 50)
    result = measure_draft_cost(lone, drafters, ids, width=3, repeats=3, slot=batch.slots)
    assert result["tokens"] == 3 and lone.current_len() == 0


# ----------------------------------------------------------------------------------------------------------------
# The training pipeline's pieces
# ----------------------------------------------------------------------------------------------------------------


def test_batched_target_data_equals_the_backend(tiny_model_dir, tmp_path):
    """TargetRunner (batched, equal-length prompts) records what OrtBackend computes one sequence at a time: the
    greedy continuation, hidden states, the layer's keys and values, and labels = the next tokens. It reads a
    folder whose files are hard links (which ``onnx.load`` refuses to read external data from) as the backend does."""
    from ortspec.adapters.tools.drafter_data import TargetRunner
    from ortspec.backends.onnx import ModelFolder

    copy, linked = tmp_path / "copy", tmp_path / "linked"  # links to a copy: the shared tiny folder keeps one link
    shutil.copytree(tiny_model_dir, copy)
    linked.mkdir()
    for file in copy.iterdir():
        if file.is_file():
            os.link(file, linked / file.name)
    assert (linked / "model.onnx.data").stat().st_nlink == 2
    runner = TargetRunner(ModelFolder.load(linked), 1, threads=1)
    folder = ModelFolder.load(tiny_model_dir)
    prompts = [prompt_ids(9, folder.vocab_size, seed=s) for s in range(3)]
    records = runner.run(prompts, 12, eos=[0])
    backend = OrtBackend.from_folder(folder, BackendConfig(threads=1, max_length=64))
    for prompt, record in zip(prompts, records, strict=True):
        assert record.prompt_len == 9 and list(record.tokens[:9]) == prompt
        backend.reset()
        n = len(record)
        rows = backend.decode_verify([int(t) for t in record.tokens], 0)
        assert np.array_equal(rows.argmax(1), record.labels)
        assert np.array_equal(record.labels[8:-1], record.tokens[9:])  # greedy from the last prompt token on
        np.testing.assert_allclose(record.hidden, np.stack([backend.hidden_at(i) for i in range(n)]), atol=1e-4)
        np.testing.assert_allclose(record.keys, backend.kv.keys[1][0, :, :n], atol=1e-4)
        np.testing.assert_allclose(record.values, backend.kv.values[1][0, :, :n], atol=1e-4)


# A recipe of a few seconds on the tiny model: counts and a seed, no clock.
TINY_RECIPE = dict(
    sequences=12, heldout=4, batch=4, max_new=24, updates=6, eval_every=3, draft_vocab=200, steps=2, train_batch=4
)


def _tiny_run(tiny_model_dir, out: Path, seed: int) -> tuple[dict, dict[str, bytes]]:
    """Train a drafter by the tiny recipe; its training record without the clock's part, and its files' bytes."""
    from ortspec.adapters.tools.drafter_recipe import TrainConfig
    from ortspec.adapters.tools.train_drafter import train_drafter

    folder = train_drafter(tiny_model_dir, out, TrainConfig(**TINY_RECIPE, seed=seed, threads=1), progress=None)
    record = json.loads((folder / DRAFTER_METADATA).read_text())["ortspec"]["training"]
    record.pop("timing")
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != DRAFTER_METADATA}
    return record, files


@pytest.fixture(scope="module")
def tiny_trained(tiny_model_dir, tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    return tmp_path_factory.mktemp("trained") / "seed0"


def test_train_drafter_writes_a_valid_folder_by_counts(tiny_model_dir, tiny_trained):
    from ortspec.adapters.tools.drafter_recipe import TrainConfig

    record, _ = _tiny_run(tiny_model_dir, tiny_trained, seed=0)
    folder = tiny_trained
    meta = DrafterFolder.load(folder)
    assert meta.vocab_size == 200
    assert record["data"]["sequences"] == 12 and record["data"]["heldout_sequences"] == 4
    assert record["updates"] == 6 and not record["cut_short_by_safety_bound"]
    assert [p["updates"] for p in record["heldout_curve"]] == [0, 3, 6]  # every eval_every updates, and the end
    assert len(record["heldout_after_training"]["accepted_by_width"]) == 4
    check = record["export_check"]
    assert check["fp32"]["picks_agree"] == check["fp32"]["checked"] > 0  # the graph computes the torch head
    assert check["weights"] == "int8" and check["bytes"] < check["bytes_fp32"] / 2  # then its weights are int8
    assert check["int8"]["checked"] == check["fp32"]["checked"] and check["int8"]["max_logit_diff"] < 1.0
    backend = OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=128))
    context = prompt_ids(20, backend.vocab_size)
    promised_state(backend, context)
    assert meta.stop_below == TrainConfig().stop_below == record["config"]["stop_below"]  # the recipe's, recorded
    assert len(SharedKvProposer.open(backend, folder, stop_below=0.0).propose(DraftContext(context, 3, slot=0))) == 3


def test_the_recipe_is_deterministic(tiny_model_dir, tiny_trained, tmp_path):
    """Same recipe and seed: the same record (but the clock's part) and the same files, byte for byte; another seed
    makes another drafter."""
    if not (tiny_trained / DRAFTER_METADATA).is_file():
        _tiny_run(tiny_model_dir, tiny_trained, seed=0)
    first = json.loads((tiny_trained / DRAFTER_METADATA).read_text())["ortspec"]["training"]
    first.pop("timing")
    files = {p.name: p.read_bytes() for p in sorted(tiny_trained.iterdir()) if p.name != DRAFTER_METADATA}
    again, again_files = _tiny_run(tiny_model_dir, tmp_path / "again", seed=0)
    assert again == first and again_files == files
    other, other_files = _tiny_run(tiny_model_dir, tmp_path / "other", seed=1)
    assert other["config"]["seed"] == 1 and other_files["drafter.onnx"] != files["drafter.onnx"]


def test_the_recipe_keeps_sequences_to_train_on():
    from ortspec.adapters.tools.drafter_recipe import TrainConfig

    with pytest.raises(ValueError, match="heldout"):
        TrainConfig(sequences=4, heldout=4)
