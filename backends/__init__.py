"""Backends: the imperative device work behind the protocol in ``base``."""

from .base import Backend, BackendError, BatchBackend, BatchRow, OneSlot, RowPicks
from .fake import FakeBackend, FakeBatchBackend, FakeModel

__all__ = [
    "Backend",
    "BackendError",
    "BatchBackend",
    "BatchRow",
    "FakeBackend",
    "FakeBatchBackend",
    "FakeModel",
    "OneSlot",
    "RowPicks",
]
