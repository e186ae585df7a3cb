"""The one place a storage URL becomes a Store: scheme → backend, with lazy imports."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .base import Store

SCHEMES_HELP = (
    "file:///abs/path (or a bare absolute path), memory://name, gs://bucket[/prefix], "
    "fsspec+<scheme>://... (forces fsspec), or any other scheme fsspec knows (s3://, az://, ...)"
)


def open_store(url: str, **options: Any) -> Store:
    """Open the backend for ``url``.

    ``options`` go to the backend: for gs:// ``options=GcsOptions(...)``, ``client=``, ``control_client=``;
    for memory:// ``rename=``; for fsspec URLs they are fsspec storage options.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"storage URL must be a non-empty string; supported: {SCHEMES_HELP}")
    if "://" not in url:
        if not url.startswith("/"):
            raise ValueError(f"bare path {url!r} must be absolute; supported: {SCHEMES_HELP}")
        url = f"file://{url}"
    scheme = url.split("://", 1)[0].lower()
    if scheme == "file":
        # Imported here: a backend and its libraries load only when a URL of its scheme is opened.
        from .filesystem import FileStore

        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must be file:///abs/path, got {url!r}")
        return FileStore(Path(parts.path), **options)
    if scheme == "memory":
        # Imported here: a backend and its libraries load only when a URL of its scheme is opened.
        from .memory import MemoryStore

        name = url.split("://", 1)[1].strip("/")
        return MemoryStore(name, **options)
    if scheme == "gs":
        # Imported here: a backend and its libraries load only when a URL of its scheme is opened.
        from .gcs import GcsStore

        rest = url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        return GcsStore(bucket, prefix.strip("/"), **options)
    if scheme.startswith("fsspec+"):
        url = url[len("fsspec+") :]
        scheme = scheme[len("fsspec+") :]
    try:
        # Imported here: a backend and its libraries load only when a URL of its scheme is opened.
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a dependency
        raise ValueError(f"unknown storage scheme {scheme!r} and fsspec is not installed") from e
    if scheme not in fsspec.available_protocols():
        raise ValueError(f"unknown storage scheme {scheme!r}; supported: {SCHEMES_HELP}")
    # Imported here: a backend and its libraries load only when a URL of its scheme is opened.
    from .fsspec_store import FsspecStore

    try:
        return FsspecStore(url, **options)
    except ImportError as e:
        raise ValueError(f"storage scheme {scheme!r} needs an extra package: {e}") from e
