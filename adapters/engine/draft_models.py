"""The draft model an Engine opens (``Engine.from_dir(target, draft_model=DIR)``, ``--draft-model DIR``): a second
model folder of the target's vocabulary, checked (:func:`check_same_vocabulary`) and opened as a batch backend with a
slot per target slot, behind a ``backends.draft_model.DraftModelProposer`` (``speculative="draft-model"``).

The vocabulary rule: a draft model's token ids must mean what the target's mean, or its drafts are guesses in another
language. So the draft folder's ``tokenizer.json`` must map every token to the same id as the target's (the model's
vocabulary and the added tokens, with the same special tokens), and the two folders must have the same logits width
(``genai_config.json``'s ``vocab_size``) and EOS ids; anything else is refused with ``VocabularyMismatch`` naming
what differs.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from ortspec.backends.base import Backend, BackendError, BatchBackend, OneSlot
from ortspec.backends.draft_model import DraftModelProposer
from ortspec.backends.onnx import BackendConfig, ModelFolder, ModelFolderError, OrtBatchBackend

# How many differing tokens a ``VocabularyMismatch`` message names.
SHOWN = 3


class VocabularyMismatch(ValueError):
    """A draft model folder whose vocabulary is not the target's (the message names what differs)."""


def _vocabulary(folder: ModelFolder) -> tuple[dict[str, int], dict[str, int]]:
    """``folder``'s tokenizer as ``(token -> id, special token -> id)``: the whole vocabulary, added tokens
    included, and the added tokens marked special. ``ModelFolderError`` when it is not a tokenizer.json."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(folder.tokenizer_path))
    except Exception as exc:  # the library raises a bare Exception for malformed files
        where = folder.tokenizer_path
        raise ModelFolderError(f"{where} is not a tokenizers tokenizer.json [tokenizers: {exc}]") from exc
    special = {added.content: i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    return dict(tok.get_vocab(with_added_tokens=True)), special


def _mapping_differences(what: str, target: dict[str, int], draft: dict[str, int]) -> list[str]:
    """The tokens of ``target`` or ``draft`` that the other lacks or gives another id, the first ``SHOWN`` named."""
    differing = sorted(
        (token for token in target.keys() | draft.keys() if target.get(token) != draft.get(token)),
        key=lambda token: (min(target.get(token, 1 << 62), draft.get(token, 1 << 62)), token),
    )
    if not differing:
        return []
    shown = ", ".join(f"{token!r}: {target.get(token)} vs {draft.get(token)}" for token in differing[:SHOWN])
    more = f" and {len(differing) - SHOWN} more" if len(differing) > SHOWN else ""
    return [f"{len(differing)} {what} differ (target id vs draft id; None: absent): {shown}{more}"]


def vocabulary_differences(target: ModelFolder, draft: ModelFolder) -> list[str]:
    """What makes ``draft``'s vocabulary differ from ``target``'s, one line each (empty when they are the same):
    the logits width, the tokenizer's size, any token whose id differs, the special tokens, the EOS ids."""
    out = []
    if target.vocab_size != draft.vocab_size:
        out.append(f"vocab_size (genai_config.json): target {target.vocab_size}, draft {draft.vocab_size}")
    (target_vocab, target_special), (draft_vocab, draft_special) = _vocabulary(target), _vocabulary(draft)
    if len(target_vocab) != len(draft_vocab):
        out.append(f"tokenizer.json size: target {len(target_vocab)} tokens, draft {len(draft_vocab)}")
    out += _mapping_differences("token ids", target_vocab, draft_vocab)
    out += _mapping_differences("special tokens", target_special, draft_special)
    if sorted(target.eos_token_ids) != sorted(draft.eos_token_ids):
        out.append(f"EOS ids: target {sorted(target.eos_token_ids)}, draft {sorted(draft.eos_token_ids)}")
    return out


def check_same_vocabulary(target: ModelFolder, draft: ModelFolder) -> None:
    """``VocabularyMismatch`` naming both folders and every difference unless ``draft`` has ``target``'s
    vocabulary (:func:`vocabulary_differences`)."""
    differences = vocabulary_differences(target, draft)
    if differences:
        raise VocabularyMismatch(
            f"the draft model {draft.path} does not have the vocabulary of {target.path}: " + "; ".join(differences)
        )


def draft_slots(batch: BatchBackend) -> int:
    """The draft slots an Engine's draft model needs: one per slot of the target's batch backend, and one more for
    its lone slot when it has one (``OrtBatchBackend.lone``: the slot an Engine measures on)."""
    return batch.slots + 1 if callable(getattr(batch, "lone", None)) else batch.slots


def open_draft_model(
    target: ModelFolder,
    path: str | os.PathLike[str],
    config: BackendConfig,
    slots: int,
) -> DraftModelProposer:
    """The draft model in folder ``path`` for the target ``target``: its vocabulary checked
    (``VocabularyMismatch``), opened with ``config`` (the target's, without its hidden features and tree rows, and
    with a thread pool that does not spin: its runs alternate with the target's on the same cores, and a pool left
    spinning after a draft step takes a core from the target's next pass) as
    an ``OrtBatchBackend`` of ``slots`` slots (:func:`draft_slots`), or, for one slot where it cannot run batched,
    as ``OneSlot`` over ``OrtBackend``; its drafts end after the target's EOS ids, and it feeds a context in rows of
    at most ``config.prefill_chunk`` tokens. ``ModelFolderError`` naming the file when the folder cannot be used."""
    from ortspec.backends.onnx import OrtBackend

    folder = ModelFolder.load(Path(path).expanduser())
    check_same_vocabulary(target, folder)
    # the target's reads are not the draft's; its pool sleeps as soon as a draft step ends
    config = attrs.evolve(config, hidden_features=(), tree_rows=False, allow_spinning=False)
    backend: BatchBackend
    try:
        backend = OrtBatchBackend.from_folder(folder, config, slots=slots)
    except ModelFolderError:
        raise
    except (BackendError, ValueError) as exc:
        if slots != 1:
            raise BackendError(f"the draft model {folder.path} cannot run {slots} sequences at once: {exc}") from exc
        one: Backend = OrtBackend.from_folder(folder, config)
        backend = OneSlot(one)
    chunk = config.prefill_chunk
    return DraftModelProposer(backend, target.vocab_size, stop_ids=target.eos_token_ids, prefill_chunk=chunk)
