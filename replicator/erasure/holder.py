"""A host's parity on its RAM disk (erasure coding, issue #35): written whole or not at all, listed, read, deleted.

Layout (beside the steps of :mod:`sidecar.layout`)::

    <root>/parity/<N>/<digest>/GROUP.json        this holder's record: the code group and its partial manifest
    <root>/parity/<N>/<digest>/r<rotation>-p<j>  one parity shard (rotation, parity index j) of step N
    <root>/parity/<N>/.tmp-<N>-<nonce>/          parity being written (flock-ed by its live writer)
    <root>/parity/<N>/.trash-<digest>-<nonce>/   parity being deleted (renamed out of sight first)

``<digest>`` is the code group's :meth:`~replicator.erasure.wire.CodeGroupSpec.digest`: equal exactly when K, M,
the members and their data are, so a re-saved step's parity never passes for the new data's. ``GROUP.json``
is written last and is the commit marker: a directory without it is not parity (and is never under a
digest name: the temporary directory is renamed into place once complete, :func:`sidecar.commit.publish_dir`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from replicator.erasure.group import GroupManifest, ParityStripe
from replicator.erasure.wire import DIGEST_PREFIX, CodeGroupSpec
from sidecar import commit, layout, spares
from sidecar.checksums import ChecksumError, crc32c, crc32c_extend
from sidecar.layout import FileEntry

log = logging.getLogger(__name__)

PARITY_DIR = "parity"
RECORD_NAME = "GROUP.json"
RECORD_FORMAT_VERSION = 1
# Largest GROUP.json we parse (a 10 GiB step at 4+2 in 1 MiB stripes: ~92k crc32cs of one holder's rows).
MAX_RECORD_BYTES = 64 << 20
_DIGEST_RE = re.compile(f"^{re.escape(DIGEST_PREFIX)}[0-9a-f]{{32}}$")
_SHARD_RE = re.compile(r"^r(0|[1-9][0-9]{0,3})-p(0|[1-9][0-9]{0,3})$")


def check_digest(digest: str) -> str:
    """``digest`` if it is a code group digest (also a safe directory name); ValueError if not."""
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise ValueError(f"not a code group digest: {digest!r}")
    return digest


def shard_name(rotation: int, index: int) -> str:
    return f"r{rotation}-p{index}"


def parse_shard_name(name: str) -> tuple[int, int]:
    """(rotation, parity index) of a parity shard's file name; ValueError if it is not one."""
    m = _SHARD_RE.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"not a parity shard name: {name!r}")
    return int(m.group(1)), int(m.group(2))


