"""The replicator's view of its host's RAM disk: own steps, peer copies, replica attestations, deletion."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from replicator.tiers import Holding, Tier
from sidecar import commit, faults, layout, spares
from sidecar.saves import rank_ranges

log = logging.getLogger(__name__)

REPLICA_FILE = "replica-of.json"


class RamDiskStore:
    """Committed steps under ``<root>/steps`` (this rank's) and ``<root>/peer/<owner>`` (copies).

    Manifests are cached by directory inode so that a heartbeat's inventory costs a few ``stat`` calls.
    """

    def __init__(self, root: Path, rank: int):
        self.root = Path(root)
        self.rank = rank
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[int, layout.StepManifest]] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        layout.steps_dir(self.root).mkdir(exist_ok=True)
        (self.root / layout.PEER_DIR).mkdir(exist_ok=True)
        self._startup_cleanup()
        self._refile_other_ranks()
        self._replica_of = self._load_replicas()

    def _startup_cleanup(self) -> None:
        """Remove what crashed writers and GCs left: unowned temporary directories and trash (layout)."""
        commit.remove_tmp_dirs(layout.steps_dir(self.root))
        for d in self._peer_owner_dirs():
            commit.remove_tmp_dirs(d)
        commit.remove_tmp_dirs(layout.fetch_dir(self.root))  # of readers that died mid-restore

    def _refile_other_ranks(self) -> None:
        """A RAM disk outlives its Pods (the CSI volume is the node's), but a JobSet restart may place another
        rank on this node: steps under ``steps/`` whose manifest names another rank are that rank's copies
        now (moved to ``peer/<rank>``, where a peer can fetch them), and copies of this rank's own data under
        ``peer/<rank>`` are its own steps again. A step already where it belongs stays; the duplicate goes."""
        moves: list[tuple[Path, Path]] = []
        own = layout.steps_dir(self.root)
        for step in commit.committed_steps(own):
            src = own / layout.step_name(step)
            rank = _manifest_rank(src)
            if rank is not None and rank != self.rank:
                moves.append((src, layout.peer_dir(self.root, rank) / layout.step_name(step)))
        mine = layout.peer_dir(self.root, self.rank)
        for step in commit.committed_steps(mine):
            src = mine / layout.step_name(step)
            if _manifest_rank(src) == self.rank:
                moves.append((src, own / layout.step_name(step)))
        for src, dst in moves:
            if dst.exists():
                commit.delete_step(src)
                log.info("dropped %s: %s holds that step already", src, dst)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, dst)
            log.warning("this node's RAM disk held %s from an earlier Pod of another rank: now %s (rank %d "
                        "runs here)", src, dst, self.rank)

    # ------------------------------------------------------------------ paths
    def step_dir(self, owner: int, step: int) -> Path:
        if owner == self.rank:
            return layout.steps_dir(self.root) / layout.step_name(step)
        return self.peer_parent(owner) / layout.step_name(step)

    def peer_parent(self, owner: int) -> Path:
        return layout.peer_dir(self.root, owner)

    def _peer_owner_dirs(self) -> list[Path]:
        base = self.root / layout.PEER_DIR
        if not base.is_dir():
            return []
        return [p for p in base.iterdir() if p.is_dir() and layout.parse_step_name(p.name) is not None]

    # ------------------------------------------------------------------ manifests
    def manifest(self, owner: int, step: int) -> layout.StepManifest | None:
        d = self.step_dir(owner, step)
        try:
            ino = os.stat(d / layout.MANIFEST_NAME).st_ino
        except FileNotFoundError:
            return None
        with self._lock:
            hit = self._cache.get(d)
            if hit and hit[0] == ino:
                return hit[1]
        try:
            m = layout.read_manifest(d)
        except (OSError, layout.ManifestError) as e:
            log.warning("ignoring unreadable step %s: %s", d, e)
            return None
        with self._lock:
            self._cache[d] = (ino, m)
        return m

    def own_steps(self) -> list[int]:
        return commit.committed_steps(layout.steps_dir(self.root))

    def peer_steps(self) -> list[tuple[int, int]]:
        out = []
        for d in self._peer_owner_dirs():
            owner = int(d.name)
            out.extend((owner, s) for s in commit.committed_steps(d))
        return out

    def has(self, owner: int, step: int, content_hash: str | None = None) -> bool:
        m = self.manifest(owner, step)
        return m is not None and (content_hash is None or m.content_hash == content_hash)

    def holds_data_for(self, rank: int, step: int, content_hash: str | None) -> bool:
        """True when this host holds ``rank``'s data of ``step`` (or a byte-identical replica's)."""
        if self.has(rank, step, content_hash):
            return True
        if content_hash is None:
            return False
        if self.has(self.rank, step, content_hash):
            return True
        return any(self.has(o, s, content_hash) for o, s in self.peer_steps() if s == step)

    # ------------------------------------------------------------------ inventory
    def inventory(self) -> list[Holding]:
        out: list[Holding] = []
        for step in self.own_steps():
            m = self.manifest(self.rank, step)
            if m is not None and self._intact(self.rank, step, m):
                out.append(Holding(self.rank, step, m.content_hash, m.total_bytes, Tier.LOCAL,
                                   m.generation, rank_ranges(m.savers)))
        for owner, step in self.peer_steps():
            m = self.manifest(owner, step)
            if m is not None and m.rank == owner and self._intact(owner, step, m):
                out.append(Holding(owner, step, m.content_hash, m.total_bytes, Tier.PEER,
                                   m.generation, rank_ranges(m.savers)))
        held = {(h.owner_rank, h.step) for h in out}
        data = list(out)
        with self._lock:
            replicas = dict(self._replica_of)
        for (owner, step), h in replicas.items():
            if (owner, step) in held:
                continue
            # An attestation is valid while bytes of that content are here: the own step a replica's is
            # identical to, a replica's copy restored as this rank's (a self-attestation), or a copy of one
            # replica's data that witnesses another's (both byte-identical; the witness keeps the proof
            # when the hosts that held the replica's own data or its first attestation are gone).
            src = _bytes_with(step, h, data)
            if src is not None:
                out.append(Holding(owner, step, h, 0, Tier.REPLICA, src.generation, src.savers))
        return out

    def _intact(self, owner: int, step: int, m: layout.StepManifest) -> bool:
        """Every file the manifest lists is there at its size (stat only; the bytes are verified when
        read). A committed copy lacking one is a bad copy: dropped, so that no inventory counts it and
        another tier refills it (a step directory is renamed away before it is deleted, so this is never
        a deletion seen half-way)."""
        d = self.step_dir(owner, step)
        for e in m.files:
            try:
                size = os.stat(d / e.name).st_size
            except FileNotFoundError:
                why = f"file {e.name} is missing"
                break
            if size != e.size:
                why = f"file {e.name} has {size} bytes, its manifest says {e.size}"
                break
        else:
            return True
        log.warning("bad copy of rank %d step %d in %s: %s; dropping it (another tier refills it)",
                    owner, step, d, why)
        self.delete(owner, step)
        return False

    def backup_requests(self) -> list[int]:
        """Steps whose immediate backup the writer asked for (Orbax mode overrides this; native: none)."""
        return []

    # ------------------------------------------------------------------ replica attestations
    def _replica_path(self) -> Path:
        return self.root / REPLICA_FILE

    def _load_replicas(self) -> dict[tuple[int, int], str]:
        try:
            raw = json.loads(self._replica_path().read_text())
            return {(int(o), int(s)): str(h) for o, s, h in raw}
        except (OSError, ValueError, TypeError):
            return {}

    def _save_replicas(self) -> None:
        data = json.dumps([[o, s, h] for (o, s), h in sorted(self._replica_of.items())]).encode()
        commit.write_file_atomic(self._replica_path(), data)

    def attest_replica(self, owner: int, step: int, content_hash: str, *, coming: bool = False) -> bool:
        """Record that ``owner``'s data of ``step`` is byte-identical to bytes held here (hash compared, no
        copy): our own step (a data-parallel replica's), or a copy of another replica's data (a witness).
        Reported as ``owner``'s :attr:`Tier.REPLICA` holding while bytes of that content are here.

        ``coming``: a copy of that content is on its way here (the same answer asked for it): recorded now,
        reported once the copy lands (the coordinator that knew the identity may be gone by then). False
        (nothing recorded): no bytes of ``step`` with that content here, nor coming."""
        if not content_hash or not (coming or self.holds_data_for(owner, step, content_hash)):
            return False
        with self._lock:
            if self._replica_of.get((owner, step)) == content_hash:
                return True
            self._replica_of[(owner, step)] = content_hash
            self._save_replicas()
        return True

    def attest_restored(self, step: int, content_hash: str | None) -> bool:
        """Record that this rank's data of ``step`` is the byte-identical peer copy of a data-parallel replica
        held here (a restore from the replica's data, which keeps the replica's name): a self-attestation,
        reported as this rank's :attr:`Tier.REPLICA` holding while that copy is here, so the identity
        survives the loss of the replica's host (issue #19). False (nothing recorded): no such copy, or the
        own data of the step is here."""
        if not content_hash or self.has(self.rank, step):
            return False
        if not any(s == step and self.has(o, s, content_hash) for o, s in self.peer_steps()):
            return False
        with self._lock:
            if self._replica_of.get((self.rank, step)) == content_hash:
                return True
            self._replica_of[(self.rank, step)] = content_hash
            self._save_replicas()
        log.info("rank %d's data of step %d is a replica's copy held here (content %s)", self.rank, step,
                 content_hash[:12])
        return True

    # ------------------------------------------------------------------ deletion
    def delete(self, owner: int, step: int, content_hash: str | None = None) -> bool:
        """Delete this host's copy of ``owner``'s ``step`` and the replica attestations that go with it.

        ``content_hash``: only the copy with that content (the coordinator names the holding it chose to
        delete). A newer save committed under the same name since then — a job that rolled back saves the
        step again, and its sidecar may commit while the coordinator's answer is on its way — is kept, and
        so are attestations of other content. Returns whether a copy was deleted."""
        d = self.step_dir(owner, step)
        if content_hash and (m := self.manifest(owner, step)) is not None and m.content_hash != content_hash:
            deleted = False  # the usual case of that race: the newer save is here already
        else:
            # Checked again once the directory is out of the writers' way (a commit may land in between).
            deleted = commit.delete_step(d, spare=spares.spare_dir(self.root),  # pages kept for the next copy
                                         only_if=None if not content_hash else
                                         lambda trash: _content_hash_in(trash) in (content_hash, None))
        faults.point("gc.after_delete")
        with self._lock:
            self._cache.pop(d, None)
        if content_hash and not deleted and d.exists():
            log.warning("kept rank %d step %d in %s: it holds another save than the one to delete (content %s)",
                        owner, step, d, content_hash[:12])
        # An attestation goes when the coordinator names it, or with the last bytes of its content here
        # (checked outside the lock: manifest()).
        left = {m.content_hash for o, s in [(self.rank, step), *self.peer_steps()]
                if s == step and (m := self.manifest(o, s)) is not None}
        with self._lock:
            gone = [k for k, h in self._replica_of.items() if k[1] == step and (
                h not in left or (k[0] == owner and (not content_hash or h == content_hash or deleted)))]
            for key in gone:
                del self._replica_of[key]
            if gone:
                self._save_replicas()
        if deleted:
            log.info("deleted step %d of rank %d from %s", step, owner, d)
        return deleted


def _bytes_with(step: int, content_hash: str, held: list[Holding]) -> Holding | None:
    """A holding of bytes of ``step`` with ``content_hash`` among ``held`` (the own step first)."""
    return min((x for x in held if x.step == step and x.content_hash == content_hash and x.tier is not Tier.REPLICA),
               key=lambda x: x.tier is not Tier.LOCAL, default=None)


def _content_hash_in(step_dir: Path) -> str | None:
    """The content hash of the step in ``step_dir``; None when it has no readable manifest (debris)."""
    try:
        return layout.read_manifest(step_dir).content_hash
    except (OSError, layout.ManifestError):
        return None


def _manifest_rank(step_dir: Path) -> int | None:
    try:
        return layout.read_manifest(step_dir).rank
    except (OSError, layout.ManifestError) as e:
        log.warning("ignoring unreadable step %s: %s", step_dir, e)
        return None
