"""The sidecar's data service: where a step is, and the data this host lacks brought from the other tiers.

The local control service (:mod:`replicator.control`) answers the sidecar's ``LocateStep``, ``FetchStep``,
``StreamStep`` and ``FetchFiles`` through :class:`SidecarFetch`. It asks the coordinator (through the
heartbeat's link, across a failover) which other tiers hold a rank's step, serves a copy already on this
host's RAM disk (a byte-identical replica's included), and leaves the transfers to the daemon's
:class:`~replicator.fetch.Fetcher`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from mtc_rpc import control_pb2, tier_pb2
from mtc_rpc import coordinator_pb2 as cpb
from replicator.fetch import AbandonedSave, Fetcher, other_sources
from replicator.local.store import RamDiskStore
from replicator.net import rpc
from replicator.peer import protocol as peer_protocol
from replicator.peer.progress import FetchProgress
from replicator.restore_phases import RestoreClock
from sidecar import commit, layout

log = logging.getLogger(__name__)

# A streamed restore looks for the progress of the fetch it started (or joined) this often until it appears.
STREAM_POLL_SECONDS = 0.005
# How long a manifest request waits for the coordinator to hear of a step's newer save when the copies it
# names are of an abandoned one (a rolled-back job saved the step again): a few heartbeats at any job size.
ABANDONED_WAIT_SECONDS = 30.0


class CoordinatorLink(Protocol):
    """The way to the serving coordinator (:class:`replicator.heartbeat.Heartbeat`)."""

    def call_until(self, method: str, request: Any, within_seconds: float) -> Any: ...
    def failover_window(self) -> float: ...


class SidecarFetch:
    """The sidecar's requests for data this host's RAM disk lacks (``LocalControl``'s data calls)."""

    def __init__(self, store: RamDiskStore, fetcher: Fetcher, coordinator: CoordinatorLink, *, rank: int,
                 nodes: int, retry_seconds: float, wake: Callable[[], None]):
        """``retry_seconds``: how long to wait before asking the coordinator again; ``wake``: report to the
        coordinator now (what a fetch brought or dropped)."""
        self._store = store
        self._fetcher = fetcher
        self._coordinator = coordinator
        self._rank, self._nodes = rank, nodes
        self._retry_seconds = retry_seconds
        self._wake = wake

    def locate(self, step: int) -> tuple[list[int], int]:
        """The ranks that saved ``step`` and the save's generation, as the coordinator knows them."""
        layout.step_name(step)
        try:
            resp = self._coordinator.call_until("LocateStep", cpb.LocateStepRequest(step=step),
                                                self._coordinator.failover_window())
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(rpc.details(e)) from None
            raise
        return list(resp.savers), resp.generation

    def fetch_step(self, owner: int, step: int, manifest_only: bool, replace_local: bool,
                   timeout_seconds: float, min_generation: int = 0) -> tuple[str, bytes]:
        """Bring ``owner``'s data of ``step`` here (or just its manifest) from the fastest other tier.

        Returns (the copy's directory relative to the local root, the manifest JSON when ``manifest_only``).
        A copy of a byte-identical data-parallel replica serves as well. ``replace_local``: the local copy
        is bad — drop it, fetch another. ``min_generation`` (manifests): a copy of an older save of the step
        is abandoned, no answer; until the coordinator has heard where the newer save is (the next
        heartbeats), ask it again, for up to ``timeout_seconds`` (at most ``ABANDONED_WAIT_SECONDS``).
        """
        layout.step_name(step)
        self._check_owner(owner)
        store = self._store
        if replace_local:
            if store.manifest(owner, step) is not None or store.step_dir(owner, step).exists():
                log.warning("the sidecar found a bad copy of rank %d step %d: dropping it", owner, step)
                store.delete(owner, step)
                self._wake()
        elif (m := store.manifest(owner, step)) is not None and (not manifest_only
                                                                  or m.generation >= min_generation):
            rel = store.step_dir(owner, step).relative_to(store.root).as_posix()
            return (("", m.to_json()) if manifest_only else (rel, b""))
        if not manifest_only:
            clock = RestoreClock(step, owner, "sidecar")
            with clock.timing("plan"):
                srcs, savers = self._other_sources(owner, step, timeout_seconds)
            out = self._fetcher.for_sidecar(srcs, savers, owner, step, False, clock=clock)
            self._wake()
            return out
        wait = timeout_seconds if min_generation <= 0 else min(max(timeout_seconds, 1.0), ABANDONED_WAIT_SECONDS)
        deadline = time.monotonic() + wait
        while True:
            srcs, savers = self._other_sources(owner, step, max(0.0, deadline - time.monotonic()), any_held=True)
            if (m := self._held_replica(srcs, step)) is not None and m.generation >= min_generation:
                return "", m.to_json()  # an identical replica's copy held here: its manifest serves
            try:
                return self._fetcher.for_sidecar(srcs, savers, owner, step, True, min_generation=min_generation)
            except AbandonedSave as e:  # never with min_generation 0
                if time.monotonic() >= deadline:
                    raise
                log.info("rank %d's step %d: %s; asking the coordinator again", owner, step, e)
            time.sleep(self._retry_seconds)

    def stream_step(self, owner: int, step: int, timeout_seconds: float) -> Iterator[control_pb2.StepLanding]:
        """``fetch_step`` of the whole step, reported while the copy lands (``StreamStep``).

        A peer fetch of the data already running (the coordinator's restore task, a copy) is followed, not
        repeated; else one is started as ``FetchStep`` would. The copy is committed for next time as always;
        the messages only let the sidecar read the files (verifying every block) before that. A copy that
        fails ends the stream with its error: the sidecar then asks ``FetchStep``, which tries the other
        tiers (and waits for the same single-flight fetch)."""
        layout.step_name(step)
        self._check_owner(owner)
        deadline = time.monotonic() + max(timeout_seconds, 1.0)
        store = self._store
        root = store.root

        def committed(owner_of_copy: int) -> control_pb2.StepLanding:
            m = store.manifest(owner_of_copy, step)
            if m is None:
                raise RuntimeError(f"the copy of rank {owner_of_copy} step {step} vanished")
            rel = store.step_dir(owner_of_copy, step).relative_to(root).as_posix()
            return control_pb2.StepLanding(manifest_json=m.to_json(), step_dir=rel, committed=True)

        if store.manifest(owner, step) is not None:
            yield committed(owner)
            return
        clock = RestoreClock(step, owner, "sidecar")
        with clock.timing("plan"):
            srcs, savers = self._other_sources(owner, step, timeout_seconds)
        if (m := self._held_replica(srcs, step)) is not None:
            yield committed(m.rank)
            return
        owners = sorted({s.owner_rank for s in srcs if s.kind != tier_pb2.TIER_BUCKET})
        outcome: dict[str, Any] = {}

        def fetch() -> None:
            try:
                outcome["rel"] = self._fetcher.for_sidecar(srcs, savers, owner, step, False, clock=clock)[0]
            except BaseException as e:  # noqa: BLE001 - handed to the stream
                outcome["error"] = e
            finally:
                self._wake()

        worker = threading.Thread(target=fetch, name="mtc-stream-fetch", daemon=True)
        worker.start()
        progress = None
        while progress is None and worker.is_alive() and time.monotonic() < deadline:
            progress = self._fetcher.landing(owners, step)  # registered within moments of the fetch's start
            if progress is None:
                worker.join(STREAM_POLL_SECONDS)
        if progress is None:  # from the bucket, or done already: answer the committed copy
            worker.join(max(0.0, deadline - time.monotonic()))
            if "error" in outcome:
                raise outcome["error"]
            if "rel" not in outcome:
                raise TimeoutError(f"rank {owner}'s data of step {step} did not arrive in {timeout_seconds:.0f}s")
            d = layout.resolve_under(root, outcome["rel"])
            m = layout.read_manifest(d)
            yield control_pb2.StepLanding(manifest_json=m.to_json(), step_dir=outcome["rel"], committed=True)
            return
        yield from self._landing(progress, root, owner, step, deadline, timeout_seconds)

    @staticmethod
    def _landing(progress: FetchProgress, root: Path, owner: int, step: int, deadline: float,
                 timeout_seconds: float) -> Iterator[control_pb2.StepLanding]:
        """The copy's manifest, directories and each file's bytes landed so far, as ``progress`` reports them,
        until the copy is committed (ConnectionError if it fails, TimeoutError past ``deadline``)."""
        version, sent = -1, None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {owner}'s data of step {step} did not land in {timeout_seconds:.0f}s")
            snap = progress.wait(version, min(left, 1.0))
            if snap.version == version and not snap.finished:
                continue
            version = snap.version
            if snap.error is not None:
                raise ConnectionError(f"the copy of step {step} failed while landing: {snap.error}")
            if snap.manifest is None or snap.tmp_dir is None or snap.final_dir is None:
                continue  # the fetch has not begun writing
            msg = control_pb2.StepLanding(committed=snap.committed)
            if sent is None:
                msg.manifest_json = snap.manifest.to_json()
                msg.tmp_dir = snap.tmp_dir.relative_to(root).as_posix()
                msg.step_dir = snap.final_dir.relative_to(root).as_posix()
                msg.part_suffix = peer_protocol.PART_SUFFIX
                sent = [-1] * len(snap.landed)
            for i, n in enumerate(snap.landed):
                if n != sent[i]:
                    msg.landed.add(index=i, bytes=n)
                    sent[i] = n
            yield msg
            if snap.committed:
                return

    def fetch_files(self, owner: int, step: int, entries: list[layout.FileEntry], dest_rel: str,
                    timeout_seconds: float, pieces: Sequence[layout.FilePiece] = ()) -> tuple[str, int]:
        """Bring only ``entries`` (files of ``owner``'s ``step``, as the caller's copy of its manifest lists
        them) into the caller's scratch directory ``dest_rel``: from a peer's RAM disk through the peer
        service, else the bucket with ranged reads. A source whose manifest does not list every entry
        identically (another save, or a replica that names its files differently) fails and the next is tried;
        each file gets its name only once its crc32c matched, and a source that fails mid-way leaves the rest to
        the next. ``pieces``: only these byte ranges of the entries, from a peer (the bucket sends whole files).
        Returns (where from, bytes moved)."""
        layout.step_name(step)
        self._check_owner(owner)
        if not entries:
            raise ValueError("no files asked for")
        dest = layout.check_fetch_dir(self._store.root, dest_rel)
        commit.remove_tmp_dirs(dest.parent)  # scratch directories of readers that died (unlocked ones)
        clock = RestoreClock(step, owner, "files")
        with clock.timing("plan"):
            srcs, savers = self._other_sources(owner, step, timeout_seconds)
        return self._fetcher.files_for_sidecar(srcs, savers, owner, step, entries, dest, pieces, clock=clock)

    # ------------------------------------------------------------------ helpers
    def _check_owner(self, owner: int) -> None:
        if not 0 <= owner < self._nodes:
            raise ValueError(f"unknown rank {owner}: the job has ranks 0..{self._nodes - 1}")

    def _held_replica(self, srcs: list[Any], step: int) -> layout.StepManifest | None:
        """The manifest of a copy held here of one of ``srcs`` (its owner, its content), if any."""
        for src in srcs:
            if src.kind != tier_pb2.TIER_BUCKET and self._store.has(src.owner_rank, step,
                                                                           src.content_hash or None):
                return self._store.manifest(src.owner_rank, step)
        return None

    def _other_sources(self, owner: int, step: int, timeout_seconds: float,
                       any_held: bool = False) -> tuple[list[Any], list[int]]:
        """(the coordinator's sources of ``owner``'s ``step`` data beyond this host's RAM disk, fastest
        first; the step's savers). ``any_held``: answer at once, too, when a source's copy (an identical
        replica's data) is on this host's RAM disk: enough to serve a manifest."""
        # A coordinator that just took over learns the holdings from the next heartbeats: ask again a while.
        window = self._coordinator.failover_window()
        deadline = time.monotonic() + min(max(timeout_seconds, 1.0), window)
        while True:
            resp = self._coordinator.call_until("LocateStep", cpb.LocateStepRequest(step=step, owners=[owner]),
                                                window)
            every = list(resp.ranks[0].sources) if resp.ranks else []
            srcs = other_sources(every, self._rank)
            if any_held and self._held_replica(every, step) is not None:
                return every, list(resp.savers)
            if srcs or time.monotonic() >= deadline:
                return srcs, list(resp.savers)
            time.sleep(self._retry_seconds)