@dataclasses.dataclass(frozen=True)
class ParityRecord:
    """What ``GROUP.json`` holds: whose parity of which group's step, its partial manifest (the crc32c rows of
    this holder's rotations), and each parity file with its size and crc32c. Versioned, validated on parse (a
    peer's record is untrusted)."""

    holder: int
    group: CodeGroupSpec  # addresses empty: a record names data, not where it is now
    manifest: GroupManifest
    files: tuple[FileEntry, ...]
    format_version: int = RECORD_FORMAT_VERSION

    def __post_init__(self) -> None:
        lay = self.group.layout
        if self.manifest.layout != lay:
            raise ValueError(f"parity record: manifest of group {self.manifest.layout}, record of {lay}")
        if any(self.group.addresses):
            raise ValueError("parity record: a group without addresses")
        held = dict(lay.parity_held(self.holder))  # ValueError when the holder is no member
        want = sorted(shard_name(r, j) for r, j in held.items())
        if sorted(f.name for f in self.files) != want:
            raise ValueError(f"parity record of rank {self.holder}: files {[f.name for f in self.files]}, "
                             f"expected {want}")
        if any(f.size != self.manifest.shard_bytes for f in self.files):
            raise ValueError(f"parity record: shard files must have {self.manifest.shard_bytes} bytes")
        if sorted(self.manifest.rotations) != sorted(held):
            raise ValueError(f"parity record of rank {self.holder}: crc32c rows of rotations "
                             f"{self.manifest.rotations}, holds {sorted(held)}")

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def digest(self) -> str:
        return self.group.digest()

    @property
    def parity_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        g = self.group
        return json.dumps({
            "format_version": self.format_version, "holder": self.holder, "digest": self.digest,
            "k": g.k, "m": g.m, "members": list(g.members), "content_hashes": list(g.content_hashes),
            "manifest": self.manifest.to_dict(), "files": [f.to_dict() for f in self.files],
        }, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ParityRecord:
        """Parsed and validated; ValueError if malformed (or its digest does not match its group)."""
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"parity record of {len(raw)} bytes (at most {MAX_RECORD_BYTES})")
        try:
            d = json.loads(raw)
            if d["format_version"] != RECORD_FORMAT_VERSION:
                raise ValueError(f"parity record version {d['format_version']!r}, expected {RECORD_FORMAT_VERSION}")
            group = CodeGroupSpec(d["k"], d["m"], tuple(d["members"]), tuple(d["content_hashes"]),
                                  ("",) * len(d["members"]))
            files = tuple(FileEntry.from_dict(f) for f in d["files"])
            rec = cls(int(d["holder"]), group, GroupManifest.from_dict(d["manifest"]), files)
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed parity record: {e!r}") from e
        if d.get("digest") != rec.digest:
            raise ValueError(f"parity record digest {d.get('digest')!r} is not its group's {rec.digest}")
        return rec


@dataclasses.dataclass(frozen=True)
class ParityHolding:
    """One step's parity this host holds, as the heartbeat reports it (tier PARITY)."""

    step: int
    digest: str
    size: int
    group: CodeGroupSpec


