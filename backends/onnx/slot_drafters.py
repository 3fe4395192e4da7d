"""The shared-KV drafter on the slots of an ``OrtBatchBackend``: one drafter session for every slot, and per slot a
``SharedKvProposer`` bound to that slot alone.

A shared-KV drafter reads its target's KV and last hidden state in place (``drafter.py``). In a batch the target of
a sequence is its slot: ``OrtBatchBackend.slot_target(slot)`` (a ``SlotTarget``: the slot's length, the hidden
states its last row kept, the address of each of its KV heads inside the batch buffers). ``SlotDrafters.for_slot``
gives the proposer bound to one slot, made on first use and kept (its IO binding and few-kilobyte buffers are the
slot's; the ONNX session, the graph's checks and the memory-mapped embedding table are shared), so binding a
sequence to its slot at admission costs nothing after the first time. Which sequence holds which slot is the batch
driver's business (``ortspec.batch_driver``, ``SlotProposer``); this module only knows slots.

Each ``propose`` runs the head for one sequence (one query row per step, as alone). Running it over every drafting
row at once would need one KV input per slot and head: not done.
"""

from __future__ import annotations

import os

from ..base import BackendError
from .batch import OrtBatchBackend
from .drafter import DrafterError, DrafterFolder, SharedKvProposer
from .session import execution_providers, make_session_options, open_session


class SlotDrafters:
    """A drafter folder's ONNX session on ``batch``'s slots (see the module docstring). ``max_draft``,
    ``stop_below`` and ``check_fingerprint`` as ``SharedKvProposer``; the target checks (hidden states, sizes, the
    fingerprint) run when this is made, on the lone slot's target, and raise ``DrafterError``."""

    def __init__(
        self,
        batch: OrtBatchBackend,
        folder: DrafterFolder,
        session,
        *,
        max_draft: int | None = None,
        stop_below: float = 0.0,
        check_fingerprint: bool = True,
    ) -> None:
        self.batch = batch
        self.folder = folder
        self.session = session
        self._bound: dict[int, SharedKvProposer] = {}
        lone = self._bind(batch.slots, max_draft, stop_below, check_fingerprint)
        self.max_draft, self.stop_below = lone.max_draft, lone.stop_below

    @classmethod
    def open(
        cls,
        batch: OrtBatchBackend,
        folder_or_path: DrafterFolder | str | os.PathLike[str],
        *,
        threads: int | None = 1,
        check_fingerprint: bool = True,
    ) -> SlotDrafters:
        """Open the drafter in ``folder_or_path`` for ``batch`` (``threads``: the head's intra-op threads, as
        ``SharedKvProposer.open``). ``DrafterError`` when the folder or graph breaks the contract or does not fit."""
        folder = folder_or_path if isinstance(folder_or_path, DrafterFolder) else DrafterFolder.load(folder_or_path)
        try:
            providers = execution_providers(batch.provider, batch.config.device_id)
            session = open_session(
                folder.model_path, providers=providers, session_options=make_session_options(threads=threads)
            )
        except BackendError as exc:
            raise DrafterError(str(exc)) from exc
        return cls(batch, folder, session, check_fingerprint=check_fingerprint)

    @classmethod
    def sharing(cls, batch: OrtBatchBackend, drafter: SharedKvProposer) -> SlotDrafters:
        """The slots' drafters sharing ``drafter``'s session and settings (an Engine's drafter, bound to its own
        one-sequence backend, on the same folder as ``batch``)."""
        return cls(
            batch,
            drafter.folder,
            drafter.session,
            max_draft=drafter.max_draft,
            stop_below=drafter.stop_below,
            check_fingerprint=False,  # checked when ``drafter`` was opened, on the same model folder
        )

    def for_slot(self, slot: int) -> SharedKvProposer:
        """The proposer bound to ``slot`` (``batch.slots``: the lone slot); the same object every time.
        ``ValueError`` for a slot that is not the batch's."""
        proposer = self._bound.get(slot)
        if proposer is None:
            proposer = self._bind(slot, self.max_draft, self.stop_below, False)
        return proposer

    def _bind(self, slot: int, max_draft: int | None, stop_below: float, check_fingerprint: bool) -> SharedKvProposer:
        target = self.batch.slot_target(slot)
        proposer = SharedKvProposer(
            target, self.folder, self.session, max_draft=max_draft, stop_below=stop_below,
            check_fingerprint=check_fingerprint,
        )  # fmt: skip
        self._bound[slot] = proposer
        return proposer

    def lone(self) -> SharedKvProposer:
        """The proposer bound to the lone slot (an Engine opened for batching generates alone there)."""
        return self._bound[self.batch.slots]

    def __repr__(self) -> str:
        return f"SlotDrafters({str(self.folder.path)!r}, slots={self.batch.slots}, max_draft={self.max_draft})"
