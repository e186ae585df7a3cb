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

__all__ = [
    "Capabilities",
    "ObjectInfo",
    "RetryPolicy",
    "StorageError",
    "Store",
    "UnsupportedOperation",
    "call_with_retry",
    "is_retryable",
    "open_store",
]