class ParityWriter:
    """Parity of one (step, digest) being written into a temporary directory: :meth:`add` every stripe of
    this holder's shards in order, then :meth:`commit`; any error (or :meth:`abort`) removes it all."""

    def __init__(self, store: ParityStore, step: int, group: CodeGroupSpec):
        self.store, self.step, self.group = store, step, group
        self.final = store.parity_dir(step, group.digest())
        self.tmp = commit.make_tmp_dir(self.final.parent, step)
        self._fds: dict[tuple[int, int], int] = {}
        self._pos: dict[tuple[int, int], int] = {}
        self._crc: dict[tuple[int, int], int] = {}

    def add(self, p: ParityStripe) -> None:
        key = (p.rotation, p.index)
        if key not in self._fds:
            self._fds[key] = os.open(self.tmp / shard_name(*key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._pos[key], self._crc[key] = 0, 0
        if p.offset != self._pos[key]:
            raise ValueError(f"parity stripe of {shard_name(*key)} at {p.offset}, expected {self._pos[key]}")
        view = memoryview(p.data).cast("B")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self._fds[key], view[done:], p.offset + done)
        self._pos[key] += view.nbytes
        self._crc[key] = crc32c_extend(self._crc[key], view)

    def commit(self, holder: int, manifest: GroupManifest) -> ParityRecord:
        """Close and fsync every shard, write ``GROUP.json`` last and publish the directory."""
        for fd in self._fds.values():
            os.fsync(fd)
        self._close()
        files = tuple(FileEntry(shard_name(*key), self._pos[key], self._crc[key]) for key in sorted(self._pos))
        group = dataclasses.replace(self.group, addresses=("",) * len(self.group.members))
        record = ParityRecord(holder, group, manifest, files)  # ValueError if a shard is missing or short
        commit.write_file_atomic(self.tmp / RECORD_NAME, record.to_json())
        commit.publish_dir(self.tmp, self.final, RECORD_NAME)
        self.store.forget(self.final)
        return record

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def abort(self) -> None:
        self._close()
        commit.remove_owned_dir(self.tmp)


class ParityStore:
    """This host's parity under ``<root>/parity`` (see the module docstring). Records are cached by the inode
    of their ``GROUP.json``, so a heartbeat's listing costs a few ``stat`` calls."""

    def __init__(self, root: Path, rank: int):
        self.root = Path(root)
        self.rank = rank
        self.base = self.root / PARITY_DIR  # made by the first parity written (most jobs have none)
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[int, ParityRecord]] = {}
        for d in self._step_dirs():  # what crashed writers and deletions left
            commit.remove_tmp_dirs(d)
            try:
                d.rmdir()  # empty now: a step whose parity is gone
            except OSError:
                pass
        commit.remove_tmp_dirs(self.base)

    # ------------------------------------------------------------------ paths
    def parity_dir(self, step: int, digest: str) -> Path:
        return self.base / layout.step_name(step) / check_digest(digest)

    def _step_dirs(self) -> list[Path]:
        try:
            children = list(self.base.iterdir())
        except FileNotFoundError:
            return []
        return [p for p in children if p.is_dir() and not p.is_symlink() and layout.parse_step_name(p.name) is not None]

    # ------------------------------------------------------------------ writing
    def writer(self, step: int, group: CodeGroupSpec) -> ParityWriter:
        """A writer of this host's parity of ``step`` for ``group``; FileExistsError when it is held already."""
        if self.record(step, group.digest()) is not None:
            raise FileExistsError(f"parity of step {step} for {group.digest()} is held already")
        return ParityWriter(self, step, group)

    def forget(self, d: Path) -> None:
        with self._lock:
            self._cache.pop(d, None)

    # ------------------------------------------------------------------ reading
    def raw_record(self, step: int, digest: str) -> tuple[Path, bytes] | None:
        """(directory, GROUP.json bytes) of the committed parity of (step, digest), None when not held."""
        d = self.parity_dir(step, digest)
        try:
            with open(layout.resolve_under(d, RECORD_NAME), "rb") as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return d, raw

    def record(self, step: int, digest: str) -> ParityRecord | None:
        """The validated record of the committed parity of (step, digest); None when not held or unreadable
        (a bad one is dropped: the coordinator then asks for it again)."""
        d = self.parity_dir(step, digest)
        try:
            ino = os.stat(d / RECORD_NAME).st_ino
        except (FileNotFoundError, NotADirectoryError):
            return None
        with self._lock:
            hit = self._cache.get(d)
            if hit and hit[0] == ino:
                return hit[1]
        got = self.raw_record(step, digest)
        if got is None:
            return None
        why = ""
        try:
            rec = ParityRecord.from_json(got[1])
        except ValueError as e:
            why = str(e)
        else:
            if rec.step != step or rec.digest != digest or rec.holder != self.rank:
                why = f"record of rank {rec.holder} step {rec.step} digest {rec.digest}"
            else:
                why = self._missing_file(d, rec)
        if why:
            log.warning("bad parity of step %d in %s: %s; dropping it (the coordinator asks for it again)",
                        step, d, why)
            self.delete(step, digest)
            return None
        with self._lock:
            self._cache[d] = (ino, rec)
        return rec

    @staticmethod
    def _missing_file(d: Path, rec: ParityRecord) -> str:
        for f in rec.files:
            try:
                size = os.stat(d / f.name).st_size
            except FileNotFoundError:
                return f"parity file {f.name} is missing"
            if size != f.size:
                return f"parity file {f.name} has {size} bytes, its record says {f.size}"
        return ""

    def holdings(self) -> list[ParityHolding]:
        """Every committed parity this host holds (a bad one is dropped, see :meth:`record`)."""
        out = []
        for sd in self._step_dirs():
            step = int(sd.name)
            for d in sorted(sd.iterdir()):
                if not _DIGEST_RE.match(d.name):
                    continue
                rec = self.record(step, d.name)
                if rec is not None:
                    out.append(ParityHolding(step, d.name, rec.parity_bytes, rec.group))
        return out

    def entries(self, step: int, digest: str) -> tuple[Path, list[FileEntry]]:
        """(directory, files) of the committed parity of (step, digest) as the peer service offers them:
        ``GROUP.json`` (with its crc32c) first, then the shards; FileNotFoundError when not held."""
        got = self.raw_record(step, digest)
        rec = self.record(step, digest) if got is not None else None
        if got is None or rec is None:
            raise FileNotFoundError(f"no parity of step {step} for {digest} on rank {self.rank}")
        return got[0], [FileEntry(RECORD_NAME, len(got[1]), crc32c(got[1])), *rec.files]

    def read(self, step: int, digest: str, rotation: int, index: int, offset: int, length: int) -> bytes:
        """Bytes of one parity shard held here (the caller checks them against the manifest's crc32c)."""
        d = self.parity_dir(step, digest)
        fd = os.open(layout.resolve_under(d, shard_name(rotation, index)), os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def verify(self, step: int, digest: str, pieces: Iterable[tuple[str, int, int]]) -> None:
        """Check every stripe the (file name, offset, length) ``pieces`` touch against the record's crc32c
        before they are served. A mismatch is bit rot: this parity is dropped (like a bad copy: the
        coordinator asks for it again once it is missing) and ChecksumError is raised; FileNotFoundError when
        it is not held. ``GROUP.json`` is checked by parsing it (:meth:`record`)."""
        rec = self.record(step, digest)
        if rec is None:
            raise FileNotFoundError(f"no parity of step {step} for {digest} on rank {self.rank}")
        man = rec.manifest
        for name, offset, length in pieces:
            if name == RECORD_NAME or length <= 0:
                continue
            rotation, index = parse_shard_name(name)
            first = offset // man.stripe_bytes
            last = min((offset + length - 1) // man.stripe_bytes, man.stripes - 1)
            for stripe in range(first, last + 1):
                off, n = man.stripe_range(stripe)
                data = self.read(step, digest, rotation, index, off, n)
                expected = man.crc32c[rotation][stripe][man.layout.k + index]
                actual = crc32c(data) if len(data) == n else -1
                if actual != expected:
                    log.warning("bad parity of step %d (%s): shard %s stripe %d has crc32c %08x, its record says "
                                "%08x; dropping it (the coordinator asks for it again)", step, digest, name,
                                stripe, actual & 0xFFFFFFFF, expected)
                    self.delete(step, digest)
                    raise ChecksumError(f"parity shard {name} stripe {stripe} of step {step} on rank {self.rank} "
                                        f"(dropped)", expected, actual & 0xFFFFFFFF)

    # ------------------------------------------------------------------ deletion
    def delete(self, step: int, digest: str | None = None) -> bool:
        """Delete this host's parity of ``step`` (only that of ``digest`` when given); whether any went."""
        sd = self.base / layout.step_name(step)
        if not sd.is_dir():
            return False
        names = [check_digest(digest)] if digest else [p.name for p in sd.iterdir() if _DIGEST_RE.match(p.name)]
        deleted = False
        for name in names:
            d = sd / name
            # Renamed to a trash name first: a crash leaves trash (dropped at start), never half a parity.
            if commit.delete_step(d, spare=spares.spare_dir(self.root)):
                deleted = True
                log.info("deleted parity of step %d (%s) from %s", step, name, d)
            self.forget(d)
        try:
            sd.rmdir()  # the step's directory once empty (a writer may be filling it: then it stays)
        except OSError:
            pass
        return deleted

    def write_all(self, step: int, group: CodeGroupSpec, stripes: Any, manifest: Any) -> ParityRecord:
        """Write ``stripes`` (this holder's, in order) and commit with ``manifest()`` (called once they are
        all written): the whole parity or nothing. ENOSPC frees the RAM disk's recycled pages for a retry."""
        w = self.writer(step, group)
        try:
            for p in stripes:
                w.add(p)
            return w.commit(self.rank, manifest())
        except BaseException as e:
            w.abort()
            if getattr(e, "errno", None) == errno.ENOSPC:
                spares.drop_spares(spares.spare_dir(self.root))
            raise
