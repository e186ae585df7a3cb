"""`mtc replicator`: the per-host daemon tying the store, peer transfer, coordinator and backup together.

This module is the composition and the lifecycle (start, stop); the parts live in modules of their own:
:mod:`replicator.heartbeat` (the report loop and coordinator failover), :mod:`replicator.tasks` (the task
executor: single-flight, backoff), :mod:`replicator.fetch` (bringing data from a peer or the bucket, one
ladder over the sources), :mod:`replicator.sidecar_fetch` (the sidecar's data requests),
:mod:`replicator.preemption` (a notice and the flush) and :mod:`replicator.control` (the sidecar's local
control service). One heartbeat loop reports this host's inventory to the coordinator and carries out what
the answer asks: pull copies from peers, record byte-identical replicas (hash only), delete what GC
released, fetch this rank's data for the step to restore, upload a backup share.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from mtc_rpc import control_pb2, peer_pb2_grpc
from mtc_rpc import coordinator_pb2_grpc as cpb_grpc
from replicator import logs, preemption
from replicator.control import serve_control
from replicator.coordinator.backup_hook import BackupScheduler
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.erasure import spread as ec_spread
from replicator.erasure.duty import ParityDuty
from replicator.erasure.holder import ParityStore
from replicator.erasure.host import EcHost
from replicator.fetch import Fetcher
from replicator.heartbeat import Heartbeat, HostParts, Reporter, Wakeup, new_incarnation
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics, TimedCoordinator
from replicator.net import rpc
from replicator.net.address import host_of
from replicator.net.security import AdminGate, TlsOptions, rank_authorizer
from replicator.options import ConfigError, ReplicatorOptions
from replicator.peer import protocol as peer_protocol
from replicator.peer import server as peer_server
from replicator.preemption import Preemption, PreemptionState
from replicator.sidecar_fetch import SidecarFetch
from replicator.tasks import TaskRunner
from sidecar import commit, layout

if TYPE_CHECKING:  # the bucket's backends load only when a --backup-url is configured
    from replicator.backup.agent import BackupAgent

__all__ = ["Replicator", "build_replicator", "new_incarnation"]

log = logging.getLogger(__name__)


class _ServingOnly:
    """A servicer whose RPCs answer only on the serving coordinator candidate, and not while it is isolated
    (a standby's view is empty, an isolated one's stale: ``Coordinator.check_serving``)."""

    def __init__(self, inner: Any, coordinator: Coordinator):
        self._inner = inner
        self._coordinator = coordinator

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name.startswith("_") or not callable(fn):
            return fn

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            self._coordinator.check_serving(context)
            return fn(request, context)

        return call



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
        incarnation = new_incarnation()
        logs.set_context(job=job, rank=rank, incarnation=incarnation)
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
        self.coordinator = self._candidate_coordinator(data_parallelism, backup_scheduler_factory)
        self._server: grpc.Server | None = None
        self._control_server: grpc.Server | None = None
        self._transfer_server: peer_server.TransferServer | None = None
        self._wakeup = Wakeup()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.address = ""
        self.started_wall = time.time()  # a restart record older than this daemon is an earlier Pod's
        # Typed, locked counters and every Prometheus metric of this process (see replicator/metrics.py).
        self.metrics = ReplicatorMetrics(self.store.root)
        self.counters = self.metrics.counters
        self.tasks = TaskRunner(threads=opts.transfer_threads, bulk_priority=opts.bulk_priority,
                                backoff_base_seconds=min(1.0, opts.heartbeat_seconds),
                                wait_seconds=opts.transfer_timeout_seconds, counters=self.counters,
                                on_success=self.wake)
        self.fetcher = Fetcher(opts, self.store, self.tasks, bucket, self.metrics, token=self.token,
                               tls=self.tls())
        # Erasure coding (issue #35): this host's parity, computed on the coordinator's ParityTasks, and its
        # rank's data rebuilt from its code group (a restore source of tier PARITY). Inert until asked.
        self.parity = ParityStore(self.store.root, rank)
        self.fetcher.ec = EcHost(rank, self.store.root, self.parity, token=self.token, tls=self.tls(),
                                 timeout_seconds=opts.transfer_timeout_seconds,
                                 rpc_timeout_seconds=opts.rpc_timeout_seconds,
                                 bytes_per_second=float(opts.max_bytes_per_second) or None,
                                 pipeline=opts.ec_rebuild == "pipelined")
        # Preemption (a notice, SIGTERM): this host got the notice / the coordinator says some host did.
        state = PreemptionState()
        self.heartbeats = Heartbeat(
            opts, Reporter(job, rank, nodes, fence_nodes=self.fence_nodes, my_candidate=self.my_candidate),
            HostParts(store=self.store, tasks=self.tasks, fetcher=self.fetcher, metrics=self.metrics,
                      preemption=state, wakeup=self._wakeup, stopping=self.stopping,
                      coordinator=self.coordinator, bucket=bucket,
                      parity=ParityDuty(self.fetcher.ec, self.tasks, self.wake, self.counters)),
            incarnation=incarnation, tls=self.tls(), token=self.token)
        self.preemption = Preemption(state, self.heartbeats, root=self.store.root, wake=self.wake, bucket=bucket,
                                     rpc_timeout_seconds=opts.rpc_timeout_seconds,
                                     heartbeat_seconds=opts.heartbeat_seconds,
                                     tells_others=self.coordinator is not None and nodes > 1, rank=rank,
                                     others_told=(None if self.coordinator is None else
                                                  functools.partial(self.coordinator.flush_told, me=rank)))
        self.sidecar_fetch = SidecarFetch(self.store, self.fetcher, self.heartbeats, rank=rank, nodes=nodes,
                                          retry_seconds=min(0.5, opts.heartbeat_seconds), wake=self.wake)
        if self.coordinator is not None:
            from replicator.coordinator.admin import cluster_view

            coord = self.coordinator
            # Only the serving candidate exports the job-wide view (a standby knows nothing yet).
            self.metrics.cluster_view = lambda: cluster_view(coord) if coord.active else None
        if self.bucket is not None:
            self.bucket.on_upload = self._on_upload

    def _candidate_coordinator(
        self, data_parallelism: int, backup_scheduler_factory: Callable[[JobTopology], BackupScheduler] | None
    ) -> Coordinator | None:
        """This host's (standby) coordinator when it is a candidate, else None; its mutual-TLS authorizer."""
        opts, job, rank, nodes = self.opts, self.job, self.rank, self.nodes
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
        if self.my_candidate is None:
            return None
        factory = (lambda: backup_scheduler_factory(self.topology)) if backup_scheduler_factory else None
        return Coordinator(self.topology, job, keep_local=opts.keep_local, authorizer=authorizer,
                           heartbeat_seconds=opts.heartbeat_seconds, backup_factory=factory,
                           force_restore_step=opts.restore_from_backup, host_lost_seconds=opts.host_lost_seconds,
                           max_heartbeats_per_second=opts.max_heartbeats_per_second, active=False,
                           other_candidates=len(self.candidates) > 1, candidate=self.my_candidate,
                           redundancy=opts.effective_redundancy, elastic=opts.allocation_index is not None,
                           # Native mode: candidates are labelled by rank (Orbax mode: by allocation index).
                           lower_candidates=() if opts.allocation_index is not None else
                           [r for r, _ in self.candidates[:self.my_candidate]])

    @property
    def errors(self) -> list[str]:
        """The most recent task failures (for the local status)."""
        return self.tasks.errors

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        self.opts.check_exposure()  # no unauthenticated service beyond loopback unless --insecure
        host = host_of(self.opts.listen) or "0.0.0.0"
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
                                     transfer_server=self._transfer_server, throttle=throttle, parity=self.parity,
                                     rebuild=functools.partial(ec_spread.serve, self.fetcher.ec,
                                                               bulk_priority=self.opts.bulk_priority),
                                     max_rebuilds=ec_spread.MAX_SERVED)
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
        self._control_server = serve_control(self, self.sidecar_fetch, self.preemption, self.store.root)
        addrs = [a or (self.address if r == self._me else "") for r, a in self.candidates]
        if self.coordinator is not None:
            if not self.opts.coordinator_candidates and not self.opts.coordinator:
                addrs[self.my_candidate] = self.address
            self.coordinator.address = addrs[self.my_candidate]
            self.coordinator.takeover_wake = self._wakeup.ring  # a client's hint rings this host's heartbeat
            if self.my_candidate == 0:
                self.coordinator.activate(max(time.time_ns(), self.heartbeats.epoch + 1))
        self.heartbeats.connect(addrs, self.address)
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
        """Report to the coordinator now (something changed)."""
        self._wakeup.ring()

    def wake_after(self, delays: Sequence[float]) -> Callable[[], None]:
        """Report to the coordinator ``delays`` seconds from now, each (no thread); returns the cancel."""
        return self._wakeup.ring_after(delays)

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop taking work, let in-flight transfers finish or abandon them (never half-visible)."""
        self.stopping.set()
        self.tasks.shutdown()  # no new task; running ones finish or are abandoned
        self._wakeup.ring()
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
        self.fetcher.close()  # the kept channels to peers
        layout.control_socket(self.store.root).unlink(missing_ok=True)
        # Abandoned fetches leave only temporary directories: remove them now.
        commit.remove_tmp_dirs(layout.steps_dir(self.store.root))
        for owner_dir in (self.store.root / layout.PEER_DIR).glob("*"):
            commit.remove_tmp_dirs(owner_dir)

    def wait_for_signal(self, latch: preemption.ShutdownLatch) -> None:
        """Serve until ``latch`` (installed before :meth:`start`) catches SIGTERM or SIGINT, then stop."""
        latch.wait()
        if latch.sigterm and self.opts.preemption_grace_seconds > 0:
            # A JobSet restart (`mtc preempt --on-restart skip`) or an in-place restart (no preStop hook):
            # the RAM disk outlives this process, which the next one restores from, and from peers.
            skip = preemption.sigterm_skips_flush(self.store.root, self.started_wall,
                                                  noticed=self.preemption.state.preempting,
                                                  sigterm_flush=self.opts.sigterm_flush)
            if skip:
                log.info("%s", skip)
            else:
                self.preemption.flush(self.opts.preemption_grace_seconds)
        self.stop()

    def request_backup_now(self) -> None:
        """The training loop asks for an immediate backup of the newest complete step."""
        self.heartbeats.request_backup_now()

    # ------------------------------------------------------------------ the coordinator (Orbax mode asks it)
    def call_coordinator(self, method: str, request: Any, timeout: float) -> Any:
        """One RPC to the serving coordinator (the first candidate that answers)."""
        return self.heartbeats.call(method, request, timeout)

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
            newest_complete_step=self.heartbeats.newest_complete,
            in_flight=[control_pb2.LocalTask(kind=k, owner_rank=o, step=s) for k, o, s in in_flight],
            counters=self.counters.snapshot(), recent_errors=list(self.errors),
        )
        if self.bucket is not None:
            b = self.bucket.status()
            st.has_backup = True
            st.backup_uploaded_bytes = b.uploaded_bytes
            st.backup_last_error = b.last_error
        if (last := self.metrics.last_restore) is not None:
            st.last_restore.CopyFrom(last.to_wire())
        if (hs := self.metrics.last_handshake) is not None:
            st.last_handshake.CopyFrom(hs.to_wire())
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
