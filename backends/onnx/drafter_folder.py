"""The shared-KV drafter's folder: the files ``ortspec train-drafter`` writes and ``SharedKvProposer`` opens
(``drafter.py`` has the graph's contract and the draft loop; docs/drafter.md the long form), read with checks.

* **Folder.** ``drafter.json`` (the metadata), the graph it names (``speculative.model``), the target's input
  embedding table ``speculative.input_embedding`` (raw little-endian float32 ``[V, H]``) and, for a reduced draft
  vocabulary, ``speculative.draft_to_target`` (raw little-endian int64 ``[V']``: the target id of each logits
  column). ``speculative.proposal_type`` is ``shared_kv``; ``backbone_hidden_size`` is H; ``vocab_size`` is V' (the
  width of the head's ``logits``); ``shared_kv`` lists the groups, each naming its ``target_layers`` (the last one
  listed is bound) and its input prefixes ``key_input``/``value_input``; ``io.kv_layout`` is ``per_kv_head``.
* **Fused features** (optional, EAGLE-3's): ``speculative.fused_features`` names ``layers`` (decoder layers, each
  >= 1), ``eps`` and ``file``: raw little-endian float32 ``[(1 + L) * H + 1, H]``, the fuse matrix then its bias
  row. The head's first step then reads ``fuse(rms(h), rms(r_l) for l in layers)`` (:class:`FeatureFusion`) in place
  of the final hidden state ``h``, where ``r_l`` is the residual stream entering layer ``l`` at the same position:
  the target must carry them in its hidden rows (``BackendConfig.hidden_features``).

Errors: a folder that breaks the contract raises ``DrafterError`` naming the file and the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .config import feature_layers

METADATA_NAME = "drafter.json"
KV_LAYOUT = "per_kv_head"


class DrafterError(ValueError):
    """A drafter folder or graph breaks the shared-KV contract, or does not fit the target it is used with."""


@attrs.frozen
class KvGroup:
    """One shared-KV group: the graph reads target layer ``layer`` (the last of ``target_layers``) through inputs
    ``<key_input>.<h>`` and ``<value_input>.<h>``, one per KV head ``h``."""

    name: str
    target_layers: tuple[int, ...]
    key_input: str
    value_input: str

    @property
    def layer(self) -> int:
        return self.target_layers[-1]

    def input_names(self, kv_heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (
            tuple(f"{self.key_input}.{h}" for h in range(kv_heads)),
            tuple(f"{self.value_input}.{h}" for h in range(kv_heads)),
        )


def check_stop_below(value: object) -> float:
    """``value`` as a drafter's ``stop_below``: a number in [0, 1) (a probability a pick may fall below; 0 never
    stops a draft), else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ValueError(f"stop_below must be a number in [0, 1), got {value!r}")
    return float(value)


