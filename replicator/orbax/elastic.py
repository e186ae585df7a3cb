"""Orbax mode after an elastic event: a host's saved data re-labelled for a changed node count.

Orbax numbers the hosts of every job incarnation ``0..nodes-1`` slice-major (Pathways: the *active*
workers), so after a slice is lost (or comes back) a surviving host may get another rank, and its RAM disk
holds data saved under the old rank and node count. Orbax restores by position: rank ``r`` needs the data
of in-slice position ``r % hosts_per_slice`` (every slice of a data-parallel job holds the same data, which
is what Orbax's ``peer-ranks`` say), so a saved piece of old rank ``o`` is the data of position
``o % hosts_per_slice`` whatever the node count. The number of hosts per slice must not change.

:func:`remap` runs at each handshake, before the Replicator starts (nothing else touches the store then):

* every step directory whose manifest records another layout (``nodes``, or ``rank`` for the host's own
  steps) is re-labelled: a piece of this host's position becomes its own ``steps/<N>`` (rank = new rank),
  a piece of another position becomes the peer copy ``peer/<q>/<N>`` of the lowest new rank ``q`` of that
  position (not this host); duplicates and pieces without a slot are deleted. Files never move between
  filesystems (renames) and are not rewritten; only the manifest is replaced (tmp + rename);
* replica attestations of re-labelled steps are dropped (they name old ranks; the coordinator re-verifies
  replicas by hash) and, for a step saved by fewer nodes than now (the job grew), this host attests that
  its own data is that of every other rank of its position: the coordinator then plans the restores of
  the new hosts among them from this host, like a replaced host's (Orbax restores from a replica's
  byte-identical copy);
* the layout is recorded in ``<local>/orbax-layout.json`` so the next handshake knows what changed.

The coordinator plans over one node count and cannot use a backup saved by another. So a host whose RAM
disk holds nothing, when the newest backup in the bucket was saved by another node count, downloads its
position's data of that backup (:func:`bucket_source_rank`) before the re-labelling, which then makes it
this host's own data like any other piece.

A crash in the middle leaves pieces in ``<local>/elastic-remap/`` with a valid manifest; the next handshake
finishes the job (the re-labelling is idempotent).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

from sidecar import commit, layout

log = logging.getLogger(__name__)

LAYOUT_FILE = "orbax-layout.json"
STAGING_DIR = "elastic-remap"
# Pieces that cannot be mapped (the number of hosts per slice changed) are kept here for the operator,
# outside the store: never reported, replicated or restored.
UNMAPPED_DIR = "elastic-unmapped"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One Orbax incarnation's place of this host: job, rank, node count and slices (from replicator.yaml)."""

    job: str
    rank: int
    nodes: int
    slices: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.slices < 1 or self.nodes % self.slices or not 0 <= self.rank < self.nodes:
            raise ValueError(f"bad layout: rank {self.rank}, nodes {self.nodes}, slices {self.slices}")

    @property
    def hosts_per_slice(self) -> int:
        return self.nodes // self.slices

    def position(self, rank: int) -> int:
        return rank % self.hosts_per_slice

    def ranks_at(self, position: int) -> list[int]:
        """The ranks of in-slice ``position``, lowest first (one per slice)."""
        return list(range(position, self.nodes, self.hosts_per_slice))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        try:
            return cls(str(d["job"]), int(d["rank"]), int(d["nodes"]), int(d["slices"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad {LAYOUT_FILE}: {e}") from None


def read_layout(local: Path) -> Layout | None:
    """The layout recorded by the previous handshake (None: none recorded, or unreadable)."""
    try:
        return Layout.from_dict(json.loads((Path(local) / LAYOUT_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", LAYOUT_FILE, e)
        return None


def write_layout(local: Path, lay: Layout) -> None:
    commit.write_file_atomic(Path(local) / LAYOUT_FILE, json.dumps(lay.to_dict()).encode())


@dataclasses.dataclass
class RemapReport:
    """What :func:`remap` did: ``(step, old rank, new owner)`` moves, dropped ``(step, old rank)``, attestations.

    ``unmapped``: why the pieces were moved to :data:`UNMAPPED_DIR` instead ("" when they were not).
    """

    relabelled: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    dropped: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    unmapped: str = ""
    attest: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)  # (owner, step, hash)
    steps: set[int] = dataclasses.field(default_factory=set)

    @property
    def changed(self) -> bool:
        return bool(self.relabelled or self.dropped)


def _replace_manifest(d: Path, m: layout.StepManifest) -> None:
    """Replace ``d``'s manifest atomically (tmp + rename): a crash leaves the old one or the new one."""
    commit.write_file_atomic(d / layout.MANIFEST_NAME, m.to_json())


def _pieces(local: Path, new: Layout) -> list[tuple[Path, layout.StepManifest, bool]]:
    """Every committed step directory of another layout: (dir, manifest, is this host's own)."""
    out = []
    steps = layout.steps_dir(local)
    for n in commit.committed_steps(steps) if steps.is_dir() else []:
        d = steps / layout.step_name(n)
        m = layout.read_manifest(d)
        if (m.rank, m.nodes) != (new.rank, new.nodes):
            out.append((d, m, True))
    peer = local / layout.PEER_DIR
    for od in sorted(peer.iterdir()) if peer.is_dir() else []:
        if not od.is_dir() or layout.parse_step_name(od.name) is None:
            continue
        for n in commit.committed_steps(od):
            d = od / layout.step_name(n)
            m = layout.read_manifest(d)
            if m.nodes != new.nodes or m.rank != int(od.name) or m.rank >= new.nodes:
                out.append((d, m, False))
    return out


def _set_aside(local: Path, new: Layout, report: RemapReport) -> None:
    """Move every piece of another layout than ``new`` to :data:`UNMAPPED_DIR`, noted in ``report``."""
    aside = local / UNMAPPED_DIR
    aside.mkdir(exist_ok=True)
    for i, (d, m, own) in enumerate(_pieces(local, new)):
        os.rename(d, aside / f"{m.step}-{m.rank}-{'own' if own else 'peer'}-{m.nodes}-{i}-{os.getpid()}")
        report.dropped.append((m.step, m.rank))
        report.steps.add(m.step)


def remap(local: Path, new: Layout, previous: Layout | None) -> RemapReport:
    """Re-label every piece of ``local``'s store saved under another layout for ``new`` (see module doc).

    When the number of hosts per slice changed (one host's Orbax data cannot be split or merged), every
    piece of the old layout is moved to :data:`UNMAPPED_DIR` instead and ``unmapped`` says why.
    """
    local = Path(local)
    h = new.hosts_per_slice
    report = RemapReport()
    if previous is not None and previous.hosts_per_slice != h:
        report.unmapped = (
            f"the saved data has {previous.hosts_per_slice} hosts per slice ({previous.nodes} nodes, "
            f"{previous.slices} slices), replicator.yaml {h} hosts per slice ({new.nodes} nodes, {new.slices} "
            "slices): Orbax restores each host's own shards and cannot re-split them across another number "
            "of hosts per slice"
        )
        _set_aside(local, new, report)
        return report
    staging = local / STAGING_DIR
    staged: list[tuple[Path, layout.StepManifest, bool]] = []
    if staging.is_dir():  # a remap interrupted by a crash: its pieces carry valid manifests
        for d in sorted(staging.iterdir()):
            try:
                staged.append((d, layout.read_manifest(d), False))
            except (OSError, layout.ManifestError) as e:
                log.warning("dropping unreadable %s: %s", d, e)
                shutil.rmtree(d, ignore_errors=True)
    pieces = _pieces(local, new)
    if not pieces and not staged:
        return report
    staging.mkdir(exist_ok=True)
    # Phase 1: every piece of another layout out of the way (renames), so that phase 2 never collides.
    for i, (d, m, own) in enumerate(pieces):
        dest = staging / f"{m.step}-{m.rank}-{'own' if own else 'peer'}-{i}-{os.getpid()}"
        os.rename(d, dest)
        staged.append((dest, m, own))
    commit.fsync_dir(staging)
    # Phase 2: own position first (the host's own old data before a peer copy), then the rest.
    me = new.position(new.rank)
    staged.sort(key=lambda x: (x[1].step, new.position(x[1].rank) != me, not x[2], x[1].rank))
    for d, m, _own in staged:
        step, p = m.step, new.position(m.rank)
        report.steps.add(step)
        own_dir = layout.steps_dir(local) / layout.step_name(step)
        target: Path | None = None
        owner = -1
        if p == me and not os.path.lexists(own_dir):
            target, owner = own_dir, new.rank
        else:
            for q in new.ranks_at(p):
                cand = layout.peer_dir(local, q) / layout.step_name(step)
                if q != new.rank and not os.path.lexists(cand):
                    target, owner = cand, q
                    break
        if target is None:
            shutil.rmtree(d, ignore_errors=True)
            report.dropped.append((step, m.rank))
            log.info("elastic: dropped step %d of old rank %d (no slot for position %d in %d nodes)", step,
                     m.rank, p, new.nodes)
            continue
        fresh = dataclasses.replace(m, job=new.job, rank=owner, nodes=new.nodes, savers=())
        _replace_manifest(d, fresh)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(d, target)
        report.relabelled.append((step, m.rank, owner))
        log.info("elastic: step %d of old rank %d (of %d nodes) is now %s of rank %d", step, m.rank, m.nodes,
                 "the own data" if owner == new.rank else "a copy", owner)
        if owner == new.rank and m.nodes < new.nodes:
            # The job grew: some ranks of this position (which ones depends on the new numbering) are new
            # hosts without data; this host's data is theirs (Orbax restores a replica's identical copy).
            # For a rank that does hold its own data the claim is redundant (same hash) or, if its data
            # differs, outvoted by its own definitive copy.
            for q in new.ranks_at(p):
                if q != new.rank:
                    report.attest.append((q, step, fresh.content_hash))
    shutil.rmtree(staging, ignore_errors=True)
    return report


def holds_nothing(local: Path) -> bool:
    """No committed step of any rank in the store (a new or wiped host), nothing left to re-label."""
    local = Path(local)
    staging = local / STAGING_DIR
    if staging.is_dir() and any(staging.iterdir()):
        return False
    if commit.committed_steps(layout.steps_dir(local)) if layout.steps_dir(local).is_dir() else []:
        return False
    peer = local / layout.PEER_DIR
    return not any(commit.committed_steps(d) for d in (peer.iterdir() if peer.is_dir() else []) if d.is_dir())


def bucket_source_rank(saved_nodes: int, rank_hashes: tuple[str, ...], new: Layout) -> int:
    """The rank of a backup saved by ``saved_nodes`` hosts whose data is ``new.rank``'s (same position).

    The same rank number when it has that position and saved the step, else the lowest that did.
    ValueError naming what is missing when none can be used.
    """
    h = new.hosts_per_slice
    if saved_nodes % h:
        raise ValueError(f"the backup was saved by {saved_nodes} nodes, not a multiple of this job's {h} hosts "
                         "per slice: Orbax cannot restore one host's shards onto another number of hosts per slice")
    p = new.position(new.rank)
    ranks = [r for r in range(p, saved_nodes, h) if r < len(rank_hashes) and rank_hashes[r]]
    if not ranks:
        raise ValueError(f"the backup holds no rank of in-slice position {p} (saved by {saved_nodes} nodes)")
    return new.rank if new.rank in ranks else ranks[0]
