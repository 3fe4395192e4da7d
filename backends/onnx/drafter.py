"""Shared-KV drafters: a small ONNX head that drafts tokens from the target's own last hidden state and KV cache.

The contract (what ``ortspec train-drafter`` and ``ortspec.adapters.tools.drafter_graph`` write; docs/drafter.md has the
long form):

* **Folder.** ``drafter_folder.py`` (``DrafterFolder``): ``drafter.json``, the graph it names, the target's
  input embedding table and, for a reduced draft vocabulary, the draft-to-target id map.
* **Graph.** Inputs ``inputs_embeds`` ``[B, q, 2H]`` (the target's input embedding of a token, then a hidden
  state), optional ``position_ids`` ``[B, q]`` int64, and per group and target KV head ``h``,
  ``<key_input>.<h>`` / ``<value_input>.<h>`` ``[B, 1, kv_len, head_size]``. Outputs ``logits`` ``[B, q, V']`` and
  ``projected_state`` ``[B, q, H]``. Every query row attends to all ``kv_len`` bound positions.
* **Why one input per KV head.** ``OrtBackend`` keeps a layer's KV as one ``[1, kv_heads, max_length, head_size]``
  buffer, so the first ``kv_len`` positions of all heads are not one contiguous block, but each head's are. One
  input per head is bound by pointer into the buffer at that head (``OrtBackend.kv_pointer``): nothing is copied,
  whatever ``kv_len`` is. The seed's one-tensor-per-group layout (``[B, kv_heads, kv_len, head_size]``) would need a
  copy of the cache every round; such a graph is refused.

The draft loop (``SharedKvProposer.propose``), in ortspec's fused step: when the driver asks for a draft, the
backend holds the KV of every context token but the last (the pending token) and its last pass computed the hidden
state at ``current_len() - 1``, which predicted the pending token. The drafter starts from ``(pending token, that
hidden state)``, queries at the fixed position ``current_len()`` (the pending token's), picks the argmax of its
logits (mapped to a target id; coupled to a sampled generation, the target's pick rule: ``draft_picks.py``), and
feeds ``(that pick, its projected_state)`` to the next step; every pick is a draft token. No KV is the drafter's.

**The target** is anything with the :class:`SharedKvTarget` protocol (``OrtBackend`` has it): the drafter reads
the target's committed length, its hidden-state row and the address of each KV head through it, and nothing else.

Errors: a folder or graph that breaks the contract raises ``DrafterError`` naming the file and the key or tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import numpy as np

from ortspec.core.proposers import DraftContext
from ortspec.core.sampling import DraftPicks
from ortspec.core.tree import DraftTree

from ..base import BackendError
from .arrays import ArrayModule
from .draft_picks import HeadPicks
from .drafter_folder import KV_LAYOUT, METADATA_NAME, DrafterError, DrafterFolder, KvGroup, check_stop_below
from .drafter_support import DrafterSupportError, drafter_support
from .fingerprint import fingerprint_differences, target_fingerprint
from .folder import ModelFolder
from .model_graph import FLOAT_DTYPES, ORT_TYPES
from .session import execution_providers, make_session_options, open_session

__all__ = [
    "KV_LAYOUT",
    "METADATA_NAME",
    "DrafterError",
    "DrafterFolder",
    "DrafterGraph",
    "DrafterSupportError",
    "KvGroup",
    "SharedKvProposer",
    "SharedKvTarget",
    "check_stop_below",
    "drafter_support",
    "inspect_drafter_graph",
]


class SharedKvTarget(Protocol):
    """What a shared-KV drafter reads from its target backend (``OrtBackend`` is one), in place on the target's
    device: the buffers stay the target's, the drafter never writes them.

    ``folder``: the target's model folder (its path, layers, KV heads and head size); ``provider`` and
    ``device_id``: where the drafter's session runs; ``array_module`` and ``device_type``: the target's buffers'
    array module and IO-binding device; ``vocab_size``, ``hidden_size`` (0: no hidden states) and ``kv_dtype``: the
    shapes and type the drafter's graph must match; ``hidden_features``: the layers whose residual streams follow
    the final state in a hidden row (``BackendConfig.hidden_features``; a row is ``(1 + len) * H`` wide)."""

    @property
    def folder(self) -> ModelFolder: ...
    @property
    def provider(self) -> str: ...
    @property
    def device_id(self) -> int: ...
    @property
    def device_type(self) -> str: ...
    @property
    def array_module(self) -> ArrayModule: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def hidden_features(self) -> tuple[int, ...]: ...
    @property
    def kv_dtype(self) -> np.dtype: ...

    def current_len(self) -> int:
        """The committed KV length (positions ``[0, current_len())`` are resident)."""
        ...

    def hidden_row(self, position: int) -> Any:
        """The final hidden state at ``position`` (a position of the last pass), ``[hidden_size]`` on the target's
        device, valid until the target's next call."""
        ...

    def kv_pointer(self, layer: int, which: str, head: int) -> int:
        """The device address of KV head ``head`` of ``layer`` (``which``: ``"key"`` or ``"value"``) at position 0;
        its first ``current_len()`` positions are contiguous ``[head_size]`` rows of ``kv_dtype``."""
        ...


