"""Backends: the imperative device work behind the protocol in ``base``."""

from .base import Backend, BackendError
from .fake import FakeBackend, FakeModel

__all__ = ["Backend", "BackendError", "FakeBackend", "FakeModel"]
