"""What the installed ONNX Runtime's ``com.microsoft.GroupQueryAttention`` does with ``attention_bias`` and
``position_ids`` on the CPU, the facts a one-pass tree verify rests on (docs/tree-attention.md), and the proposed
rewrite of the builder's graph (backends/onnx/tree_rewrite.py) checked on the tiny builder folder.

A tree pass is compared with the reference: each root-to-leaf path run on its own as a chain after the same
context, node by node (outputs, and the KV rows the pass writes). Refusals are pinned by their messages, so an
onnxruntime upgrade that changes them shows here."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from ortspec.backends.base import BackendError  # noqa: E402
from ortspec.backends.onnx import ModelFolder  # noqa: E402
from ortspec.backends.onnx.tree_rewrite import (  # noqa: E402
    TREE_BIAS_INPUT,
    TREE_POSITIONS_INPUT,
    add_tree_inputs,
    tree_depths,
    tree_feeds,
)

helper, TP = onnx.helper, onnx.TensorProto
HEADS, KV_HEADS, HEAD = 4, 2, 16
CAPACITY = 32  # the shared KV buffer's rows, and the cos/sin caches' positions
PAST = 5
PARENTS = [-1, 0, 0, 1, 2, 2]  # paths 0-1-3, 0-2-4, 0-2-5
TOL = 1e-5


def _paths(parents) -> list[list[int]]:
    leaves = [i for i in range(len(parents)) if i not in parents]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4  # the refusals below would log each error too
    return options


def _gqa_session(*, rotary: bool = True, query_seqlens: bool = False, **attributes) -> ort.InferenceSession:
    """One GroupQueryAttention node: q/k/v, past_k/past_v, seqlens_k, total, pos, bias (and qs) as graph inputs of
    free shapes; cos/sin caches of ``CAPACITY`` positions when ``rotary``."""
    names = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", "", "", "pos", "bias"]
    inits = []
    if rotary:
        inv = 1.0 / (10000 ** (np.arange(0, HEAD, 2) / HEAD))
        angles = np.outer(np.arange(CAPACITY), inv)
        inits = [
            onnx.numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
            onnx.numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
        ]
        names[7:9] = ["cos", "sin"]
    if query_seqlens:
        names += ["", "", "", "", "", "qs"]
    types = dict.fromkeys(("q", "k", "v", "past_k", "past_v", "bias"), TP.FLOAT)
    types.update(seqlens_k=TP.INT32, total=TP.INT32, pos=TP.INT64, qs=TP.INT32)
    inputs = [helper.make_tensor_value_info(n, types[n], None) for n in names if n and n not in ("cos", "sin")]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=int(rotary),
        **attributes,
    )
    outputs = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("out", "present_k", "present_v")]
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs, inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return ort.InferenceSession(model.SerializeToString(), _options(), providers=["CPUExecutionProvider"])


class _Case:
    """Random q/k/v rows (one per tree node) and a context of ``past`` random KV rows in a ``CAPACITY`` buffer."""

    def __init__(self, past: int = PAST, n: int = len(PARENTS), seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.past = past
        self.q = rng.standard_normal((1, n, HEADS * HEAD)).astype(np.float32)
        self.k = rng.standard_normal((1, n, KV_HEADS * HEAD)).astype(np.float32)
        self.v = rng.standard_normal((1, n, KV_HEADS * HEAD)).astype(np.float32)
        self.past_k = np.zeros((1, KV_HEADS, CAPACITY, HEAD), np.float32)
        self.past_v = np.zeros_like(self.past_k)
        self.past_k[:, :, :past] = rng.standard_normal((1, KV_HEADS, past, HEAD))
        self.past_v[:, :, :past] = rng.standard_normal((1, KV_HEADS, past, HEAD))

    def feeds(self, rows, positions=None, bias=None, total=None) -> dict[str, np.ndarray]:
        """The feeds of a pass of ``rows`` after the context: ``positions`` default ``past + index``, ``bias``
        default zeros, ``total`` default ``past + len(rows)``."""
        count = len(rows)
        total = self.past + count if total is None else total
        return {
            "q": self.q[:, rows],
            "k": self.k[:, rows],
            "v": self.v[:, rows],
            "past_k": self.past_k.copy(),
            "past_v": self.past_v.copy(),
            "seqlens_k": np.array([self.past + count - 1], np.int32),
            "total": np.array(total, np.int32),
            "pos": np.asarray(self.past + np.arange(count) if positions is None else positions, np.int64).reshape(
                1, count
            ),
            "bias": np.zeros((1, 1, count, total), np.float32) if bias is None else bias,
        }


def _path_errors(session, case: _Case, out: np.ndarray, present_k: np.ndarray | None = None) -> list[float]:
    """Per root-to-leaf path: the largest difference between the tree pass's rows (outputs, and the key rows it
    wrote when ``present_k`` is given) and the path run as a chain."""
    errors = []
    for path in _paths(PARENTS):
        ref_out, ref_k, _ = session.run(None, case.feeds(path))
        error = float(np.abs(out[0, path] - ref_out[0]).max())
        if present_k is not None:
            rows = [case.past + i for i in path]
            error = max(
                error, float(np.abs(present_k[0][:, rows] - ref_k[0][:, case.past : case.past + len(path)]).max())
            )
        errors.append(error)
    return errors


# --- the schema -----------------------------------------------------------------------------------------------


def test_the_schema_takes_position_ids_and_attention_bias():
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    schema = next(
        s for s in get_all_operator_schema() if s.name == "GroupQueryAttention" and s.domain == "com.microsoft"
    )
    inputs = [(i.name, i.typeStr) for i in schema.inputs]
    assert inputs[5:11] == [
        ("seqlens_k", "M"),
        ("total_sequence_length", "M"),
        ("cos_cache", "T"),
        ("sin_cache", "T"),
        ("position_ids", "tensor(int64)"),
        ("attention_bias", "T"),
    ]
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    assert constraints["T"] == {"tensor(float)", "tensor(float16)", "tensor(bfloat16)"}
    assert constraints["M"] == {"tensor(int32)"}


# --- one GroupQueryAttention node -------------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [-np.inf, float(np.finfo(np.float32).min), -1e9])
@pytest.mark.parametrize("heads", [1, HEADS])
def test_a_tree_pass_equals_each_path_run_as_a_chain(masked, heads):
    """Bias (ancestors and self visible) + positions ``past + depth``: every node's output and the K/V rows it
    writes equal those of its path run alone; masked by -inf or a large finite negative, the bias broadcast over
    heads or given per head."""
    session, case = _gqa_session(), _Case()
    positions, bias = tree_feeds(PARENTS, PAST)
    bias = np.repeat(np.where(np.isinf(bias), np.float32(masked), bias), heads, axis=1)
    out, present_k, _ = session.run(None, case.feeds(range(len(PARENTS)), positions, bias))
    assert max(_path_errors(session, case, out, present_k)) < TOL


def test_with_the_static_width_the_bias_spans_the_whole_mask():
    """``total_sequence_length`` = the buffer's capacity (the static binding's mask width), ``seqlens_k`` the real
    length: the bias is ``[.., n, capacity]`` and its columns past the real length are ignored."""
    session, case = _gqa_session(), _Case()
    positions, bias = tree_feeds(PARENTS, PAST, total=CAPACITY)
    out = session.run(None, case.feeds(range(len(PARENTS)), positions, bias, total=CAPACITY))[0]
    assert max(_path_errors(session, case, out)) < TOL
    bias[..., PAST + len(PARENTS) :] = 1e4
    junk = session.run(None, case.feeds(range(len(PARENTS)), positions, bias, total=CAPACITY))[0]
    assert np.array_equal(junk, out)


def test_bias_alone_or_positions_alone_do_not_make_a_tree():
    """Both inputs are honoured, and both are needed: without the depths (positions ``past + index``) or without
    the bias (plain causal), the nodes off the first path differ from their paths."""
    session, case = _gqa_session(), _Case()
    positions, bias = tree_feeds(PARENTS, PAST)
    rows = range(len(PARENTS))
    bias_only = session.run(None, case.feeds(rows, None, bias))[0]
    positions_only = session.run(None, case.feeds(rows, positions, None))[0]
    assert min(_path_errors(session, case, bias_only)) > 1e-2
    assert min(_path_errors(session, case, positions_only)) > 1e-2


def test_without_a_past_the_positions_after_the_first_are_ignored():
    """With no past (the op's "first prompt" case) the op takes the first position only: depths or ``0..n-1``
    give the same result, which is not the paths'. A tree pass needs ``past >= 1``."""
    session, case = _gqa_session(), _Case(past=0)
    _, bias = tree_feeds(PARENTS, 1)
    bias = bias[..., 1:]  # the same mask without the context column
    rows = range(len(PARENTS))
    depths = session.run(None, case.feeds(rows, tree_depths(PARENTS), bias))[0]
    consecutive = session.run(None, case.feeds(rows, np.arange(len(PARENTS)), bias))[0]
    assert np.array_equal(depths, consecutive)
    assert max(_path_errors(session, case, depths)) > 1e-2


BIAS_REFUSALS = [
    ((1, 1, 6, 12), "attention_bias dimension 3 must be equal to total_sequence_length, got 12"),
    ((1, 1, 6, 10), "attention_bias dimension 3 must be equal to total_sequence_length, got 10"),
    ((1, 1, 5, 11), "attention_bias dimension 2 must be equal to the sequence length, got 5"),
    ((1, 2, 6, 11), "attention_bias dimension 1 must be equal to the num heads or 1, got 2"),
    ((6, 11), "attention_bias must be a 4D tensor, got 2 dimensions"),
]


@pytest.mark.parametrize(("shape", "message"), BIAS_REFUSALS)
def test_a_bias_of_another_shape_is_refused(shape, message):
    session, case = _gqa_session(), _Case()
    feeds = case.feeds(range(len(PARENTS)), bias=np.zeros(shape, np.float32))
    with pytest.raises(Exception, match=message):
        session.run(None, feeds)


def test_a_position_past_the_rotary_cache_is_refused():
    session, case = _gqa_session(), _Case()
    feeds = case.feeds(range(len(PARENTS)), positions=np.full(len(PARENTS), CAPACITY + 3))
    with pytest.raises(Exception, match=rf"position_ids value {CAPACITY + 3} at index 0 is out of range \[0, 32\)"):
        session.run(None, feeds)


def test_branches_as_batch_rows_need_query_seqlens():
    """The alternative layout, one path per batch row (each row with its own copy of the context KV): refused as
    written ("batch_size must be 1 ..."), equal to the paths with the ``query_seqlens`` input."""
    case = _Case()
    paths = _paths(PARENTS)
    rows, width = len(paths), len(paths[0])
    feeds = {
        "q": np.concatenate([case.q[:, p] for p in paths]),
        "k": np.concatenate([case.k[:, p] for p in paths]),
        "v": np.concatenate([case.v[:, p] for p in paths]),
        "past_k": np.repeat(case.past_k, rows, 0),
        "past_v": np.repeat(case.past_v, rows, 0),
        "seqlens_k": np.full(rows, PAST + width - 1, np.int32),
        "total": np.array(PAST + width, np.int32),
        "pos": np.tile(np.arange(PAST, PAST + width), (rows, 1)).astype(np.int64),
        "bias": np.zeros((1, 1, width, PAST + width), np.float32),
    }
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1 and past context is given"):
        _gqa_session().run(None, feeds)
    out = _gqa_session(query_seqlens=True).run(None, {**feeds, "qs": np.full(rows, width, np.int32)})[0]
    reference = _gqa_session()
    for row, path in enumerate(paths):
        assert np.abs(out[row] - reference.run(None, case.feeds(path))[0][0]).max() < TOL


# --- the rewrite: refusals and the tree's feeds -----------------------------------------------------------------


def _gqa_model(**attributes):
    """A one-node model like the builder's attention (cos/sin initializers, do_rotary=1 unless overridden)."""
    inv = np.ones(HEAD // 2, np.float32)
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "", "", "pk", "pv", "sk", "t", "cos", "sin"],
        ["o", "k", "v"],
        domain="com.microsoft",
        name="attn",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        **{"do_rotary": 1, **attributes},
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("q", "pk", "pv")],
        [helper.make_tensor_value_info("o", TP.FLOAT, None)],
        [onnx.numpy_helper.from_array(inv[None], "cos"), onnx.numpy_helper.from_array(inv[None], "sin")],
    )
    return helper.make_model(graph)


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"do_rotary": 0}, "does not rotate inside the op"),
        ({"local_window_size": 8}, "attends through a window"),
        ({"local_window_size": 8, "sliding_window_cache": 1}, "attends through a window"),
    ],
)
def test_the_rewrite_refuses_graphs_it_does_not_cover(attributes, message):
    model = _gqa_model(**attributes)
    before = model.SerializeToString()
    with pytest.raises(BackendError, match=message):
        add_tree_inputs(model)
    assert model.SerializeToString() == before