@attrs.frozen
class DrafterGraph:
    """What one drafter run binds (all checked against the session): ``embeds_name`` ``[B, q, 2H]`` of
    ``float_dtype``; ``position_name`` (None when the graph takes no positions); per group the per-head
    ``(keys, values)`` input names, all of ``float_dtype``; outputs ``logits`` ``[B, q, V']`` and the projected state
    ``[B, q, H]``, both of ``float_dtype``."""

    embeds_name: str
    position_name: str | None
    kv_inputs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
    float_dtype: np.dtype


def inspect_drafter_graph(session, folder: DrafterFolder, *, kv_heads: int, head_size: int) -> DrafterGraph:
    """Check the session's inputs and outputs against the folder's metadata and the target's KV shape
    (``kv_heads`` heads of ``head_size``); ``DrafterError`` names the graph file and the tensor at fault."""
    where = str(folder.model_path)
    inputs = {a.name: a for a in session.get_inputs()}
    outputs = {a.name: a for a in session.get_outputs()}

    def need(table: Mapping[str, Any], name: str, what: str) -> Any:
        if name not in table:
            raise DrafterError(
                f"{where}: the graph has no {what} named {name!r}; it declares {sorted(table)[:10]}"
                + (" ..." if len(table) > 10 else "")
            )
        return table[name]

    def check(arg: Any, rank: int, fixed: Mapping[int, int], what: str) -> np.dtype:
        if ORT_TYPES.get(arg.type) not in FLOAT_DTYPES:
            raise DrafterError(f"{where}: {what} {arg.name!r} has type {arg.type}; expected float or float16")
        dtype = ORT_TYPES[arg.type]
        shape = list(arg.shape)
        if len(shape) != rank:
            raise DrafterError(f"{where}: {what} {arg.name!r} has rank {len(shape)}, expected {rank}")
        for axis, size in fixed.items():
            if isinstance(shape[axis], int) and shape[axis] != size:
                raise DrafterError(f"{where}: {what} {arg.name!r} has dim {axis} = {shape[axis]}, expected {size}")
        return dtype

    hidden = folder.hidden_size
    embeds = need(inputs, "inputs_embeds", "input")
    dtype = check(embeds, 3, {2: 2 * hidden}, "input")
    fed = {embeds.name}
    position_name = None
    if "position_ids" in inputs:
        position = inputs["position_ids"]
        if position.type != "tensor(int64)" or len(position.shape) != 2:
            raise DrafterError(f"{where}: input 'position_ids' must be int64 [batch, query], got {position.type}")
        position_name = position.name
        fed.add(position_name)
    kv_inputs = []
    for group in folder.groups:
        if group.key_input in inputs or group.value_input in inputs:
            raise DrafterError(
                f"{where}: input {group.key_input!r} takes all KV heads in one tensor; ortspec binds the target's "
                f"cache in place, which needs one input per KV head ({group.key_input}.0 .. "
                f"{group.key_input}.{kv_heads - 1}, each [batch, 1, kv_len, {head_size}])"
            )
        keys, values = group.input_names(kv_heads)
        for name in (*keys, *values):
            arg = need(inputs, name, "input")
            if check(arg, 4, {1: 1, 3: head_size}, "input") != dtype:
                raise DrafterError(f"{where}: input {name!r} is {arg.type} but inputs_embeds is {embeds.type}")
            fed.add(name)
        extra_heads = [n for n in inputs if n.startswith(f"{group.key_input}.") and n not in keys]
        if extra_heads:
            raise DrafterError(
                f"{where}: inputs {extra_heads} read KV heads the target does not have (it has {kv_heads})"
            )
        kv_inputs.append((keys, values))
    unknown = sorted(set(inputs) - fed)
    if unknown:
        raise DrafterError(f"{where}: the graph declares inputs a shared-KV drafter does not feed: {unknown}")
    logits = need(outputs, folder.logits_name, "output")
    if check(logits, 3, {2: folder.vocab_size}, "output") != dtype:
        raise DrafterError(f"{where}: output {logits.name!r} is {logits.type} but inputs_embeds is {embeds.type}")
    state = need(outputs, folder.projected_state_name, "output")
    if check(state, 3, {2: hidden}, "output") != dtype:
        raise DrafterError(f"{where}: output {state.name!r} is {state.type} but inputs_embeds is {embeds.type}")
    return DrafterGraph(
        embeds_name=embeds.name, position_name=position_name, kv_inputs=tuple(kv_inputs), float_dtype=dtype
    )


