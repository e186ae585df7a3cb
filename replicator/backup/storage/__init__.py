"""Storage backends of the bucket (backup) tier behind one small interface; open one with open_store(url)."""

from .base import (
    Capabilities,
    ObjectInfo,
    RetryPolicy,
    StorageError,
    Store,
    UnsupportedOperation,
    call_with_retry,
    is_retryable,
)
from .factory import open_store
from .gcs import GcsOptions  # light: google libraries are imported lazily inside gcs.py

__all__ = [
    "Capabilities",
    "GcsOptions",
    "ObjectInfo",
    "RetryPolicy",
    "StorageError",
    "Store",
    "UnsupportedOperation",
    "call_with_retry",
    "is_retryable",
    "open_store",
]