def test_the_rewrite_refuses_a_node_that_takes_the_inputs_already_and_a_graph_without_attention():
    model = _gqa_model()
    model.graph.node[0].input.extend(["pos"])
    with pytest.raises(BackendError, match=r"already takes inputs \[9\]"):
        add_tree_inputs(model)
    del model.graph.node[:]
    with pytest.raises(BackendError, match="no GroupQueryAttention node"):
        add_tree_inputs(model)


def test_tree_feeds():
    positions, bias = tree_feeds([-1, 0, 0, 2], past=3, total=9)
    assert positions.tolist() == [[3, 4, 4, 5]]
    visible = (bias[0, 0] == 0).astype(int)
    assert visible[:, :3].all() and not visible[:, 7:].any()
    assert visible[:, 3:7].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    with pytest.raises(ValueError, match="earlier node"):
        tree_depths([-1, 2, 0])
    with pytest.raises(ValueError, match="past >= 1"):
        tree_feeds([-1, 0], past=0)


# --- the rewrite on the tiny builder folder ---------------------------------------------------------------------

TREE = [-1, 0, 0, 1, 1, 2, 5]  # paths 0-1-3, 0-1-4, 0-2-5-6
LOGITS_TOL = 1e-4


class _Builder:
    """The tiny folder's file and its tree rewrite as sessions, a context's KV and random tree tokens."""

    def __init__(self, folder_dir) -> None:
        self.folder = folder = ModelFolder.load(folder_dir)
        model = onnx.load(str(folder.model_path), load_external_data=False)
        self.bias_dtype = add_tree_inputs(model)
        options = _options()
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder.path))
        self.tree = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.plain = ort.InferenceSession(str(folder.model_path), _options(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(1)
        self.context = [int(t) for t in rng.integers(3, 384, size=7)]
        self.tokens = [int(t) for t in rng.integers(3, 384, size=len(TREE))]
        self.kv_names = [
            (folder.past_key_pattern % i, folder.present_key_pattern % i) for i in range(folder.num_layers)
        ] + [(folder.past_value_pattern % i, folder.present_value_pattern % i) for i in range(folder.num_layers)]
        out = self.run(self.plain, self.context, self.empty(0), 0)
        self.context_kv = {past: out[present] for past, present in self.kv_names}

    def empty(self, rows: int) -> dict[str, np.ndarray]:
        shape = (1, self.folder.num_kv_heads, rows, self.folder.head_size)
        return {past: np.zeros(shape, np.float32) for past, _ in self.kv_names}

    def run(self, session, tokens, kv, past, **extra) -> dict[str, np.ndarray]:
        feeds = {
            "input_ids": np.array([tokens], np.int64),
            "attention_mask": np.ones((1, past + len(tokens)), np.int64),
            **kv,
            **extra,
        }
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))

    def path_reference(self, path) -> dict[str, np.ndarray]:
        return self.run(self.plain, [self.tokens[i] for i in path], self.context_kv, len(self.context))


