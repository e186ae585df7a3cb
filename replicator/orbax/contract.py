"""The file contract between unchanged Orbax multi-tier checkpointing (0.12.8) and our replicator daemon.

Everything happens in the host's local checkpoint directory ``<local>`` (verified against the source of
orbax-checkpoint 0.12.8, ``experimental/emergency/multi_tier_checkpointing/initialization.py``):

* Orbax writes ``replicator.yaml`` (``.tmp`` + rename) and waits, polling once a second for up to
  ``jax_initialization_timeout_seconds``, for the daemon to acknowledge by deleting it.
* It then reads ``replicator.errors`` (logged, deleted) and ``replicator.failed`` (deleted, then
  ``RuntimeError`` -- only when the file is non-empty).
* It then waits, polling once a second for a fixed 300 s, for ``*.restore`` markers: an empty regular file
  ``<job>-s0-n<rank>-w0.restore`` means "nothing to restore"; any other ``<job>-s<N>-n<rank>-w0.restore``
  (a symlink to a directory, or a directory) is renamed (``os.replace``) to ``<local>/<N>`` and restored
  from there. We write a directory of hard links to our copy's files: Orbax's step deleter (``delete(N)``,
  preservation policies) then unlinks only the links, never our copy (it walks through a symlink and
  unlinks the target's files).
* ``jax-init-info.txt`` (``<process id>\\n<coordinator host:port>\\n``) gives JAX its process id when the
  user keeps ``use_mtc_process_ids=True``.

See docs/orbax.md for the whole contract and the differences from older/newer Orbax releases.

Why ~620 lines in one module: it is the contract itself — every file name, marker rule and content-identity
rule Orbax depends on is stated here once, next to the others it interacts with.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash
import yaml

from sidecar import layout, parse
from sidecar.commit import fsync_dir, write_file_atomic

log = logging.getLogger(__name__)

ORBAX_VERSION = "0.12.8"
REPLICATOR_FILE = "replicator.yaml"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
JAX_INIT_INFO_FILE = "jax-init-info.txt"
RESTORE_SUFFIX = ".restore"
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_SUCCESS_FILE = "commit_success.txt"
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
# Written by Orbax >= 0.12.10 only (never by 0.12.8): "back this step up now".
BACKUP_REQUESTED_FILE = "_BACKUP_REQUESTED"
OCDBT_MANIFEST_FILE = "manifest.ocdbt"
OCDBT_PROCESS_PREFIX = "ocdbt.process_"

# Orbax 0.12.8's timeouts, all polled with a 1 s sleep (so every wait step costs up to ~1 s).
ORBAX_POLL_INTERVAL_SECONDS = 1
# Multi-controller: waiting for markers after the ack is hard-coded (not derived from any argument).
ORBAX_RESTORE_MARKER_TIMEOUT_SECONDS = 300
# Multi-controller: replicator.yaml ack wait = jax_initialization_timeout_seconds (default 900).
ORBAX_DEFAULT_INIT_TIMEOUT_SECONDS = 900
# Waiting for jax-init-info.txt: fixed 900 s.
ORBAX_JAX_INIT_INFO_TIMEOUT_SECONDS = 900
# Colocated (Pathways) mode: ack wait = min(remaining of jax_initialization_timeout_seconds, 600).
ORBAX_COLOCATED_ACK_TIMEOUT_SECONDS = 600

# The pattern Orbax matches marker names with; any other ``*.restore`` name makes its init raise.
RESTORE_MARKER_RE = re.compile(r"^.+-s(\d+)-n\d+-w\d+\.restore$")
# Keys whose values differ between byte-identical replicas (wall-clock times of this process's save).
_VOLATILE_CHECKPOINT_METADATA_KEYS = frozenset(
    {"init_timestamp_nsecs", "commit_timestamp_nsecs", "performance_metrics"}
)
# orbax_content_hash reads each value in pieces of _HASH_PIECE_BYTES, up to _READ_AHEAD pieces ahead of hashing,
# and the first piece of each of the _READ_AHEAD_KEYS next keys (a read waited for one at a time costs ~0.3 ms of
# tensorstore's thread hand-offs: 2000 small values, 0.64 s one by one, 0.02 s all at once). Measured on the 2-core
# VM (tmpfs, 2026-12-05; a 248 MB chunk of one 256 MiB array / 1000 small arrays): whole values read ahead 4
# deep (before) 0.55-0.62 s / 0.19-0.27 s (tensorstore turns a value into one fresh Python bytes object at
# ~0.8 GB/s); 1 MiB pieces with 16 keys ahead 0.17-0.18 s / 0.17-0.18 s (sha256 alone: 0.14 s for the chunk).
# 4 MiB pieces: 0.19 s, 16 MiB: 0.22-0.25 s; 4 keys ahead: 0.44-0.48 s for the small arrays.
# Each value's digest (and each other file's) is XXH3-128 (xxhash), not sha256: 477 MiB in 0.018 s against sha256's
# 0.28 s here, the ingest's largest CPU cost with four hosts on 2 cores. It tells apart replicas that differ by
# accident (128 bits: never by chance); what guards against corruption is each file's crc32c, as for every step.
# The name is hashed first, so a hash from a daemon that digested otherwise never equals ours.
_DIGEST = "xxh3_128"
_HASH_PIECE_BYTES = 1 << 20
_READ_AHEAD = 4
_READ_AHEAD_KEYS = 16

_KNOWN_KEYS = frozenset(
    {
        "job-name",
        "framework",
        "assume-data-parallelism",
        "node-rank",
        "nodes",
        "peer-ranks",
        "backup-interval-minutes",
        "backup-interval-steps",
    }
)


# --------------------------------------------------------------------------- replicator.yaml


def _parse_int(value: Any, key: str, minimum: int) -> int:
    return parse.parse_int(value, key, minimum)


def _require_int(value: Any, key: str, minimum: int) -> int:
    return parse.parse_int(value, key, minimum, strict=True)


@dataclasses.dataclass(frozen=True)
class ReplicatorConfig:
    """What Orbax tells the replicator about this host in ``replicator.yaml`` (validated).

    ``peer_ranks`` are the node ranks holding the same in-slice position in every other slice (``()``
    for a single slice). Exactly one of the two backup intervals is set.
    """

    job_name: str
    framework: str
    assume_data_parallelism: int
    node_rank: int
    nodes: int
    peer_ranks: tuple[int, ...]
    backup_interval_minutes: int | None = None
    backup_interval_steps: int | None = None

    def __post_init__(self) -> None:
        layout.check_job_name(self.job_name, "job-name")
        if self.framework != "orbax":
            raise ValueError(f"framework must be 'orbax', got {self.framework!r}")
        _require_int(self.assume_data_parallelism, "assume-data-parallelism", 1)
        _require_int(self.nodes, "nodes", 1)
        rank = _require_int(self.node_rank, "node-rank", 0)
        if rank >= self.nodes:
            raise ValueError(f"node-rank {rank} out of range for nodes={self.nodes}")
        if not isinstance(self.peer_ranks, tuple):
            raise ValueError(f"peer-ranks must be a tuple of ints, got {self.peer_ranks!r}")
        for p in self.peer_ranks:
            _require_int(p, "peer-ranks", 0)
            if p >= self.nodes:
                raise ValueError(f"peer-ranks entry {p} out of range for nodes={self.nodes}")
        if rank in self.peer_ranks:
            raise ValueError(f"peer-ranks {list(self.peer_ranks)} must not contain node-rank {rank}")
        if len(set(self.peer_ranks)) != len(self.peer_ranks):
            raise ValueError(f"peer-ranks must be unique, got {list(self.peer_ranks)}")
        if (self.backup_interval_minutes is None) == (self.backup_interval_steps is None):
            raise ValueError(
                "exactly one of backup-interval-minutes and backup-interval-steps must be set, got "
                f"backup-interval-minutes={self.backup_interval_minutes!r}, "
                f"backup-interval-steps={self.backup_interval_steps!r}"
            )
        if self.backup_interval_minutes is not None:
            _require_int(self.backup_interval_minutes, "backup-interval-minutes", 1)
        if self.backup_interval_steps is not None:
            _require_int(self.backup_interval_steps, "backup-interval-steps", 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicatorConfig:
        """Build from the hyphen-keyed mapping of ``replicator.yaml``; ValueError names the bad key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{REPLICATOR_FILE} must be a mapping, got {type(d).__name__}")
        for key in ("job-name", "framework", "assume-data-parallelism", "node-rank", "nodes", "peer-ranks"):
            if key not in d:
                raise ValueError(f"{REPLICATOR_FILE} lacks required key {key!r}")
        unknown = sorted(set(d) - _KNOWN_KEYS)
        if unknown:
            # A newer Orbax may add keys; what we understand is still valid, so only warn.
            log.warning("ignoring unknown keys in %s: %s", REPLICATOR_FILE, unknown)
        peers = d["peer-ranks"]
        if peers is None or peers == "":
            peers = []
        if not isinstance(peers, list):
            raise ValueError(f"peer-ranks must be a list, got {peers!r}")
        job = d["job-name"]
        return cls(
            job_name=job if isinstance(job, str) else str(job),
            framework=str(d["framework"]),
            assume_data_parallelism=_parse_int(d["assume-data-parallelism"], "assume-data-parallelism", 1),
            node_rank=_parse_int(d["node-rank"], "node-rank", 0),
            nodes=_parse_int(d["nodes"], "nodes", 1),
            peer_ranks=tuple(_parse_int(p, "peer-ranks", 0) for p in peers),
            backup_interval_minutes=(
                _parse_int(d["backup-interval-minutes"], "backup-interval-minutes", 1)
                if d.get("backup-interval-minutes") is not None
                else None
            ),
            backup_interval_steps=(
                _parse_int(d["backup-interval-steps"], "backup-interval-steps", 1)
                if d.get("backup-interval-steps") is not None
                else None
            ),
        )

    @classmethod
    def from_yaml(cls, text: str) -> ReplicatorConfig:
        """Parse the text of ``replicator.yaml``.

        Scalars are read verbatim (YAML BaseLoader) so that a job name such as ``1e3`` or ``on`` stays the
        string Orbax put into its marker names instead of becoming a float or a bool.
        """
        try:
            data = yaml.load(text, Loader=yaml.BaseLoader)  # noqa: S506 - BaseLoader builds only str/list/dict
        except yaml.YAMLError as e:
            raise ValueError(f"{REPLICATOR_FILE} is not valid YAML: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "job-name": self.job_name,
            "framework": self.framework,
            "assume-data-parallelism": self.assume_data_parallelism,
            "node-rank": self.node_rank,
            "nodes": self.nodes,
            "peer-ranks": list(self.peer_ranks),
        }
        if self.backup_interval_minutes is not None:
            d["backup-interval-minutes"] = self.backup_interval_minutes
        else:
            d["backup-interval-steps"] = self.backup_interval_steps
        return d


