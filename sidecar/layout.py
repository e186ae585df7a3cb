"""The on-disk contract of a step: file and directory names, the traversal guard, the versioned manifest.

What a step looks like on disk is decided here; the modules that act on it are its siblings:
:mod:`sidecar.commit` (the atomic commit and GC), :mod:`sidecar.spares` (the pool of recycled tmpfs pages),
:mod:`sidecar.checksums` (crc32c and verified reads).

A host's local directory (the RAM disk) looks like::

    <root>/steps/<N>/MANIFEST.json      committed native step N of this host (rank)
    <root>/steps/<N>/<leaf>.<shard>.bin  one file per saved shard
    <root>/steps/.tmp-<N>-<nonce>/      a step being written (never read; flock-ed by its live writer)
    <root>/steps/.trash-<N>-<nonce>/    a step being deleted (renamed out of sight first)
    <root>/peer/<rank>/<N>/...          copies of other ranks' steps, same layout
    <root>/fetch/.tmp-<N>-<nonce>/      files of other ranks' steps fetched for one restore (never a step:
                                        no manifest; flock-ed by the reading process, removed after use)
    <root>/.spare/<size>-<nonce>        files of deleted steps kept for their tmpfs pages (never read)
    <root>/parity/<N>/<digest>/...      erasure-coded parity this host holds of step N (the replicator's:
                                        replicator/erasure/holder.py owns those names)

A step directory is visible only once complete (see :mod:`sidecar.commit`). A directory without
``MANIFEST.json`` is not a step. The manifest carries a sha256 of its own canonical encoding
(``manifest_sha256``), checked on every parse: a flipped value is a corrupt copy.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from sidecar import saves

log = logging.getLogger(__name__)

# 2: the manifest carries ``manifest_sha256`` over its canonical encoding. Version 1 manifests had no
# checksum and are refused (a flipped value in one would be restored silently as data). Per-block crc32cs
# of shards (``ShardEntry.block_crc32c``) are optional keys within version 2: readers without them ignore
# them (the checksum covers the dict as read), and shards without them are read whole.
FORMAT_VERSION = 2
MANIFEST_NAME = "MANIFEST.json"
MANIFEST_CHECKSUM_KEY = "manifest_sha256"
STEPS_DIR = "steps"
PEER_DIR = "peer"
FETCH_DIR = "fetch"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
CONTROL_SOCKET = "replicator.sock"  # the host replicator's local control socket, in the root
KIND_NATIVE = "native"
KIND_ORBAX = "orbax"
STEP_PATTERN = r"(0|[1-9][0-9]{0,17})"  # THE step-name rule: a plain decimal, no sign or leading zero
_STEP_RE = re.compile(f"^{STEP_PATTERN}$")
# THE job-name rule (a job name becomes file names and a bucket prefix): 1-128 of letters, digits, ".",
# "_", "-", starting with a letter or digit. Kubernetes manifests further need a DNS label.
JOB_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_JOB_RE = re.compile(f"^{JOB_PATTERN}$")
# Largest manifest we agree to parse: a guard against a hostile or corrupt peer.
MAX_MANIFEST_BYTES = 256 << 20
# Manifests up to this size are kept parsed by parse_manifest (32 of them at most).
PARSED_CACHE_MAX_BYTES = 256 << 10
# Path components of one file name inside a step (Orbax's deepest are ~5): deeper names are refused, not
# walked (Path.mkdir(parents=True) recurses once per missing component: 2,000 raised RecursionError).
MAX_NAME_COMPONENTS = 64


class ManifestError(ValueError):
    """A manifest is malformed, of an unknown version, or inconsistent with its directory."""


class ManifestChecksumError(ManifestError):
    """A manifest's bytes do not match its own ``manifest_sha256``: a corrupt or tampered copy."""


