"""`mtc replicator`: the per-host daemon tying the store, peer transfer, coordinator and backup together.

This module is the composition and the lifecycle (start, stop, a preemption's flush); the parts live in
modules of their own: :mod:`replicator.heartbeat` (the report loop and coordinator failover),
:mod:`replicator.tasks` (the task executor: single-flight, backoff), :mod:`replicator.fetch` (bringing data
from a peer or the bucket, one ladder over the sources) and :mod:`replicator.control` (the sidecar's local
control service). One heartbeat loop reports this host's inventory to the coordinator and carries out what
the answer asks: pull copies from peers, record byte-identical replicas (hash only), delete what GC
released, fetch this rank's data for the step to restore, upload a backup share.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from mtc_rpc import control_pb2, peer_pb2_grpc
from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import coordinator_pb2_grpc as cpb_grpc
from replicator import logs, preemption
from replicator.control import serve_control
from replicator.coordinator.model import Tier
from replicator.coordinator.service import BackupScheduler, Coordinator
from replicator.coordinator.tier_wire import from_wire
from replicator.coordinator.topology import JobTopology
from replicator.fetch import AbandonedSave, Fetcher, other_sources
from replicator.heartbeat import Heartbeat, new_incarnation
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics, TimedCoordinator
from replicator.net import rpc
from replicator.net.security import AdminGate, TlsOptions, rank_authorizer
from replicator.options import ConfigError, ReplicatorOptions
from replicator.peer import protocol as peer_protocol
from replicator.peer import server as peer_server
from replicator.tasks import TaskRunner
from sidecar import commit, layout

if TYPE_CHECKING:  # the bucket's backends load only when a --backup-url is configured
    from replicator.backup.agent import BackupAgent

__all__ = ["PREEMPTION_RECORD", "Replicator", "build_replicator", "new_incarnation"]

log = logging.getLogger(__name__)


class _ServingOnly:
    """A servicer whose RPCs answer only on the serving coordinator candidate (a standby's view is empty)."""

    def __init__(self, inner: Any, coordinator: Coordinator):
        self._inner = inner
        self._coordinator = coordinator

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name.startswith("_") or not callable(fn):
            return fn

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if not self._coordinator.active:
                context.abort(grpc.StatusCode.UNAVAILABLE, "standby coordinator candidate: ask the serving one")
            return fn(request, context)

        return call


# Written into the host's local directory when the daemon ends after a preemption notice.
PREEMPTION_RECORD = "preemption.json"
# A streamed restore looks for the progress of the fetch it started (or joined) this often until it appears.
STREAM_POLL_SECONDS = 0.005
# How long a manifest request waits for the coordinator to hear of a step's newer save when the copies it
# names are of an abandoned one (a rolled-back job saved the step again): a few heartbeats at any job size.
ABANDONED_WAIT_SECONDS = 30.0


class Replicator:
    """One host's replicator. ``start()`` binds and returns the port; ``stop()`` shuts down cleanly."""

    def __init__(
        self,
        opts: ReplicatorOptions,
        *,
        rank: int,
        nodes: int,
        job: str,
        data_parallelism: int = 1,
        bucket: BackupAgent | None = None,
        backup_scheduler_factory: Callable[[JobTopology], BackupScheduler] | None = None,
        store: RamDiskStore | None = None,
    ):
        self.opts = opts
        self.rank, self.nodes, self.job = rank, nodes, job
        self.topology = JobTopology(nodes, data_parallelism, opts.replicas)
        self.store = store if store is not None else RamDiskStore(opts.local_dir, rank)
        self.token = opts.token()
        self.bucket = bucket  # this host's side of the backup tier (None: no --backup-url)
        self.incarnation = new_incarnation()
        logs.set_context(job=job, rank=rank, incarnation=self.incarnation)
        self.coordinator: Coordinator | None = None
        # Coordinator failover: every candidate serves a (standby) coordinator; the lowest-ranked live one
        # is active (docs/coordinator.md).
        # Candidates are labelled by rank, or in Orbax mode by allocation index (stable when Orbax renumbers
        # the hosts at an elastic event; docs/orbax.md).
        self.candidates = opts.coordinator_candidate_list()
        self._me = opts.allocation_index if opts.allocation_index is not None else rank
        # Orbax mode: the node count changes between incarnations (elastic); reports carry it, so that a
        # coordinator of a previous incarnation (another node count) is skipped like a standby. Native mode
        # has one node count for the job's life: a mismatch there is a misconfiguration, not a failover.
        self.fence_nodes = nodes if opts.allocation_index is not None else 0
        self.my_candidate = next((i for i, (r, _) in enumerate(self.candidates) if r == self._me), None)
        # Mutual TLS: reports are bound to the rank the client certificate names (docs/security.md); this
        # also refuses to start with a certificate issued for another rank or job.
        try:
            authorizer = rank_authorizer(self.tls(), job, opts.tls_rank_identity, rank,
                                         pods=opts.pod_rank_rule(job, nodes, data_parallelism))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if authorizer is not None and self.my_candidate is not None:
            log.info("mutual TLS: a certificate naming mtc://%s/rank/N reports only for rank N; one naming no "
                     "rank is %s", job, "refused" if authorizer.require else
                     "accepted for any rank (this replicator's own names none: one certificate for the whole job)")
        if self.my_candidate is not None:
            factory = (lambda: backup_scheduler_factory(self.topology)) if backup_scheduler_factory else None
            self.coordinator = Coordinator(self.topology, job, keep_local=opts.keep_local,
                                           authorizer=authorizer,
                                           heartbeat_seconds=opts.heartbeat_seconds, backup_factory=factory,
                                           force_restore_step=opts.restore_from_backup,
                                           host_lost_seconds=opts.host_lost_seconds,
                                           max_heartbeats_per_second=opts.max_heartbeats_per_second,
                                           active=False, other_candidates=len(self.candidates) > 1)
        self._server: grpc.Server | None = None
        self._control_server: grpc.Server | None = None
        self._transfer_server: peer_server.TransferServer | None = None
        self._wake = threading.Event()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.address = ""
        self.newest_complete = -1
        # Preemption (SIGTERM): this host got the notice / the coordinator says some host did.
        self.preempting = False
        self.preemption_noticed = False
        self.started_wall = time.time()  # a restart record older than this daemon is an earlier Pod's
        self._backup_now = False
        # Typed, locked counters and every Prometheus metric of this process (see replicator/metrics.py).
        self.metrics = ReplicatorMetrics(self.store.root)
        self.counters = self.metrics.counters
        self._restoring: set[int] = set()  # steps being fetched for a restore: not saves
        self.tasks = TaskRunner(threads=opts.transfer_threads, bulk_priority=opts.bulk_priority,
                                backoff_base_seconds=min(1.0, opts.heartbeat_seconds),
                                wait_seconds=opts.transfer_timeout_seconds, counters=self.counters,
                                on_success=self.wake)
        self.fetcher = Fetcher(opts, self.store, self.tasks, bucket, self.metrics, token=self.token,
                               tls=self.tls())
        self.heartbeats = Heartbeat(self)
        if self.coordinator is not None:
            from replicator.coordinator.admin import cluster_view

            coord = self.coordinator
            # Only the serving candidate exports the job-wide view (a standby knows nothing yet).
            self.metrics.cluster_view = lambda: cluster_view(coord) if coord.active else None
        if self.bucket is not None:
            self.bucket.on_upload = self._on_upload

    @property
    def errors(self) -> list[str]:
        """The most recent task failures (for the local status)."""
        return self.tasks.errors

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        self.opts.check_exposure()  # no unauthenticated service beyond loopback unless --insecure
        host = self.opts.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        throttle = peer_protocol.Throttle(bytes_per_second=float(self.opts.max_bytes_per_second) or None,
                                     max_streams=max(1, self.opts.transfer_threads))
        tls = self.tls()
        if tls is None:
            # Bulk bytes go over a plain TCP data port (sendfile): gRPC streaming reaches only 40-60 % of
            # loopback TCP here. With TLS the data stays on the (encrypted) gRPC stream instead.
            self._transfer_server = peer_server.TransferServer(host, self.opts.data_port, throttle=throttle,
                                                               bulk_priority=self.opts.bulk_priority)
            self._transfer_server.start()
        peer = peer_server.PeerServicer(self.store.root, self.rank, self.nodes,
                                     transfer_server=self._transfer_server, throttle=throttle)
        servicers = [(peer_pb2_grpc.add_PeerServicer_to_server, peer)]
        if self.coordinator is not None:
            from mtc_rpc import admin_pb2_grpc
            from replicator.coordinator.admin import ADMIN_ACTIONS, AdminServicer

            admin = AdminServicer(self.coordinator)
            timed = TimedCoordinator(admin.wrap(self.coordinator), self.metrics)
            admin.coord = timed  # `mtc restore` plans through the same (timed) PrepareRestore
            servicers.append((cpb_grpc.add_CoordinatorServicer_to_server, timed))
            gated: Any = admin
            if self.coordinator.authorizer is not None:  # mutual TLS: actions need the admin certificate
                gated = AdminGate(admin, self.coordinator.authorizer, ADMIN_ACTIONS)
            servicers.append((admin_pb2_grpc.add_AdminServicer_to_server, _ServingOnly(gated, self.coordinator)))
        self._server, port = rpc.create_server(
            self.opts.listen, servicers, token=self.token, tls=tls,
            max_message_bytes=self.opts.max_message_bytes, max_workers=16)
        self._server.start()
        self.fetcher.throttle = throttle
        # Listening on every interface: other hosts reach us by our host name (a Pod's resolves to its IP).
        adv_host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        self.address = self.opts.advertise or f"{adv_host}:{port}"
        self._control_server = serve_control(self, self.store.root)
        addrs = [a or (self.address if r == self._me else "") for r, a in self.candidates]
        if self.coordinator is not None:
            if not self.opts.coordinator_candidates and not self.opts.coordinator:
                addrs[self.my_candidate] = self.address
            self.coordinator.address = addrs[self.my_candidate]
            if self.my_candidate == 0:
                self.coordinator.activate(max(time.time_ns(), self.heartbeats.epoch + 1))
        self.heartbeats.connect(addrs)
        coord = ",".join(addrs)
        if self.opts.metrics_port is not None:
            mport = self.metrics.serve(host, self.opts.metrics_port)
            print(f"METRICS {adv_host}:{mport}", flush=True)
        self._thread = threading.Thread(target=self.heartbeats.run, name="mtc-heartbeat", daemon=True)
        self._thread.start()
        log.info("replicator rank %d/%d of job %s listening on %s (coordinator %s)",
                 self.rank, self.nodes, self.job, self.address, coord)
        return port

    def tls(self) -> TlsOptions | None:
        if not self.opts.tls_cert:
            return None
        return TlsOptions(cert_file=Path(self.opts.tls_cert), key_file=Path(self.opts.tls_key),
                          ca_file=Path(self.opts.tls_ca) if self.opts.tls_ca else None)

    def wake(self) -> None:
        self._wake.set()

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop taking work, let in-flight transfers finish or abandon them (never half-visible)."""
        self.stopping.set()
        self.tasks.shutdown()  # no new task; running ones finish or are abandoned
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=grace_seconds + self.opts.rpc_timeout_seconds)
        if self._control_server is not None:
            self._control_server.stop(0)
        if self._server is not None:
            rpc.stop_server(self._server, grace_seconds)
        if self._transfer_server is not None:
            self._transfer_server.stop(grace_seconds)
        self.metrics.stop()
        self.heartbeats.close()
        layout.control_socket(self.store.root).unlink(missing_ok=True)
        # Abandoned fetches leave only temporary directories: remove them now.
        commit.remove_tmp_dirs(layout.steps_dir(self.store.root))
        for owner_dir in (self.store.root / layout.PEER_DIR).glob("*"):
            commit.remove_tmp_dirs(owner_dir)

    def wait_for_signal(self) -> None:
        done = threading.Event()
        got: list[int] = []

        def handler(signum, frame):
            log.info("signal %d: shutting down", signum)
            got.append(signum)
            done.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        while not done.wait(1.0):
            pass
        if got and got[0] == signal.SIGTERM and self.opts.preemption_grace_seconds > 0:
            if preemption.restart_recorded(self.store.root, self.started_wall):
                # `mtc preempt --on-restart skip`: a JobSet restart or hot-swap, not a notice; the RAM disk
                # outlives this Pod, the replacement restores from it and from peers.
                log.info("SIGTERM of a JobSet restart: no emergency backup")
            else:
                self.flush_on_preemption(self.opts.preemption_grace_seconds)
        self.stop()

    def flush_on_preemption(self, grace_seconds: float) -> dict[str, Any]:
        """A preemption notice: within ``grace_seconds`` get the newest complete step into the bucket.

        The heartbeat tells the coordinator at once; it starts an emergency backup of the newest complete
        step (no interval), which every host uploads unthrottled at normal priority. The outcome is logged
        and written to ``<local>/preemption.json`` (``finished`` false when the grace ran out first).
        """
        t0 = time.monotonic()
        deadline = t0 + max(0.0, grace_seconds - 1.0)  # leave a second to stop cleanly
        self.preempting = self.preemption_noticed = True
        if self.bucket is not None:
            self.bucket.unthrottle()  # emergency: no upload throttle
        step, finished, why = -1, self.bucket is None, "no backup tier configured" if self.bucket is None else ""
        # The bucket commit is the coordinator's: once no candidate has answered for a while (long enough
        # for a standby to take over), waiting out the rest of the grace cannot help and only delays exit.
        unreachable_limit = max(3.0, 4 * self.heartbeats.interval)
        unreachable_since: float | None = None
        while not finished and time.monotonic() < deadline:
            self._wake.set()
            try:
                resp = self.call_coordinator("GetSteps", cpb.GetStepsRequest(wait_seconds=0),
                                             timeout=max(0.5, min(self.opts.rpc_timeout_seconds,
                                                                 deadline - time.monotonic())))
                unreachable_since = None
                step = resp.newest_complete_step
                if step < 0:
                    finished, why = True, "no complete step to back up"
                elif step in resp.backed_up_steps:
                    finished, why = True, f"step {step} is in the bucket"
            except grpc.RpcError as e:
                why = f"coordinator unreachable: {rpc.details(e)}"
                now = time.monotonic()
                unreachable_since = now if unreachable_since is None else unreachable_since
                if now - unreachable_since >= unreachable_limit:
                    why += f" for {now - unreachable_since:.1f}s: gave up"
                    break
            if not finished:
                time.sleep(0.1)
        if not finished and not why:
            why = f"grace of {grace_seconds}s ran out before step {step} was committed in the bucket"
        rec = {"step": step, "finished": finished, "reason": why, "seconds": round(time.monotonic() - t0, 3)}
        if finished and self.coordinator is not None and self.bucket is not None and self.nodes > 1:
            # The other hosts learn the outcome from this coordinator: stay a few heartbeats longer (not
            # when there is no other host or no bucket: nothing to learn, exit at once).
            time.sleep(max(0.0, min(deadline - time.monotonic(), 3 * self.opts.heartbeat_seconds + 1.0)))
        (log.info if finished else log.warning)("preemption flush: %s", rec)
        try:
            (self.store.root / PREEMPTION_RECORD).write_text(json.dumps(rec))
        except OSError as e:
            log.warning("cannot record the preemption flush: %s", e)
        return rec

    def request_backup_now(self) -> None:
        """The training loop asks for an immediate backup of the newest complete step."""
        self._backup_now = True
        self._wake.set()

    def locate(self, step: int) -> tuple[list[int], int]:
        """The ranks that saved ``step`` and the save's generation, as the coordinator knows them."""
        layout.step_name(step)
        try:
            resp = self.call_coordinator_until("LocateStep", cpb.LocateStepRequest(step=step),
                                               self.heartbeats.failover_window())
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(rpc.details(e)) from None
            raise
        return list(resp.savers), resp.generation

    def fetch_for_sidecar(self, owner: int, step: int, manifest_only: bool, replace_local: bool,
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
        if replace_local:
            if self.store.manifest(owner, step) is not None or self.store.step_dir(owner, step).exists():
                log.warning("the sidecar found a bad copy of rank %d step %d: dropping it", owner, step)
                self.store.delete(owner, step)
                self.wake()
        elif (m := self.store.manifest(owner, step)) is not None and (not manifest_only
                                                                       or m.generation >= min_generation):
            rel = self.store.step_dir(owner, step).relative_to(self.store.root).as_posix()
            return (("", m.to_json()) if manifest_only else (rel, b""))
        if not manifest_only:
            srcs, savers = self._other_sources(owner, step, timeout_seconds)
            out = self.fetcher.for_sidecar(srcs, savers, owner, step, False)
            self.wake()
            return out
        wait = timeout_seconds if min_generation <= 0 else min(max(timeout_seconds, 1.0), ABANDONED_WAIT_SECONDS)
        deadline = time.monotonic() + wait
        while True:
            srcs, savers = self._other_sources(owner, step, max(0.0, deadline - time.monotonic()), any_held=True)
            if (m := self._held_replica(srcs, step)) is not None and m.generation >= min_generation:
                return "", m.to_json()  # an identical replica's copy held here: its manifest serves
            try:
                return self.fetcher.for_sidecar(srcs, savers, owner, step, True, min_generation=min_generation)
            except AbandonedSave as e:  # never with min_generation 0
                if time.monotonic() >= deadline:
                    raise
                log.info("rank %d's step %d: %s; asking the coordinator again", owner, step, e)
            time.sleep(min(0.5, self.opts.heartbeat_seconds))

    def _held_replica(self, srcs: list[Any], step: int) -> layout.StepManifest | None:
        """The manifest of a copy held here of one of ``srcs`` (its owner, its content), if any."""
        for src in srcs:
            if from_wire(src.kind) is not Tier.BUCKET and self.store.has(src.owner_rank, step,
                                                                          src.content_hash or None):
                return self.store.manifest(src.owner_rank, step)
        return None

    def stream_for_sidecar(self, owner: int, step: int, timeout_seconds: float) -> Iterator[control_pb2.StepLanding]:
        """``fetch_for_sidecar`` of the whole step, reported while the copy lands (``StreamStep``).

        A peer fetch of the data already running (the coordinator's restore task, a copy) is followed, not
        repeated; else one is started as ``FetchStep`` would. The copy is committed for next time as always;
        the messages only let the sidecar read the files (verifying every block) before that. A copy that
        fails ends the stream with its error: the sidecar then asks ``FetchStep``, which tries the other
        tiers (and waits for the same single-flight fetch)."""
        layout.step_name(step)
        self._check_owner(owner)
        deadline = time.monotonic() + max(timeout_seconds, 1.0)
        root = self.store.root

        def committed(owner_of_copy: int) -> control_pb2.StepLanding:
            m = self.store.manifest(owner_of_copy, step)
            if m is None:
                raise RuntimeError(f"the copy of rank {owner_of_copy} step {step} vanished")
            rel = self.store.step_dir(owner_of_copy, step).relative_to(root).as_posix()
            return control_pb2.StepLanding(manifest_json=m.to_json(), step_dir=rel, committed=True)

        if self.store.manifest(owner, step) is not None:
            yield committed(owner)
            return
        srcs, savers = self._other_sources(owner, step, timeout_seconds)
        if (m := self._held_replica(srcs, step)) is not None:
            yield committed(m.rank)
            return
        owners = sorted({s.owner_rank for s in srcs if from_wire(s.kind) is not Tier.BUCKET})
        outcome: dict[str, Any] = {}

        def fetch() -> None:
            try:
                outcome["rel"] = self.fetcher.for_sidecar(srcs, savers, owner, step, False)[0]
            except BaseException as e:  # noqa: BLE001 - handed to the stream
                outcome["error"] = e
            finally:
                self.wake()

        worker = threading.Thread(target=fetch, name="mtc-stream-fetch", daemon=True)
        worker.start()
        progress = None
        while progress is None and worker.is_alive() and time.monotonic() < deadline:
            progress = self.fetcher.landing(owners, step)  # registered within moments of the fetch's start
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

    def fetch_files_for_sidecar(self, owner: int, step: int, entries: list[layout.FileEntry], dest_rel: str,
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
        dest = layout.check_fetch_dir(self.store.root, dest_rel)
        commit.remove_tmp_dirs(dest.parent)  # scratch directories of readers that died (unlocked ones)
        srcs, savers = self._other_sources(owner, step, timeout_seconds)
        return self.fetcher.files_for_sidecar(srcs, savers, owner, step, entries, dest, pieces)

    def _check_owner(self, owner: int) -> None:
        if not 0 <= owner < self.nodes:
            raise ValueError(f"unknown rank {owner}: the job has ranks 0..{self.nodes - 1}")

    def _other_sources(self, owner: int, step: int, timeout_seconds: float,
                       any_held: bool = False) -> tuple[list[Any], list[int]]:
        """(the coordinator's sources of ``owner``'s ``step`` data beyond this host's RAM disk, fastest
        first; the step's savers). ``any_held``: answer at once, too, when a source's copy (an identical
        replica's data) is on this host's RAM disk: enough to serve a manifest."""
        # A coordinator that just took over learns the holdings from the next heartbeats: ask again a while.
        window = self.heartbeats.failover_window()
        deadline = time.monotonic() + min(max(timeout_seconds, 1.0), window)
        while True:
            resp = self.call_coordinator_until("LocateStep", cpb.LocateStepRequest(step=step, owners=[owner]),
                                               window)
            every = list(resp.ranks[0].sources) if resp.ranks else []
            srcs = other_sources(every, self.rank)
            if any_held and self._held_replica(every, step) is not None:
                return every, list(resp.savers)
            if srcs or time.monotonic() >= deadline:
                return srcs, list(resp.savers)
            time.sleep(min(0.5, self.opts.heartbeat_seconds))

    # ------------------------------------------------------------------ the coordinator
    def call_coordinator(self, method: str, request: Any, timeout: float) -> Any:
        """One RPC to the serving coordinator (the first candidate that answers)."""
        return self.heartbeats.call(method, request, timeout)

    def call_coordinator_until(self, method: str, request: Any, within_seconds: float) -> Any:
        """:meth:`call_coordinator`, retried (with backoff) across a coordinator failover for ``within_seconds``."""
        return self.heartbeats.call_until(method, request, within_seconds)

    # ------------------------------------------------------------------ what the heartbeat asks of the daemon
    def restore(self, task: cpb.RestoreTask) -> None:
        """The restore task: this rank's data of the step to restore (not counted as a save when it lands)."""
        with self._lock:
            self._restoring.add(task.step)
        self.fetcher.restore(self.rank, task)

    def restored_among(self, steps: set[int]) -> set[int]:
        """Which of these own steps on the RAM disk a restore brought (forgotten once asked)."""
        with self._lock:
            restored = self._restoring & steps
            self._restoring -= restored
        return restored

    def take_backup_now(self) -> bool:
        """Whether the training loop asked for a backup since the last heartbeat (and forget it)."""
        asked, self._backup_now = self._backup_now, False
        return asked

    def wait_for_wake(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _on_upload(self, step: int, rank: int, nbytes: int, seconds: float, error: str = "") -> None:
        if error:
            self.counters.add("backup_upload_failures")
            return
        self.counters.add("backup_uploads")
        self.counters.add("backup_upload_bytes", nbytes)
        self.metrics.observe_transfer("backup_upload", seconds)
        log.info("backup: uploaded rank %d of step %d: %d bytes in %.3fs (%.1f MiB/s)", rank, step, nbytes,
                 seconds, nbytes / max(seconds, 1e-9) / 2**20)

    # ------------------------------------------------------------------ status
    def local_status(self) -> control_pb2.GetLocalStatusResponse:
        """This host's view, typed (``mtc status --local-dir``, probes under TLS, tests)."""
        in_flight = self.tasks.in_flight()
        st = control_pb2.GetLocalStatusResponse(
            job=self.job, rank=self.rank, nodes=self.nodes, address=self.address or "",
            metrics_address=self.metrics.metrics_address or "",
            own_steps=self.store.own_steps(),
            peer_steps=[control_pb2.LocalPiece(owner_rank=o, step=s) for o, s in self.store.peer_steps()],
            newest_complete_step=self.newest_complete,
            in_flight=[control_pb2.LocalTask(kind=k, owner_rank=o, step=s) for k, o, s in in_flight],
            counters=self.counters.snapshot(), recent_errors=list(self.errors),
        )
        if self.bucket is not None:
            b = self.bucket.status()
            st.has_backup = True
            st.backup_uploaded_bytes = b.uploaded_bytes
            st.backup_last_error = b.last_error
        return st


def build_replicator(opts: ReplicatorOptions, store: Any = None) -> Any:
    """A :class:`replicator.daemon.Replicator` for fully resolved options (rank and nodes known).

    ``store``: a :class:`replicator.local.store.RamDiskStore` (subclass) to use instead of the default one.
    """
    bucket = None
    scheduler = None
    if opts.backup_url:
        from replicator.backup.tier import make_backup

        bucket, scheduler = make_backup(opts, opts.job, opts.rank, opts.nodes)
    return Replicator(opts, rank=opts.rank, nodes=opts.nodes, job=opts.job,
                      data_parallelism=opts.data_parallelism, bucket=bucket,
                      backup_scheduler_factory=scheduler, store=store)