def read_config(local_dir: Path) -> ReplicatorConfig | None:
    """The pending handshake of ``local_dir``: None when there is no ``replicator.yaml``.

    Orbax writes the file atomically (tmp + rename), so a present file is complete. A malformed file
    raises ValueError; the daemon should then ``report_fatal`` (Orbax would otherwise wait for the ack).
    """
    path = Path(local_dir) / REPLICATOR_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return ReplicatorConfig.from_yaml(text)


def acknowledge(
    local_dir: Path, expected: ReplicatorConfig | None = None, *, missing_ok: bool = False
) -> None:
    """Acknowledge the handshake by deleting ``replicator.yaml``.

    With ``expected``, the file is first re-read and must still describe that configuration: Orbax's
    colocated mode replaces a stale file without waiting, so a different config means a new incarnation
    the caller has not seen yet (ValueError, nothing deleted).
    """
    path = Path(local_dir) / REPLICATOR_FILE
    if expected is not None:
        current = read_config(local_dir)
        if current is None:
            if missing_ok:
                return
            raise FileNotFoundError(f"{path} is gone: nothing to acknowledge")
        if current != expected:
            raise ValueError(f"{path} changed since it was read ({current} != {expected}); not acknowledged")
    try:
        path.unlink()
    except FileNotFoundError:
        if not missing_ok:
            raise
        return
    log.info("acknowledged Orbax handshake in %s", local_dir)