class _Spec:
    """The ``speculative`` section of a folder's ``drafter.json``, read with checks that raise ``DrafterError``
    naming the file and the key."""

    def __init__(self, folder: Path, meta_path: Path, raw: Any) -> None:
        self.folder, self.meta_path, self.raw = folder, meta_path, raw
        spec = raw.get("speculative") if isinstance(raw, Mapping) else None
        if not isinstance(spec, Mapping):
            raise self.fail("missing section 'speculative' (expected an object)")
        self.spec: Mapping[str, Any] = spec

    @classmethod
    def read(cls, folder: Path) -> _Spec:
        meta_path = folder / METADATA_NAME
        if not meta_path.is_file():
            raise DrafterError(f"drafter folder {folder} has no {METADATA_NAME}")
        try:
            raw = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DrafterError(f"{meta_path} is not valid JSON: {exc}") from exc
        return cls(folder, meta_path, raw)

    def fail(self, message: str) -> DrafterError:
        return DrafterError(f"{self.meta_path}: {message}")

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(f"speculative.{key} must be an integer >= 1, got {value!r}")
        return value

    def stop_below(self) -> float:
        """``ortspec.stop_below``: the head's confidence below which its drafts stop (0 when absent: never)."""
        section = self.raw.get("ortspec")
        value = section.get("stop_below", 0.0) if isinstance(section, Mapping) else 0.0
        try:
            return check_stop_below(value)
        except ValueError as exc:
            raise self.fail(f"ortspec.{exc}") from None

    def text(self, key: str, default: str | None = None) -> str:
        value = self.spec.get(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(f"speculative.{key} must be a non-empty string, got {value!r}")
        return value

    def file(self, key: str) -> Path:
        name = self.text(key)
        target = self.folder / name
        if not target.is_file():
            raise self.fail(f"speculative.{key} names {name}, which is not a file in {self.folder}")
        return target

    def draft_to_target(self, vocab: int, target_vocab: int, embedding_path: Path) -> np.ndarray | None:
        """The ``draft_to_target`` map (int64 ``[vocab]``, distinct ids in ``[0, target_vocab)``), or None for the
        identity (then ``vocab`` must be the embedding table's ``target_vocab`` rows)."""
        if self.spec.get("draft_to_target") is None:
            if vocab != target_vocab:
                raise self.fail(
                    f"speculative.vocab_size = {vocab} differs from the {target_vocab} rows of {embedding_path.name} "
                    "and there is no draft_to_target map"
                )
            return None
        map_path = self.file("draft_to_target")
        if map_path.stat().st_size != 8 * vocab:
            raise self.fail(f"{map_path.name} holds {map_path.stat().st_size} bytes; expected {vocab} int64 ids")
        mapping = np.fromfile(map_path, dtype="<i8").astype(np.int64)
        if mapping.min() < 0 or mapping.max() >= target_vocab:
            raise self.fail(f"{map_path.name} holds ids outside the target vocabulary [0, {target_vocab})")
        if len(np.unique(mapping)) != len(mapping):
            raise self.fail(f"{map_path.name} maps two draft ids to the same target id")
        return mapping

    def fusion(self, hidden: int) -> FeatureFusion | None:
        """``speculative.fused_features`` (module docstring), or None when absent."""
        section = self.spec.get("fused_features")
        if section is None:
            return None
        where = "speculative.fused_features"
        layers = section.get("layers") if isinstance(section, Mapping) else None
        try:
            if not isinstance(layers, list) or not layers:
                raise ValueError
            feature_layers(layers)  # the one rule for feature layers
        except ValueError:
            raise self.fail(
                f"{where}.layers must be a non-empty list of distinct decoder layers >= 1, got {layers!r}"
            ) from None
        eps = section.get("eps")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
            raise self.fail(f"{where}.eps must be a number in (0, 1), got {eps!r}")
        name = section.get("file")
        path = self.folder / name if isinstance(name, str) and name else None
        if path is None or not path.is_file():
            raise self.fail(f"{where}.file must name a file in {self.folder}, got {name!r}")
        rows = (1 + len(layers)) * hidden
        if path.stat().st_size != 4 * (rows + 1) * hidden:
            raise self.fail(
                f"{path.name} holds {path.stat().st_size} bytes; expected float32 [{rows + 1}, {hidden}] (the fuse "
                f"matrix over {1 + len(layers)} parts of backbone_hidden_size, then its bias)"
            )
        table = np.fromfile(path, dtype="<f4").reshape(rows + 1, hidden).astype(np.float32)
        if not np.isfinite(table).all():
            raise self.fail(f"{path.name} holds values that are not finite")
        return FeatureFusion(tuple(layers), float(eps), table[:rows], table[rows], path)

    def check_io(self) -> None:
        """``speculative.io``: embeddings in, the target's KV shared, one input per KV head."""
        io = self.spec.get("io", {})
        if not isinstance(io, Mapping):
            raise self.fail("speculative.io must be an object")
        if io.get("sequence_source", "inputs_embeds") != "inputs_embeds":
            raise self.fail(
                f"speculative.io.sequence_source must be 'inputs_embeds', got {io.get('sequence_source')!r}"
            )
        if io.get("kv_ownership", "shared") != "shared":
            raise self.fail(f"speculative.io.kv_ownership must be 'shared', got {io.get('kv_ownership')!r}")
        if io.get("kv_layout", KV_LAYOUT) != KV_LAYOUT:
            raise self.fail(
                f"speculative.io.kv_layout is {io.get('kv_layout')!r}; ortspec binds the target's cache in place, "
                f"which needs one input per KV head ('{KV_LAYOUT}')"
            )

    def groups(self) -> tuple[KvGroup, ...]:
        """``speculative.shared_kv``: one :class:`KvGroup` per entry."""
        raw_groups = self.spec.get("shared_kv")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise self.fail("speculative.shared_kv must be a non-empty list of groups")
        groups = []
        for i, g in enumerate(raw_groups):
            where = f"speculative.shared_kv[{i}]"
            if not isinstance(g, Mapping) or not isinstance(g.get("name"), str) or not g["name"]:
                raise self.fail(f"{where} must be an object with a non-empty 'name'")
            layers = g.get("target_layers")
            if (
                not isinstance(layers, list)
                or not layers
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
            ):
                raise self.fail(f"{where}.target_layers must be a non-empty list of layer indices, got {layers!r}")
            name = g["name"]
            key_input = g.get("key_input") or f"shared_kv.{name}.key"
            value_input = g.get("value_input") or f"shared_kv.{name}.value"
            groups.append(KvGroup(name, tuple(layers), str(key_input), str(value_input)))
        return tuple(groups)


@attrs.frozen(eq=False)
class FeatureFusion:
    """A head's fused first-step input: ``apply(row)`` maps a target hidden row ``[(1 + L) * H]`` (the final hidden
    state, then the residual stream entering each of ``layers``) to ``[H]``: every part RMS-normalised (``eps``, no
    weight), concatenated, times ``weight`` ``[(1 + L) * H, H]``, plus ``bias`` ``[H]``; float32 on the host."""

    layers: tuple[int, ...]
    eps: float
    weight: np.ndarray
    bias: np.ndarray
    path: Path | None = None  # the file it was read from (a drafter folder's ``fused_features.file``), for messages

    def apply(self, row: np.ndarray) -> np.ndarray:
        """The definition, in numpy (its matrix product may start BLAS threads: a drafter runs :meth:`model` on
        onnxruntime's one thread instead, so nothing spins against the target's threads)."""
        parts = np.asarray(row, np.float32).reshape(1 + len(self.layers), -1)
        normed = parts / np.sqrt(np.mean(np.square(parts), axis=1, keepdims=True) + self.eps)
        return (normed.reshape(-1) @ self.weight + self.bias).astype(np.float32)

    def model(self) -> bytes:
        """:meth:`apply` as a serialized ONNX model: input ``row`` float32 ``[1, (1 + L) * H]``, output ``state``
        float32 ``[1, H]``."""
        from onnx import TensorProto, helper, numpy_helper

        parts, hidden = 1 + len(self.layers), int(self.bias.shape[0])
        constants: dict[str, np.ndarray] = {
            "parts_shape": np.array([parts, hidden], np.int64),
            "row_shape": np.array([1, parts * hidden], np.int64),
            "eps": np.array(self.eps, np.float32),
            "weight": np.ascontiguousarray(self.weight, np.float32),
            "bias": np.ascontiguousarray(self.bias, np.float32),
        }
        nodes = [
            helper.make_node("Reshape", ["row", "parts_shape"], ["parts"]),
            helper.make_node("Mul", ["parts", "parts"], ["squares"]),
            helper.make_node("ReduceMean", ["squares"], ["mean"], axes=[1], keepdims=1),
            helper.make_node("Add", ["mean", "eps"], ["variance"]),
            helper.make_node("Sqrt", ["variance"], ["scale"]),
            helper.make_node("Div", ["parts", "scale"], ["normed"]),
            helper.make_node("Reshape", ["normed", "row_shape"], ["flat"]),
            helper.make_node("MatMul", ["flat", "weight"], ["product"]),
            helper.make_node("Add", ["product", "bias"], ["state"]),
        ]
        graph = helper.make_graph(
            nodes,
            "fuse",
            [helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, parts * hidden])],
            [helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, hidden])],
            [numpy_helper.from_array(value, name) for name, value in constants.items()],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model.SerializeToString()


