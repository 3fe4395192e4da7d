"""The shared-KV drafter on the slots of an ``OrtBatchBackend``: one drafter session for every slot, and per slot a
``SharedKvProposer`` bound to that slot alone. ``SlotDrafters`` is itself the proposer a request drafts with: it
drafts with the proposer bound to the slot its draft's context names (``DraftContext.slot``).

A shared-KV drafter reads its target's KV and last hidden state in place (``drafter.py``). In a batch the target of
a sequence is its slot: ``OrtBatchBackend.slot_target(slot)`` (a ``SlotTarget``: the slot's length, the hidden
states its last row kept, the address of each of its KV heads inside the batch buffers). ``SlotDrafters.for_slot``
gives the proposer bound to one slot, made on first use and kept (its IO binding and few-kilobyte buffers are the
slot's; the ONNX session, the graph's checks and the memory-mapped embedding table are shared), so binding a
sequence's draft to its slot costs nothing after the first time. Which sequence holds which slot is the batch
driver's business (``ortspec.batch_driver``); this module only knows slots.

Each ``propose`` runs the head for one sequence (one query row per step, as alone). Running it over every drafting
row at once would need one KV input per slot and head: not done.
"""

from __future__ import annotations

import os

from ortspec.core.proposers import DraftContext
from ortspec.core.tree import DraftTree

from .batch import OrtBatchBackend
from .drafter import DrafterFolder, SharedKvProposer


class SlotDrafters:
    """A drafter's ONNX session on ``batch``'s slots (see the module docstring), made from ``lone``, the drafter
    already bound to the lone slot (``batch.slot_target(batch.slots)``): its session, folder, ``max_draft``,
    ``stop_below`` and ``branches`` are every slot's (setting ``branches`` here sets it for every slot). Made by
    :meth:`open` or :meth:`sharing`."""

    def __init__(self, batch: OrtBatchBackend, lone: SharedKvProposer) -> None:
        self.batch = batch
        self.folder, self.session = lone.folder, lone.session
        self.max_draft, self.stop_below = lone.max_draft, lone.stop_below
        self._bound: dict[int, SharedKvProposer] = {batch.slots: lone}

    @property
    def branches(self) -> int:
        """The most candidates a tree draft holds at one depth (``SharedKvProposer.branches``; 1: chains)."""
        return self.lone().branches

    @branches.setter
    def branches(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"branches must be >= 1, got {value}")
        for proposer in self._bound.values():
            proposer.branches = int(value)

    @classmethod
    def open(
        cls,
        batch: OrtBatchBackend,
        folder_or_path: DrafterFolder | str | os.PathLike[str],
        *,
        threads: int | None = 1,
        stop_below: float | None = None,
        check_fingerprint: bool = True,
    ) -> SlotDrafters:
        """Open the drafter in ``folder_or_path`` for ``batch`` (``SharedKvProposer.open`` on its lone slot, with
        ``stop_below``, None: the folder's; the target checks run there, and raise ``DrafterError``)."""
        target = batch.slot_target(batch.slots)
        lone = SharedKvProposer.open(
            target, folder_or_path, threads=threads, stop_below=stop_below, check_fingerprint=check_fingerprint
        )
        return cls(batch, lone)

    @classmethod
    def sharing(cls, batch: OrtBatchBackend, drafter: SharedKvProposer) -> SlotDrafters:
        """The slots' drafters sharing ``drafter``'s session and settings (an Engine's drafter, bound to its own
        one-sequence backend, on the same model folder as ``batch``, where its target was checked)."""
        return cls(batch, _bound(batch, batch.slots, drafter))

    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        """The draft of the proposer bound to ``context.slot`` (``for_slot``); nothing for a context without a slot
        (the target holds no state for it)."""
        return () if context.slot is None else self.for_slot(context.slot).propose(context)

    def for_slot(self, slot: int) -> SharedKvProposer:
        """The proposer bound to ``slot`` (``batch.slots``: the lone slot); the same object every time.
        ``ValueError`` for a slot that is not the batch's."""
        proposer = self._bound.get(slot)
        if proposer is None:
            proposer = self._bound[slot] = _bound(self.batch, slot, self.lone())
        return proposer

    def lone(self) -> SharedKvProposer:
        """The proposer bound to the lone slot (an Engine opened for batching generates alone there)."""
        return self._bound[self.batch.slots]

    def __repr__(self) -> str:
        return f"SlotDrafters({str(self.folder.path)!r}, slots={self.batch.slots}, max_draft={self.max_draft})"


def _bound(batch: OrtBatchBackend, slot: int, like: SharedKvProposer) -> SharedKvProposer:
    """``like``'s session and settings bound to ``slot`` of ``batch`` (its target checked already)."""
    return SharedKvProposer(
        batch.slot_target(slot), like.folder, like.session, max_draft=like.max_draft, stop_below=like.stop_below,
        check_fingerprint=False, branches=like.branches,
    )  # fmt: skip