def _check_text(text: Any, what: str) -> str:
    if not isinstance(text, str) or not text.strip():
        # Orbax ignores (and deletes) an empty report: an empty text would be lost silently.
        raise ValueError(f"{what} text must be a non-empty string, got {text!r}")
    return text if text.endswith("\n") else text + "\n"


def report_error(local_dir: Path, text: str) -> None:
    """Append a non-fatal error for Orbax to log (``replicator.errors``; Orbax logs and deletes it).

    Rewritten whole via tmp + rename, never appended in place: Orbax deletes a file it finds empty, which
    would swallow a report whose bytes were not written yet. A report appended between Orbax's read and
    its delete is lost; one written after its delete may be logged twice. Both windows are ~microseconds.
    """
    text = _check_text(text, "error")
    path = Path(local_dir) / ERRORS_FILE
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        old = b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    write_file_atomic(path, old + text.encode())
    log.warning("reported replicator error to Orbax in %s: %s", local_dir, text.strip())


def report_fatal(local_dir: Path, text: str) -> None:
    """Make Orbax's initialization raise ``RuntimeError(text)`` (``replicator.failed``).

    Orbax checks it after the ack and on every poll of the marker wait; the text must be non-empty
    (Orbax 0.12.8 deletes an empty ``replicator.failed`` without raising).
    """
    text = _check_text(text, "fatal error")
    write_file_atomic(Path(local_dir) / FAILED_FILE, text.encode())
    log.error("reported fatal replicator error to Orbax in %s: %s", local_dir, text.strip())