class SharedKvProposer:
    """A shared-KV draft head bound to one target backend (a :class:`SharedKvTarget`; the ``Proposer`` the driver
    calls): it reads the backend's ``current_len()``, its last hidden state and the KV buffers of the layers its
    groups name, in place.

    Made by :meth:`open`. ``max_draft``: the most tokens one ``propose`` drafts (default: the folder's
    ``num_speculative_tokens``). ``stop_below``: a pick less likely than this is not proposed and drafting stops
    (0 = never; None: the folder's ``stop_below``; host path only; ``HeadPicks`` says under which distribution). The
    backend must be the one the driver runs: the promise that ``propose`` relies on (module docstring) is checked,
    and a broken one raises ``DrafterError``. Buffers are the proposer's, on the backend's device; nothing KV-sized
    is allocated or copied per call. ``steps`` and ``runs`` count ``propose`` calls that drafted and head runs.
    ``branches``: the most candidates a tree draft holds at one depth (1, the default: chains); above 1, where the
    context grants more nodes than the width (``DraftContext.nodes``: a tree budget, on a backend that runs trees),
    ``propose`` drafts its chain as the first branch and, in the nodes left, the head's runner-up tokens as sibling
    leaves (``core.tree.DraftTree.with_siblings``), ranked by the head's probability of reaching and taking them;
    they cost no head run (each depth's runners-up come from the run that picked its token)."""

    def __init__(
        self,
        backend: SharedKvTarget,
        folder: DrafterFolder,
        session,
        *,
        max_draft: int | None = None,
        stop_below: float | None = None,
        check_fingerprint: bool = True,
        branches: int = 1,
    ) -> None:
        self.backend = backend
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        self.branches = int(branches)
        self.folder = folder
        self.session = session
        self.max_draft = int(max_draft if max_draft is not None else folder.num_speculative_tokens)
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.stop_below = folder.stop_below if stop_below is None else check_stop_below(stop_below)
        target = backend.folder
        self._check_target(target, check_fingerprint)
        self.graph = inspect_drafter_graph(session, folder, kv_heads=target.num_kv_heads, head_size=target.head_size)
        if self.graph.float_dtype != backend.kv_dtype:
            raise DrafterError(
                f"{folder.model_path}: the graph reads {self.graph.float_dtype} KV but {target.model_path} keeps "
                f"{backend.kv_dtype} KV"
            )
        self._head_size = target.head_size
        arrays = backend.array_module
        self._arrays = arrays
        self._device, self._device_id = backend.device_type, backend.device_id
        hidden, dtype = folder.hidden_size, self.graph.float_dtype
        embedding = folder.embedding()
        self._embedding = embedding if self._device == "cpu" else arrays.from_host(np.asarray(embedding, dtype))
        self._head_picks = HeadPicks(folder.draft_to_target, backend.vocab_size, self.stop_below, arrays, self._device)
        self._embeds = arrays.zeros((1, 1, 2 * hidden), dtype)
        self._positions = arrays.zeros((1, 1), np.int64)
        self._positions_host = np.zeros((1, 1), np.int64)
        self._logits = arrays.empty((1, 1, folder.vocab_size), dtype)
        self._state = arrays.empty((1, 1, hidden), dtype)
        self._binding = session.io_binding()
        self._bind(self.graph.embeds_name, self._embeds, [1, 1, 2 * hidden], dtype)
        if self.graph.position_name:
            self._bind(self.graph.position_name, self._positions, [1, 1], np.dtype(np.int64))
        for name, array, shape in (
            (folder.logits_name, self._logits, [1, 1, folder.vocab_size]),
            (folder.projected_state_name, self._state, [1, 1, hidden]),
        ):
            self._binding.bind_output(name, self._device, self._device_id, dtype, shape, arrays.ptr(array))
        self._fuse = None  # the fused features' session (one thread), for a folder that has them
        if folder.fusion is not None:
            self._fuse = open_session(
                folder.fusion.path or folder.model_path, providers=["CPUExecutionProvider"],
                session_options=make_session_options(threads=1), model_bytes=folder.fusion.model(),
            )  # fmt: skip
        self._bound_len = -1
        self.steps = 0
        self.runs = 0

    def _bind(self, name: str, array, shape: list[int], dtype: np.dtype) -> None:
        self._binding.bind_input(name, self._device, self._device_id, dtype, shape, self._arrays.ptr(array))

    def _check_target(self, target: ModelFolder, check_fingerprint: bool) -> None:
        folder, backend = self.folder, self.backend
        where = f"drafter {folder.path} on target {target.path}"
        if not backend.hidden_size:
            raise DrafterError(
                f"{where}: the target graph {target.model_path} has no 'hidden_states' output, which a shared-KV "
                "drafter reads; rebuild the folder with `ortspec convert` (it rebuilds folders made before) or with "
                "the onnxruntime-genai builder's extra option include_hidden_states=true"
            )
        features = tuple(backend.hidden_features)
        if backend.hidden_size != folder.hidden_size * (1 + len(features)):
            raise DrafterError(
                f"{where}: backbone_hidden_size {folder.hidden_size} differs from the target's "
                f"{backend.hidden_size // (1 + len(features))}"
            )
        wanted = folder.fusion.layers if folder.fusion is not None else None
        if wanted is not None and features != wanted:
            raise DrafterError(
                f"{where}: the drafter reads the residual streams entering layers {list(wanted)} (fused features), "
                f"but the target's hidden rows carry layers {list(features)}; open the target with "
                f"BackendConfig(hidden_features={wanted!r}) (Engine.from_dir does this for the drafter it opens)"
            )
        if wanted is not None and backend.device_type != "cpu":
            raise DrafterError(f"{where}: fused features are applied on the host; not yet on {backend.device_type}")
        if backend.vocab_size != folder.target_vocab:
            raise DrafterError(
                f"{where}: {folder.embedding_path.name} has {folder.target_vocab} rows but the target's vocabulary "
                f"is {backend.vocab_size}"
            )
        for group in folder.groups:
            if group.layer >= target.num_layers:
                raise DrafterError(
                    f"{where}: group {group.name!r} reads target layer {group.layer} but the target has "
                    f"{target.num_layers} layers"
                )
            reason = drafter_support(target, group.layer, training=False)
            if reason is not None:
                raise DrafterSupportError(f"{where}: {reason}")
        recorded = folder.fingerprint
        if check_fingerprint and recorded is not None:
            differs = fingerprint_differences(recorded, target_fingerprint(target.path))
            if differs:
                raise DrafterError(
                    f"{where}: the drafter was made for another target ({recorded.get('name')!r}; "
                    f"{'; '.join(differs)}); pass check_fingerprint=False to use it anyway"
                )

    @classmethod
    def open(
        cls,
        backend: SharedKvTarget,
        folder_or_path: DrafterFolder | str | os.PathLike[str],
        *,
        threads: int | None = 1,
        max_draft: int | None = None,
        stop_below: float | None = None,
        check_fingerprint: bool = True,
        session_options=None,
        branches: int = 1,
    ) -> SharedKvProposer:
        """Open the drafter in ``folder_or_path`` for ``backend`` (an ``OrtBackend`` with hidden states), on the
        backend's execution provider. ``threads``: the head's intra-op threads (default 1: a draft step is a few
        small matrix-vector products, and a second pool competes with the target's for the same cores)."""
        folder = folder_or_path if isinstance(folder_or_path, DrafterFolder) else DrafterFolder.load(folder_or_path)
        options = session_options or make_session_options(threads=threads)
        try:
            providers = execution_providers(backend.provider, backend.device_id)
            session = open_session(folder.model_path, providers=providers, session_options=options)
        except BackendError as exc:
            raise DrafterError(str(exc)) from exc
        return cls(
            backend,
            folder,
            session,
            max_draft=max_draft,
            stop_below=stop_below,
            check_fingerprint=check_fingerprint,
            branches=branches,
        )

    # ------------------------------------------------------------------------------------------------------------
    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        """Up to ``min(context.width, max_draft)`` draft tokens after ``context.tokens`` (see the module
        docstring): the argmax picks, or with the context's ``picker`` (a sampled generation) the coupled ones; a
        tree of at most ``context.nodes`` nodes with them as its first branch where ``branches`` and the context
        allow (the class docstring). Bound to one target, it reads that target whatever the context's slot number,
        and drafts nothing for a context whose slot is None (the target holds no state for it)."""
        if context.slot is None:
            return ()
        tokens = context.tokens
        kv_len = self.backend.current_len()
        if kv_len != len(tokens) - 1:
            raise DrafterError(
                f"the backend holds {kv_len} KV positions but the context has {len(tokens)} tokens; a "
                "shared-KV drafter needs the KV of every context token but the last (the driver's promise)"
            )
        steps = min(int(context.width), self.max_draft)
        if steps < 1 or kv_len < 1:
            return ()
        picks = context.picker.after(tokens) if context.picker is not None else None
        nodes = context.nodes
        if self.branches == 1 or nodes is None or nodes <= steps:
            return self.draft(int(tokens[-1]), kv_len, steps, picks)
        siblings: list[list[tuple[int, float]]] = []
        chain = self.draft(int(tokens[-1]), kv_len, steps, picks, siblings)
        return DraftTree.with_siblings(chain, siblings, nodes)

    def draft(
        self,
        token: int,
        kv_len: int,
        steps: int,
        picks: DraftPicks | None = None,
        siblings: list[list[tuple[int, float]]] | None = None,
    ) -> tuple[int, ...]:
        """``steps`` picks starting from ``token`` at position ``kv_len`` (the backend's ``current_len()``) and the
        backend's hidden state at ``kv_len - 1`` (fused with the residual streams of that row when the folder has
        fused features): argmax picks, or coupled ones with ``picks``. With ``siblings`` (a list, appended to):
        per run, the head's ``branches`` likeliest tokens, each with the chance of reaching that depth and taking
        it (the product of the earlier picks' head probabilities times its own; 0 past a pick outside them)."""
        arrays, hidden = self._arrays, self.folder.hidden_size
        self._bind_kv(kv_len)
        self._positions_host[0, 0] = kv_len
        arrays.upload(self._positions, self._positions_host)
        row = self.backend.hidden_row(kv_len - 1)
        if self._fuse is not None:
            row = self._fuse.run(None, {"row": np.asarray(row, np.float32)[None]})[0][0]
        arrays.copy(self._embeds[0, 0, hidden:], row[:hidden])
        draft: list[int] = []
        reach = 1.0  # the chance the walk reaches the next depth (``siblings``)
        self.steps += 1
        for i in range(steps):
            arrays.copy(self._embeds[0, 0, :hidden], self._embedding[token])
            arrays.sync()
            try:
                self.session.run_with_iobinding(self._binding)
            except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
                raise DrafterError(f"onnxruntime failed running {self.folder.model_path}: {exc}") from exc
            self.runs += 1
            pick = self._head_picks.pick(self._logits, picks, draft)
            if siblings is not None:
                reach = self._rank_siblings(siblings, pick, reach)
            if pick is None:
                break
            token = pick
            draft.append(token)
            if i + 1 < steps:
                arrays.copy(self._embeds[0, 0, hidden:], self._state[0, 0])
        return tuple(draft)

    def _rank_siblings(self, siblings: list[list[tuple[int, float]]], pick: int | None, reach: float) -> float:
        """Append this run's ``branches`` likeliest tokens with their chances (``draft``'s docstring), ``reach``
        being the chance of reaching this depth; return the chance of reaching the next one through ``pick``."""
        ranked = self._head_picks.ranked(self._head_picks.host_row(self._logits), self.branches)
        siblings.append([(token, reach * p) for token, p in ranked])
        return reach * next((p for token, p in ranked if token == pick), 0.0)

    def _bind_kv(self, kv_len: int) -> None:
        """Bind every per-head KV input to the first ``kv_len`` positions of its head, in the backend's buffer."""
        if kv_len == self._bound_len:
            return
        shape = [1, 1, kv_len, self._head_size]
        for group, (keys, values) in zip(self.folder.groups, self.graph.kv_inputs, strict=True):
            for which, names in (("key", keys), ("value", values)):
                for head, name in enumerate(names):
                    address = self.backend.kv_pointer(group.layer, which, head)
                    self._binding.bind_input(
                        name, self._device, self._device_id, self.graph.float_dtype, shape, address
                    )
        self._bound_len = kv_len

    def __repr__(self) -> str:
        return f"SharedKvProposer({str(self.folder.path)!r}, max_draft={self.max_draft})"