def _canonical_json(d: Any) -> bytes:
    """The canonical encoding the manifest checksum covers: sorted keys, no spaces, ASCII."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_checksum(body: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical encoding of a manifest dict without its checksum key."""
    return hashlib.sha256(_canonical_json({k: v for k, v in body.items() if k != MANIFEST_CHECKSUM_KEY})).hexdigest()


def seal_manifest_dict(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with ``manifest_sha256`` (re)computed: for tools and tests that build manifests by hand."""
    out = {k: v for k, v in d.items() if k != MANIFEST_CHECKSUM_KEY}
    out[MANIFEST_CHECKSUM_KEY] = manifest_checksum(out)
    return out


# --------------------------------------------------------------------------- names and paths


def step_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return str(step)


def check_job_name(job: Any, what: str = "job name") -> str:
    """``job`` if it follows the job-name rule (:data:`JOB_PATTERN`); a ValueError starting with ``what`` if not."""
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(f"{what} must match {JOB_PATTERN} (letters, digits, '.', '_', '-'), got {job!r}")
    return job


def parse_step_name(name: str) -> int | None:
    """The step number a directory name denotes, or None when it is not a step name."""
    return int(name) if _STEP_RE.match(name) else None


def safe_relpath(name: str) -> PurePosixPath:
    """Validate a peer- or manifest-supplied relative file name.

    Rejects empty names, absolute paths, ``..`` and ``.`` components, backslashes, NUL bytes, names over
    4096 characters and names of more than ``MAX_NAME_COMPONENTS`` components.
    """
    if not isinstance(name, str) or not name or len(name) > 4096:
        raise ValueError(f"invalid file name {name!r}")
    if "\x00" in name or "\\" in name:
        raise ValueError(f"invalid character in file name {name!r}")
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("/"):
        raise ValueError(f"absolute path not allowed: {name!r}")
    parts = name.split("/")
    if any(part in ("..", ".", "") for part in parts):
        raise ValueError(f"path component '..' or '.' or empty not allowed: {name!r}")
    if len(parts) > MAX_NAME_COMPONENTS:
        raise ValueError(f"file name of {len(parts)} path components (at most {MAX_NAME_COMPONENTS}): "
                         f"{name[:80]!r}...")
    return p


def resolve_under(root: Path, name: str) -> Path:
    """Join a validated relative name to ``root`` and make sure no symlink leads outside it."""
    rel = safe_relpath(name)
    root_real = Path(os.path.realpath(root))
    target = Path(os.path.realpath(root_real / rel))
    if target != root_real and root_real not in target.parents:
        raise ValueError(f"path {name!r} escapes {root}")
    return target


def steps_dir(root: Path) -> Path:
    return Path(root) / STEPS_DIR


def control_socket(root: Path | str) -> Path:
    """The Unix socket on which the host's replicator takes commit notifications and status requests."""
    return Path(root) / CONTROL_SOCKET


def peer_dir(root: Path, rank: int) -> Path:
    return Path(root) / PEER_DIR / str(int(rank))


def fetch_dir(root: Path) -> Path:
    """Where a reader's scratch directories of fetched files live (see the module docstring)."""
    return Path(root) / FETCH_DIR


def check_fetch_dir(root: Path, rel: str) -> Path:
    """The scratch directory ``rel`` (relative to ``root``) names, if it is one: a ``.tmp-*`` directory
    directly under :func:`fetch_dir`, no symlink on the way. ValueError otherwise (nothing is written)."""
    path = resolve_under(root, rel)
    parent = Path(os.path.realpath(fetch_dir(root)))
    if path.parent != parent or not path.name.startswith(TMP_PREFIX) or not path.is_dir():
        raise ValueError(f"{rel!r} is not a fetch directory under {fetch_dir(root)}")
    return path


# --------------------------------------------------------------------------- manifest


def _as_index(value: Any) -> tuple[tuple[int, int], ...]:
    out = []
    for pair in value:
        start, stop = (int(v) for v in pair)
        if start < 0 or stop < start:
            raise ManifestError(f"bad shard index {value!r}")
        out.append((start, stop))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a step, as the replicator sees it: relative name, size and crc32c."""

    name: str
    size: int
    crc32c: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "crc32c": self.crc32c}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileEntry:
        name = str(d["name"])
        safe_relpath(name)
        size, crc = int(d["size"]), int(d["crc32c"])
        if size < 0 or not 0 <= crc < 2**32:
            raise ManifestError(f"bad size or crc32c for {name!r}")
        return cls(name, size, crc)


@dataclasses.dataclass(frozen=True)
class FilePiece:
    """Bytes [offset, offset + length) of file ``name`` of a step, and their crc32c: what a restore onto
    another mesh fetches of a saved shard when it needs only some of its rows (the blocks covering them;
    the crc32c combined from the manifest's block crc32cs)."""

    name: str
    offset: int
    length: int
    crc32c: int


def check_pieces(files: Sequence[FileEntry], pieces: Sequence[FilePiece]) -> None:
    """ValueError unless every piece names one of ``files``, is non-empty and within it, and starts past the
    end of the previous piece of the same file (the order they are sent and written in)."""
    sizes = {f.name: f.size for f in files}
    ends: dict[str, int] = {}
    for pc in pieces:
        if pc.name not in sizes:
            raise ValueError(f"piece of {pc.name!r}, which is not among the files asked for")
        if pc.length <= 0 or pc.offset < ends.get(pc.name, 0) or pc.offset + pc.length > sizes[pc.name]:
            raise ValueError(f"piece {pc.offset}+{pc.length} of {pc.name!r} (size {sizes[pc.name]}) is empty, "
                             f"out of the file or not after the previous piece of it")
        if not 0 <= pc.crc32c < 2**32:
            raise ValueError(f"bad crc32c for a piece of {pc.name!r}")
        ends[pc.name] = pc.offset + pc.length


# Shards larger than this also get a crc32c per block of this size (``ShardEntry.block_crc32c``): a restore
# onto another mesh that needs part of a saved shard reads and verifies only the blocks covering it.
BLOCK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One saved shard: its global index ([start, stop) per dimension) and where its bytes are.

    ``block_size``/``block_crc32c``: when set, the crc32c of each ``block_size`` bytes of the shard (from its
    ``offset``; the last block may be shorter), so that a part of it can be read verified. Manifests written
    before blocks existed have none: their shards are read whole."""

    index: tuple[tuple[int, int], ...]
    file: str
    offset: int
    length: int
    crc32c: int
    block_size: int = 0
    block_crc32c: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "index": [list(p) for p in self.index],
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32c": self.crc32c,
        }
        if self.block_size:
            d["block_size"] = self.block_size
            d["block_crc32c"] = list(self.block_crc32c)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardEntry:
        f = str(d["file"])
        safe_relpath(f)
        length = int(d["length"])
        bs = int(d.get("block_size", 0))
        blocks = tuple(int(c) for c in d.get("block_crc32c", ()))
        if bs < 0 or (bs == 0 and blocks) or (bs and len(blocks) != -(-length // bs)) \
                or any(not 0 <= c < 2**32 for c in blocks):
            raise ManifestError(f"bad block crc32c list for shard in {f!r}")
        return cls(_as_index(d["index"]), f, int(d["offset"]), length, int(d["crc32c"]), bs, blocks)


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
    """An array leaf: pytree path, global shape, dtype name and the shards this host saved.

    Typed PRNG key arrays are saved as their ``uint32`` key data; ``key_impl`` names the PRNG
    implementation and ``global_shape`` is the shape of the key data (key shape + impl's trailing dims).
    """

    path: str
    global_shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardEntry, ...]
    key_impl: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "key_impl": self.key_impl,
            "shards": [s.to_dict() for s in self.shards],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArrayEntry:
        shape = tuple(int(v) for v in d["global_shape"])
        shards = tuple(ShardEntry.from_dict(s) for s in d["shards"])
        for s in shards:
            if len(s.index) != len(shape) or any(stop > n for (_, stop), n in zip(s.index, shape, strict=True)):
                raise ManifestError(f"shard index {s.index} outside shape {shape} of {d['path']!r}")
        return cls(str(d["path"]), shape, str(d["dtype"]), shards, d.get("key_impl"))


_VALUE_TYPES = (int, float, str, bool, type(None))


@dataclasses.dataclass(frozen=True)
class ValueEntry:
    """A non-array leaf (int, float, str, bool or None), stored in the manifest itself."""

    path: str
    value: int | float | str | bool | None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "value": self.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ValueEntry:
        v = d["value"]
        if not isinstance(v, _VALUE_TYPES):
            raise ManifestError(f"unsupported value type for {d['path']!r}")
        return cls(str(d["path"]), v)


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """Versioned manifest of one rank's data for one step."""

    job: str
    step: int
    rank: int
    nodes: int
    files: tuple[FileEntry, ...]
    arrays: tuple[ArrayEntry, ...] = ()
    values: tuple[ValueEntry, ...] = ()
    kind: str = KIND_NATIVE
    format_version: int = FORMAT_VERSION
    # Set by whoever knows a better identity than the file list (e.g. Orbax steps, whose replicas
    # differ in file names but not in OCDBT key/values); then it *is* the content hash.
    content_id: str = ""
    # Elastic training: the ranks that saved this step (the active hosts at save; empty = every rank of
    # ``nodes``) and the save's generation (the controller's clock at that save; a newer save of the same
    # step number after a rollback supersedes an older one). Both are the same on every host of one save.
    savers: tuple[int, ...] = ()
    generation: int = 0

    @property
    def expected_ranks(self) -> tuple[int, ...]:
        """The ranks whose data together make up this step."""
        return self.savers or tuple(range(self.nodes))

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def content_hash(self) -> str:
        """Hash of what this rank holds, independent of job, rank and file names.

        Two data-parallel replicas holding the same shards have the same content hash, so the
        replicator can verify a replica by comparing hashes instead of copying bytes.
        """
        if self.content_id:
            return self.content_id
        h = hashlib.sha256()
        if self.arrays:
            for a in self.arrays:
                h.update(json.dumps([a.path, a.global_shape, a.dtype, a.key_impl]).encode())
                for s in a.shards:
                    h.update(json.dumps([s.index, s.length, s.crc32c]).encode())
            h.update(json.dumps([v.to_dict() for v in self.values], sort_keys=True).encode())
            if self.savers or self.generation:
                h.update(json.dumps([list(self.savers), self.generation]).encode())
        else:
            for f in sorted(self.files, key=lambda f: f.name):
                h.update(json.dumps([f.name, f.size, f.crc32c]).encode())
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The manifest as written, ``manifest_sha256`` included."""
        return seal_manifest_dict(self._body())

    def _body(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "kind": self.kind,
            "job": self.job,
            "step": self.step,
            "rank": self.rank,
            "nodes": self.nodes,
            "files": [f.to_dict() for f in self.files],
            "arrays": [a.to_dict() for a in self.arrays],
            "values": [v.to_dict() for v in self.values],
            "content_id": self.content_id,
            **({"savers": list(self.savers)} if self.savers else {}),
            **({"generation": self.generation} if self.generation else {}),
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepManifest:
        try:
            version = int(d["format_version"])
            if version != FORMAT_VERSION:
                raise ManifestError(f"unsupported manifest format_version {version} (this code reads "
                                    f"{FORMAT_VERSION}; version 1 manifests carry no checksum)")
            files = tuple(FileEntry.from_dict(f) for f in d["files"])
            names = [f.name for f in files]
            if len(set(names)) != len(names):
                raise ManifestError("duplicate file names in manifest")
            m = cls(
                job=str(d["job"]),
                step=int(d["step"]),
                rank=int(d["rank"]),
                nodes=int(d["nodes"]),
                files=files,
                arrays=tuple(ArrayEntry.from_dict(a) for a in d.get("arrays", ())),
                values=tuple(ValueEntry.from_dict(v) for v in d.get("values", ())),
                kind=str(d.get("kind", KIND_NATIVE)),
                format_version=version,
                content_id=str(d.get("content_id", "")),
                savers=tuple(sorted({int(r) for r in d.get("savers", ())})),
                generation=int(d.get("generation", 0)),
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: int(Infinity)
            raise ManifestError(f"malformed manifest: {e}") from e
        if m.step < 0 or not 0 <= m.rank < max(m.nodes, 1):
            raise ManifestError(f"bad step/rank/nodes {m.step}/{m.rank}/{m.nodes}")
        if m.savers and (m.rank not in m.savers or not 0 <= m.savers[0] <= m.savers[-1] < m.nodes):
            raise ManifestError(f"bad savers {list(m.savers)} for rank {m.rank} of {m.nodes}")
        if m.generation < 0:
            raise ManifestError(f"bad generation {m.generation}")
        known = set(names)
        for a in m.arrays:
            for s in a.shards:
                if s.file not in known:
                    raise ManifestError(f"shard of {a.path!r} refers to unlisted file {s.file!r}")
        # Checked over the dict as read (not as re-encoded), so any changed, added or dropped key counts.
        recorded = d.get(MANIFEST_CHECKSUM_KEY)
        actual = manifest_checksum(d)
        if not isinstance(recorded, str) or recorded != actual:
            raise ManifestChecksumError(
                f"manifest of rank {m.rank} step {m.step} fails its checksum (recorded "
                f"{str(recorded)[:16]!r}, computed {actual[:16]!r}): corrupt or tampered copy"
            )
        return m

    @classmethod
    def from_json(cls, data: bytes) -> StepManifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        except RecursionError:  # absurdly deep nesting: no manifest looks like that
            raise ManifestError("manifest nests too deeply") from None
        if not isinstance(d, dict):
            raise ManifestError("manifest is not a JSON object")
        return cls.from_dict(d)


def read_manifest(step_dir: Path) -> StepManifest:
    """Read and validate ``step_dir/MANIFEST.json``; FileNotFoundError when the step is not committed."""
    path = Path(step_dir) / MANIFEST_NAME
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    return parse_manifest(data)


def parse_manifest(data: bytes) -> StepManifest:
    """:meth:`StepManifest.from_json`, remembered by the exact bytes for manifests up to
    ``PARSED_CACHE_MAX_BYTES`` (a StepManifest is immutable; errors are not kept): a restore reads the same
    manifest once per rank that can see it, and parsing is most of a small step's restore. Larger ones are
    parsed each time, so the cache holds at most a few MiB in a long-running daemon."""
    if len(data) <= PARSED_CACHE_MAX_BYTES:
        return _parse_cached(data)
    return StepManifest.from_json(data)


@functools.lru_cache(maxsize=32)
def _parse_cached(data: bytes) -> StepManifest:
    return StepManifest.from_json(data)


def current_copies(found: Sequence[tuple[Path, StepManifest]], step: int) -> list[tuple[Path, StepManifest]]:
    """The copies of ``step`` in ``found`` (step dir, its manifest) that belong to its newest save: copies of
    an older generation are an abandoned save (the job rolled back and saved the step again) and are left out,
    with a line in the log. ManifestError when a copy holds another step."""
    newest = saves.newest_generation(m.generation for _, m in found)
    kept = []
    for d, m in found:
        if m.step != step:
            raise ManifestError(f"{d} holds step {m.step}, expected {step}")
        if m.generation < newest:
            log.info("ignoring %s: an abandoned save of step %d (a newer one exists)", d, step)
            continue
        kept.append((d, m))
    return kept


def shard_file_name(leaf_index: int, shard_index: int) -> str:
    return f"{leaf_index}.{shard_index}.bin"


def index_to_slices(index: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)