# --------------------------------------------------------------------------- restore markers


def marker_name(job: str, step: int, rank: int) -> str:
    """``<job>-s<step>-n<rank>-w0.restore``, the only marker name Orbax accepts."""
    layout.check_job_name(job, "job")
    layout.step_name(step)
    _parse_int(rank, "rank", 0)
    return f"{job}-s{step}-n{rank}-w0{RESTORE_SUFFIX}"


def parse_marker_name(name: str) -> int | None:
    """The step a marker name denotes, or None when Orbax would reject the name."""
    m = RESTORE_MARKER_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def _markers(local_dir: Path) -> list[Path]:
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        return []
    return sorted(p for p in local_dir.iterdir() if p.name.endswith(RESTORE_SUFFIX))


def _no_other_marker(local_dir: Path) -> None:
    existing = _markers(local_dir)
    if existing:
        raise FileExistsError(
            f"{local_dir} already holds restore marker(s) {[p.name for p in existing]}; Orbax acts on exactly "
            "one kind of marker: call remove_markers() first"
        )


def write_no_restore_marker(local_dir: Path, job: str, rank: int) -> Path:
    """Tell Orbax there is nothing to restore: an empty regular file ``<job>-s0-n<rank>-w0.restore``."""
    local_dir = Path(local_dir)
    name = marker_name(job, 0, rank)
    _no_other_marker(local_dir)
    path = local_dir / name
    with open(path, "xb"):
        pass
    log.info("wrote no-restore marker %s", path)
    return path