@pytest.fixture(scope="module")
def builder(tiny_model_dir) -> _Builder:
    return _Builder(tiny_model_dir)


def test_the_builder_graph_wires_lengths_and_rotary_inside_the_op(builder):
    """What the rewrite relies on: no position input, rotary inside GroupQueryAttention (cos/sin caches),
    ``seqlens_k`` and ``total_sequence_length`` from the attention mask, position_ids/attention_bias unset."""
    model = onnx.load(str(builder.folder.model_path), load_external_data=False)
    assert [i.name for i in model.graph.input][:2] == ["input_ids", "attention_mask"]
    assert not any("position" in i.name for i in model.graph.input)
    producers = {out: node for node in model.graph.node for out in node.output}

    def chain(name: str) -> list[str]:
        ops = []
        while name in producers:
            node = producers[name]
            ops.append(node.op_type)
            name = node.input[0]
        return ops + [name]

    for node in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == 1 and attrs["local_window_size"] == -1
        assert node.input[7:9] == ["cos_cache", "sin_cache"] and not any(node.input[9:])
        assert chain(node.input[5]) == ["Cast", "Sub", "ReduceSum", "attention_mask"]
        assert chain(node.input[6]) == ["Cast", "Gather", "Shape", "attention_mask"]


def test_the_rewritten_graph_with_a_chain_computes_what_the_file_computes(builder):
    past, n = len(builder.context), len(TREE)
    ours = builder.run(
        builder.tree,
        builder.tokens,
        builder.context_kv,
        past,
        **{
            TREE_POSITIONS_INPUT: (past + np.arange(n))[None],
            TREE_BIAS_INPUT: np.zeros((1, 1, n, past + n), builder.bias_dtype),
        },
    )
    file = builder.run(builder.plain, builder.tokens, builder.context_kv, past)
    assert np.abs(ours["logits"] - file["logits"]).max() <= 1e-6