@attrs.frozen(eq=False)
class DrafterFolder:
    """A validated drafter folder (see the module docstring); :meth:`load` makes one.

    ``hidden_size`` is H, ``vocab_size`` the width of the head's logits (V'), ``target_vocab`` the rows of the
    embedding table (the target's vocabulary), ``draft_to_target`` the int64 ``[V']`` map (None: identity, V' = V).
    ``stop_below`` (``ortspec.stop_below``, default 0): the probability below which a pick of the head is not
    drafted, the default of a ``SharedKvProposer`` opened on it (``train-drafter`` records the recipe's; a draft
    token that unlikely is seldom accepted and costs a head step and a verify row). ``metadata`` is the whole
    parsed ``drafter.json``. ``fusion``: the head's fused features (None: it reads the final hidden state)."""

    path: Path
    model_path: Path
    embedding_path: Path
    num_speculative_tokens: int
    hidden_size: int
    vocab_size: int
    target_vocab: int
    draft_to_target: np.ndarray | None
    groups: tuple[KvGroup, ...]
    logits_name: str
    projected_state_name: str
    stop_below: float
    metadata: Mapping[str, Any]
    fusion: FeatureFusion | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DrafterFolder:
        """Read and validate ``path/drafter.json`` and the files it names (sizes, ids); ``DrafterError`` names the
        file and the key at fault."""
        spec = _Spec.read(Path(path).expanduser())
        fields = spec.spec
        proposal = str(fields.get("proposal_type", fields.get("method", ""))).lower().replace("-", "_")
        if proposal != "shared_kv":
            raise spec.fail(f"speculative.proposal_type must be 'shared_kv', got {fields.get('proposal_type')!r}")
        hidden = spec.integer("backbone_hidden_size")
        vocab = spec.integer("vocab_size")
        steps = spec.integer("num_speculative_tokens", 4)
        model_path = spec.file("model")
        embedding_path = spec.file("input_embedding")
        size = embedding_path.stat().st_size
        if size % (4 * hidden):
            raise spec.fail(
                f"{embedding_path.name} holds {size} bytes, not a whole number of float32 rows of "
                f"backbone_hidden_size = {hidden}"
            )
        target_vocab = size // (4 * hidden)
        mapping = spec.draft_to_target(vocab, target_vocab, embedding_path)
        spec.check_io()
        return cls(
            path=spec.folder,
            model_path=model_path,
            embedding_path=embedding_path,
            num_speculative_tokens=steps,
            hidden_size=hidden,
            vocab_size=vocab,
            target_vocab=target_vocab,
            draft_to_target=mapping,
            groups=spec.groups(),
            logits_name=spec.text("logits_output", "logits"),
            projected_state_name=spec.text("projected_state_output", "projected_state"),
            stop_below=spec.stop_below(),
            metadata=spec.raw,
            fusion=spec.fusion(hidden),
        )

    def embedding(self) -> np.ndarray:
        """The target's input-embedding table, ``[target_vocab, hidden_size]`` float32, memory-mapped read-only."""
        return np.memmap(self.embedding_path, dtype="<f4", mode="r", shape=(self.target_vocab, self.hidden_size))

    @property
    def fingerprint(self) -> Mapping[str, Any] | None:
        """The target fingerprint recorded at training (``ortspec.target`` in the metadata), if any."""
        value = (self.metadata.get("ortspec") or {}).get("target")
        return value if isinstance(value, Mapping) else None