def write_restore_marker(local_dir: Path, job: str, step: int, rank: int, target_dir: Path) -> Path:
    """Tell Orbax to restore ``step``: the directory ``<job>-s<step>-n<rank>-w0.restore`` of hard links.

    ``target_dir`` must be a finalized Orbax step directory (holding ``_CHECKPOINT_METADATA`` and
    ``commit_success.txt``) with this rank's data or a byte-identical replica's, outside ``<local>/<step>``,
    on the same filesystem as ``local_dir``. The marker mirrors its tree with a hard link per file (our
    ``MANIFEST.json`` left out), built under a hidden temporary name and renamed into place, so Orbax sees
    a complete marker or none; Orbax renames it to ``<local>/<step>``. Orbax deleting that directory
    later removes links only: our copy keeps every byte (see :func:`is_restored_copy`). Where a file
    cannot be linked (another filesystem) it is copied. ``<local>/<step>`` must not exist yet (see
    prepare_for_restore).
    """
    local_dir = Path(local_dir)
    name = marker_name(job, step, rank)
    target = Path(target_dir).absolute()
    if not target.is_dir():
        raise NotADirectoryError(f"restore target {target} is not a directory")
    for required in (CHECKPOINT_METADATA_FILE, COMMIT_SUCCESS_FILE):
        if not (target / required).is_file():
            raise ValueError(f"restore target {target} is not a finalized Orbax step (no {required})")
    final = local_dir / layout.step_name(step)
    if os.path.lexists(final):
        raise FileExistsError(
            f"{final} exists and would collide with Orbax's rename of the marker: call prepare_for_restore()"
        )
    if target.resolve() == local_dir.resolve() or (
        target.resolve().parent == local_dir.resolve() and layout.parse_step_name(target.name) is not None
    ):
        # Orbax would see the data twice (<local>/<step> and the target), and the target as another step.
        raise ValueError(f"restore target {target} must not be {local_dir} or one of its step directories")
    _no_other_marker(local_dir)
    path = local_dir / name
    tmp = local_dir / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        copied = link_tree(target, tmp)
        fsync_dir(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(local_dir)
    log.info("wrote restore marker %s: hard links to %s%s", path, target,
             f" ({copied} files copied: not linkable)" if copied else "")
    return path


def link_tree(src: Path, dest: Path, *, copy_unlinkable: bool = True) -> int:
    """Mirror ``src`` into ``dest`` (made if absent) with a hard link per file, our top-level
    ``MANIFEST.json`` left out; returns how many files had to be copied.

    A symlink in ``src`` is a ValueError (Orbax writes none); a file or directory that vanishes meanwhile is
    an OSError (FileNotFoundError), never a silently smaller tree. A file that cannot be linked (EXDEV,
    EPERM) is copied when ``copy_unlinkable`` (a marker still protects our files), else its OSError is raised
    (an ingest must share Orbax's pages, not double them)."""
    copied = 0

    def fail(e: OSError) -> None:
        raise e

    for here, dirnames, filenames in os.walk(src, onerror=fail):
        rel = Path(here).relative_to(src)
        (dest / rel).mkdir(exist_ok=True)
        for n in dirnames + filenames:
            if (Path(here) / n).is_symlink():
                raise ValueError(f"{src} contains a symlink {rel / n}: not an Orbax step")
        for n in filenames:
            if rel == Path(".") and n == layout.MANIFEST_NAME:
                continue
            try:
                os.link(Path(here) / n, dest / rel / n)
            except OSError:
                if not copy_unlinkable or not (Path(here) / n).exists():
                    raise
                shutil.copy2(Path(here) / n, dest / rel / n)
                copied += 1
    return copied


def is_restored_copy(step_dir: Path) -> bool:
    """Whether ``<local>/<N>`` is a restore marker Orbax renamed: a symlink, or files shared with our copy.

    Orbax writes every file of a save anew, so a ``commit_success.txt`` with more than one link is ours.
    """
    step_dir = Path(step_dir)
    if step_dir.is_symlink():
        return True
    try:
        return (step_dir / COMMIT_SUCCESS_FILE).stat().st_nlink > 1
    except OSError:
        return False


def _remove_path(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def remove_markers(local_dir: Path) -> list[Path]:
    """Delete every ``*.restore`` entry of ``local_dir`` (links are unlinked; their targets are kept)."""
    removed = []
    for p in _markers(local_dir):
        _remove_path(p)
        removed.append(p)
    if removed:
        log.info("removed restore markers %s", [p.name for p in removed])
    return removed


def prepare_for_restore(local_dir: Path, step: int | None) -> list[Path]:
    """Clean ``local_dir`` before writing the marker for ``step`` (None: nothing will be restored).

    Removes, and returns:
    * every ``*.restore`` marker (stale; Orbax would act on the newest one, or crash on a foreign name);
    * every ``<N>.orbax-checkpoint-tmp*`` directory (an interrupted save; never restorable, and Orbax
      itself deletes them when its manager starts);
    * every committed ``<local>/<M>`` with ``M >= step`` (all of them when ``step`` is None): ``M == step``
      collides with Orbax's rename of the marker, and ``M > step`` would become this rank's
      ``latest_step()`` -- ranks would diverge and ``should_save`` would skip steps <= M on this rank only.
      A symlink (an earlier restore) is unlinked, never followed.

    Keeps steps older than ``step`` (harmless to Orbax and possibly the only copy) and every other file.
    A caller that wants to keep the data of ``<local>/<M>`` (for example as the restore target) must move
    it into its own store *before* calling this.
    """
    local_dir = Path(local_dir)
    if step is not None:
        layout.step_name(step)
    if not local_dir.is_dir():
        raise NotADirectoryError(f"local checkpoint directory {local_dir} does not exist")
    removed = remove_markers(local_dir)
    for child in sorted(local_dir.iterdir()):
        number = layout.parse_step_name(child.name)
        stale_tmp = (
            ORBAX_TMP_SUFFIX in child.name and layout.parse_step_name(child.name.split(".")[0]) is not None
        )
        too_new = number is not None and (step is None or number >= step)
        if stale_tmp or too_new:
            _remove_path(child)
            removed.append(child)
            log.info("prepare_for_restore(%s): removed %s", step, child)
    return removed


# --------------------------------------------------------------------------- committed steps


def committed_orbax_steps(local_dir: Path) -> list[int]:
    """Orbax's finalized steps in ``local_dir`` (``<N>`` directories, or links to them, with
    ``commit_success.txt``), ascending. Temporary ``*.orbax-checkpoint-tmp`` directories never count."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        return []
    out = []
    for child in local_dir.iterdir():
        step = layout.parse_step_name(child.name)
        if step is not None and child.is_dir() and (child / COMMIT_SUCCESS_FILE).is_file():
            out.append(step)
    return sorted(out)


def backup_requested(step_dir: Path) -> bool:
    """Whether Orbax asked for an immediate backup of this step (``_BACKUP_REQUESTED``, Orbax >= 0.12.10;
    0.12.8 never writes it, so this is always False with the pinned version)."""
    return (Path(step_dir) / BACKUP_REQUESTED_FILE).is_file()


# --------------------------------------------------------------------------- content hash


class _ValueRead:
    """The read of one value's next piece: ``offset``, and the rest of the value (``slice(offset, None)``) once a
    piece read has gone past its end (tensorstore: OUT_OF_RANGE, a ValueError; a value's size is not listed)."""

    def __init__(self, kv: Any, key: bytes, offset: int):
        self.kv, self.key, self.offset = kv, key, offset
        self.rest = False
        self.fut = kv.read(key, byte_range=slice(offset, offset + _HASH_PIECE_BYTES))

    def to_rest(self) -> None:
        self.rest = True
        self.fut = self.kv.read(self.key, byte_range=slice(self.offset, None))

    def settle(self) -> None:
        """Turn a piece read already failed into the read of the rest (without waiting for anything)."""
        if not self.rest and self.fut.done() and self.fut.exception() is not None:
            self.to_rest()

    def result(self) -> Any:
        try:
            return self.fut.result()
        except ValueError:
            if self.rest:
                raise
        self.to_rest()  # past the value's end -- or a failed read, which fails again here
        return self.fut.result()


def _ocdbt_digests(db_dir: Path) -> Iterator[tuple[bytes, str]]:
    """(key, sha256 hex of value) of every entry of the OCDBT database rooted at ``db_dir``, in key order.

    Values are read in pieces (``_HASH_PIECE_BYTES``) running ahead of hashing (tensorstore reads in its own
    threads and sha256 releases the GIL): at most ``_READ_AHEAD`` pieces of the value being hashed and the
    first pieces of the ``_READ_AHEAD_KEYS`` next keys in memory at once.
    """
    try:
        import tensorstore as ts  # lazy: only hashing Orbax's OCDBT steps needs it (a dependency of ours)
    except ImportError as e:
        raise ValueError(f"cannot read OCDBT database {db_dir}: tensorstore is not installed ({e}); it is a "
                         "dependency of multitier-checkpoint: reinstall it (pip install multitier-checkpoint)") from e

    if not (db_dir / OCDBT_MANIFEST_FILE).is_file():
        raise ValueError(f"OCDBT database {db_dir} has no {OCDBT_MANIFEST_FILE} (incomplete step)")
    try:
        spec = {"driver": "ocdbt", "base": {"driver": "file", "path": f"{db_dir.absolute()}/"}}
        kv = ts.KvStore.open(spec).result()
        keys = sorted(kv.list().result())
    except Exception as e:  # tensorstore raises ValueError/RuntimeError variants
        raise ValueError(f"cannot read OCDBT database {db_dir}: {e}") from e
    firsts: collections.deque[_ValueRead] = collections.deque()  # the first piece of each next key
    next_key = 0
    for key in keys:
        while next_key < len(keys) and len(firsts) < _READ_AHEAD_KEYS:
            firsts.append(_ValueRead(kv, keys[next_key], 0))
            next_key += 1
        pieces = collections.deque([firsts.popleft()])
        h = xxhash.xxh3_128()
        while pieces:
            for r in firsts:  # small values ahead: their whole reads start now, not one after the other
                r.settle()
            piece = pieces.popleft()
            try:
                res = piece.result()
            except Exception as e:
                raise ValueError(f"cannot read key {key!r} of OCDBT database {db_dir}: {e}") from e
            if res.state != "value":
                raise ValueError(f"OCDBT database {db_dir} lists key {key!r} but has no value for it")
            h.update(res.value)
            if piece.rest:
                break  # the value's end (reads ahead past it are dropped)
            offset = (pieces[-1] if pieces else piece).offset + _HASH_PIECE_BYTES
            while len(pieces) < _READ_AHEAD:
                pieces.append(_ValueRead(kv, key, offset))
                offset += _HASH_PIECE_BYTES
        yield key, h.hexdigest()


def _canonical_checkpoint_metadata(data: bytes, path: Path) -> bytes:
    try:
        meta = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k not in _VOLATILE_CHECKPOINT_METADATA_KEYS}
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def orbax_content_hash(step_dir: Path) -> str:
    """sha256 (hex) of what a rank restores from an Orbax step directory, independent of which replica
    wrote it.

    Data-parallel replicas differ only in bytes Orbax does not use to restore: OCDBT files
    (``manifest.ocdbt``, ``d/<random>``, ``ocdbt.process_<pid>/``, names and b-tree layout), the text of
    every ``commit_success.txt`` (it names the writer's path) and the save timestamps in
    ``_CHECKPOINT_METADATA``. So the hash covers: each OCDBT root's (key, XXH3-128(value)) pairs, read
    through tensorstore (keys like ``w/c/0/0``, ``w/zarr.json``); ``_CHECKPOINT_METADATA`` minus timestamps and
    performance metrics; the presence of each ``commit_success.txt``; the bytes of every other file
    (``_METADATA``, ``_sharding``, ``process_metadata/*.json``, ... by XXH3-128). Equal hashes mean a rank can
    restore from the other's copy; any changed array value, shape, dtype or sharding changes the hash.
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise NotADirectoryError(f"{step_dir} is not a directory")
    h = hashlib.sha256()

    def record(*parts: Any) -> None:
        h.update(json.dumps(parts).encode() + b"\n")

    record("digest", _DIGEST)

    for dirpath, dirnames, filenames in os.walk(step_dir):
        here = Path(dirpath)
        rel = here.relative_to(step_dir).as_posix()
        dirnames.sort()
        links = [n for n in dirnames + filenames if (here / n).is_symlink()]
        if links:
            # Orbax never writes links inside a step; one could point outside the step (untrusted copy).
            raise ValueError(f"{here} contains symlinks {links}: not an Orbax step directory")
        if OCDBT_MANIFEST_FILE in filenames:
            # An OCDBT root (the item's merged manifest): it indexes its ocdbt.process_* sub-databases,
            # which Orbax never reads directly, so their layout and names are not hashed.
            for key, digest in _ocdbt_digests(here):
                record("kv", rel, key.hex(), digest)
            dirnames[:] = []
        elif any(d.startswith(OCDBT_PROCESS_PREFIX) for d in dirnames):
            # Orbax restores through the root manifest only: without it the item is unreadable.
            raise ValueError(f"{here} has per-process OCDBT data but no root {OCDBT_MANIFEST_FILE}")
        for name in sorted(filenames):
            if name == OCDBT_MANIFEST_FILE:
                continue
            path = here / name
            file_rel = path.relative_to(step_dir).as_posix()
            if name == COMMIT_SUCCESS_FILE:
                record("present", file_rel)
            elif name == CHECKPOINT_METADATA_FILE:
                record(
                    "meta",
                    file_rel,
                    hashlib.sha256(_canonical_checkpoint_metadata(path.read_bytes(), path)).hexdigest(),
                )
            elif name == BACKUP_REQUESTED_FILE:
                continue  # a request to the replicator, not checkpoint content
            else:
                record("file", file_rel, xxhash.xxh3_128_hexdigest(path.read_bytes()))
    return h.hexdigest()


# --------------------------------------------------------------------------- jax-init-info.txt


def write_jax_init_info(local_dir: Path, process_id: int, coordinator_address: str) -> Path:
    """Write ``jax-init-info.txt`` (``<process_id>\\n<host:port>\\n``) atomically, as GKE's ranks service does.

    Orbax reads it as soon as it exists and raises on fewer than two lines, so it must never be seen
    half-written.
    """
    pid = _parse_int(process_id, "process_id", 0)
    if not isinstance(coordinator_address, str):
        raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not host or any(c.isspace() for c in coordinator_address) or not port.isdigit():
        raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"coordinator port out of range in {coordinator_address!r}")
    path = Path(local_dir) / JAX_INIT_INFO_FILE
    write_file_atomic(path, f"{pid}\n{coordinator_address}\n".encode())
    log.info("wrote %s: process %d, coordinator %s", path, pid, coordinator_address)
    return path