def test_a_tree_pass_of_the_builder_graph_equals_each_path(builder):
    """Logits row ``i`` = the last logits of node ``i``'s path run after the context; the KV rows written for a
    path's nodes = the path's rows."""
    past = len(builder.context)
    positions, bias = tree_feeds(TREE, past, dtype=builder.bias_dtype)
    out = builder.run(
        builder.tree,
        builder.tokens,
        builder.context_kv,
        past,
        **{TREE_POSITIONS_INPUT: positions, TREE_BIAS_INPUT: bias},
    )
    for path in _paths(TREE):
        reference = builder.path_reference(path)
        assert np.abs(out["logits"][0, path] - reference["logits"][0]).max() < LOGITS_TOL
        rows = [past + i for i in path]
        for _, present in builder.kv_names:
            assert np.abs(out[present][0][:, rows] - reference[present][0][:, past:]).max() < LOGITS_TOL


def test_a_tree_pass_in_the_shared_static_buffer_then_the_accepted_path_continues(builder):
    """As the static binding runs it: KV buffers of ``capacity`` rows bound as both past and present, the mask
    ``[1, capacity]`` with ``past + n`` leading ones, the bias as wide. Then the accepted path's KV rows are
    copied down to ``past, past + 1, ...`` and the next token, run as a chain at ``past + len(path)``, gives the
    logits of the whole sequence run at once."""
    folder, past, n, capacity = builder.folder, len(builder.context), len(TREE), 64
    buffers = builder.empty(capacity)
    for name, value in builder.context_kv.items():
        buffers[name][:, :, :past] = value
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in buffers.items()}

    def run_shared(session, tokens, length, **extra) -> np.ndarray:
        binding = session.io_binding()
        mask = np.zeros((1, capacity), np.int64)
        mask[0, :length] = 1
        feeds = {"input_ids": np.array([tokens], np.int64), "attention_mask": mask, **extra}
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for past_name, present_name in builder.kv_names:
            binding.bind_ortvalue_input(past_name, values[past_name])
            binding.bind_ortvalue_output(present_name, values[past_name])
        binding.bind_output(folder.logits_name)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[-1]  # the logits, bound last

    positions, bias = tree_feeds(TREE, past, total=capacity, dtype=builder.bias_dtype)
    logits = run_shared(
        builder.tree, builder.tokens, past + n, **{TREE_POSITIONS_INPUT: positions, TREE_BIAS_INPUT: bias}
    )
    accepted = _paths(TREE)[-1]  # 0-2-5-6: not laid out contiguously
    reference = builder.path_reference(accepted)
    assert np.abs(logits[0, accepted] - reference["logits"][0]).max() < LOGITS_TOL
    for array in buffers.values():  # keep the accepted path: row past + a_k -> past + k
        array[:, :, past : past + len(accepted)] = array[:, :, [past + i for i in accepted]].copy()
    following = int(np.argmax(logits[0, accepted[-1]]))
    length = past + len(accepted) + 1
    step = run_shared(builder.plain, [following], length)
    whole = builder.run(
        builder.plain, builder.context + [builder.tokens[i] for i in accepted] + [following], builder.empty(0), 0
    )
    assert np.abs(step[0, -1] - whole["logits"][0, -1]).max() < LOGITS_TOL
