"""`mtc replicator`: the per-host daemon tying the store, peer transfer, coordinator and backup together.

One heartbeat loop reports this host's inventory to the coordinator and carries out what the answer
asks: pull copies from peers, record byte-identical replicas (hash only), delete what GC released,
fetch this rank's data for the step to restore, upload a backup share.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc, peer_pb2_grpc
from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import coordinator_pb2_grpc as cpb_grpc
from replicator import logs
from replicator.coordinator.client import FAILOVER_CODES, Candidates
from replicator.coordinator.planner import inventory_digest
from replicator.coordinator.service import BackupScheduler, Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics, TimedCoordinator
from replicator.net import priority, retry, rpc
from replicator.net.security import AdminGate, TlsOptions, rank_authorizer
from replicator.options import ConfigError, ReplicatorOptions
from replicator.peer import client as peer_client
from replicator.peer import protocol as peer_protocol
from replicator.peer import server as peer_server
from sidecar import faults, layout

log = logging.getLogger(__name__)

def new_incarnation() -> int:
    """A random 63-bit nonce naming this process to the coordinator (not a clock reading: a host whose clock
    was stepped back must not look older than its previous run)."""
    return int.from_bytes(os.urandom(8), "big") >> 1 or 1


class _NoCoordinator(RuntimeError):
    """No coordinator candidate answered this heartbeat."""


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


class _Control(control_pb2_grpc.LocalControlServicer):
    def __init__(self, daemon: Replicator):
        self.daemon = daemon

    def StepCommitted(self, request, context):
        faults.point("notify.received")
        self.daemon.wake()
        return control_pb2.StepCommittedResponse()

    def GetLocalStatus(self, request, context):
        return self.daemon.local_status()

    def LocateStep(self, request, context):
        try:
            savers, generation = self.daemon.locate(request.step)
        except FileNotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except grpc.RpcError as e:
            code = e.code() if e.code() == grpc.StatusCode.INVALID_ARGUMENT else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"coordinator: {_details(e)}")
        return control_pb2.LocalLocateResponse(savers=savers, generation=generation)

    def FetchStep(self, request, context):
        try:
            rel, manifest = self.daemon.fetch_for_sidecar(request.owner_rank, request.step, request.manifest_only,
                                                          request.replace_local, request.timeout_seconds)
        except (ValueError, grpc.RpcError, RuntimeError, OSError) as e:
            _abort_fetch(context, e)
        return control_pb2.FetchStepResponse(step_dir=rel, manifest_json=manifest)

    def FetchFiles(self, request, context):
        try:
            entries = [layout.FileEntry.from_dict({"name": f.name, "size": f.size, "crc32c": f.crc32c})
                       for f in request.files]
            source, nbytes = self.daemon.fetch_files_for_sidecar(request.owner_rank, request.step, entries,
                                                                 request.dest_dir, request.timeout_seconds)
        except (ValueError, grpc.RpcError, RuntimeError, OSError) as e:  # ManifestError: a malformed file list
            _abort_fetch(context, e)
        return control_pb2.FetchFilesResponse(source=source, bytes=nbytes)

    def GetPreemption(self, request, context):
        noticed = self.daemon.preemption_noticed
        return control_pb2.GetPreemptionResponse(noticed=noticed, notice_step=self.daemon.newest_complete
                                                 if noticed else -1)

    def BackupNow(self, request, context):
        self.daemon.request_backup_now()
        return control_pb2.BackupNowResponse()

    def Preempt(self, request, context):
        from replicator import preemption

        return preemption.on_notice(self.daemon, request)


def _abort_fetch(context: grpc.ServicerContext, e: BaseException) -> None:
    """The status of a failed fetch for the sidecar (it decides by the code): NOT_FOUND no tier has it,
    INVALID_ARGUMENT a bad request, UNAVAILABLE anything transient (a peer, the bucket, the coordinator)."""
    if isinstance(e, FileNotFoundError):
        context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    if isinstance(e, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, grpc.RpcError):
        code = e.code() if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) \
            else grpc.StatusCode.UNAVAILABLE
        context.abort(code, f"coordinator: {_details(e)}")
    context.abort(grpc.StatusCode.UNAVAILABLE, _details(e))


def _details(e: BaseException) -> str:
    return e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else str(e)


# Written into the host's local directory when the daemon ends after a preemption notice.
PREEMPTION_RECORD = "preemption.json"


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
        backup: Any = None,
        backup_scheduler_factory: Callable[[JobTopology], BackupScheduler] | None = None,
        store: RamDiskStore | None = None,
    ):
        self.opts = opts
        self.rank, self.nodes, self.job = rank, nodes, job
        self.topology = JobTopology(nodes, data_parallelism, opts.replicas)
        self.store = store if store is not None else RamDiskStore(opts.local_dir, rank)
        self.token = opts.token()
        self.backup = backup
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
        self._fence_nodes = nodes if opts.allocation_index is not None else 0
        self._my_candidate = next((i for i, (r, _) in enumerate(self.candidates) if r == self._me), None)
        # Mutual TLS: reports are bound to the rank the client certificate names (docs/security.md); this
        # also refuses to start with a certificate issued for another rank or job.
        try:
            authorizer = rank_authorizer(self._tls(), job, opts.tls_rank_identity, rank)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if authorizer is not None and self._my_candidate is not None:
            log.info("mutual TLS: a certificate naming mtc://%s/rank/N reports only for rank N; one naming no "
                     "rank is %s", job, "refused" if authorizer.require else
                     "accepted for any rank (this replicator's own names none: one certificate for the whole job)")
        if self._my_candidate is not None:
            factory = (lambda: backup_scheduler_factory(self.topology)) if backup_scheduler_factory else None
            self.coordinator = Coordinator(self.topology, job, keep_local=opts.keep_local,
                                           authorizer=authorizer,
                                           heartbeat_seconds=opts.heartbeat_seconds, backup_factory=factory,
                                           force_restore_step=opts.restore_from_backup,
                                           host_lost_seconds=opts.host_lost_seconds,
                                           max_heartbeats_per_second=opts.max_heartbeats_per_second,
                                           active=False)
        self._cands: Candidates | None = None
        self.epoch = 0  # highest coordinator epoch accepted (fences a deposed coordinator's deletions)
        self._acked: tuple[str, dict[tuple[int, int], Any]] | None = None  # (digest, inventory) the coordinator holds
        self._interval = opts.heartbeat_seconds
        self._lower_down_since: float | None = None
        self._backup_reports: list[cpb.BackupReport] = []
        self._server: grpc.Server | None = None
        self._control_server: grpc.Server | None = None
        self._transfer_server: peer_server.TransferServer | None = None
        self._throttle: peer_protocol.Throttle | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # Copies, restores and uploads run here (and in the threads they start, which inherit it) at the
        # bulk priority, so that they yield the CPU to training.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.transfer_threads),
                                                           thread_name_prefix="mtc-xfer",
                                                           initializer=priority.lower_current_thread,
                                                           initargs=(opts.bulk_priority,))
        self._in_flight: set[tuple[str, int, int]] = set()
        # Failed copies/restores wait (exponential backoff with jitter) before the next attempt: a copy into a
        # full RAM disk used to be retried hundreds of times a second, one heartbeat after the other.
        self._retry = retry.KeyedBackoff(base_seconds=min(1.0, opts.heartbeat_seconds), max_seconds=60.0)
        self._fetching: dict[tuple[int, int], threading.Event] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.address = ""
        self.newest_complete = -1
        # Preemption (SIGTERM): this host got the notice / the coordinator says some host did.
        self.preempting = False
        self.preemption_noticed = False
        self._backup_now = False
        self._backups_seen: list[int] = []
        self.errors: list[str] = []
        # Typed, locked counters and every Prometheus metric of this process (see replicator/metrics.py).
        self.metrics = ReplicatorMetrics(self.store.root)
        self.counters = self.metrics.counters
        self._seen_own: set[int] | None = None
        self._restoring: set[int] = set()  # steps being fetched for a restore: not saves
        if self.coordinator is not None:
            from replicator.coordinator.admin import cluster_view

            coord = self.coordinator
            # Only the serving candidate exports the job-wide view (a standby knows nothing yet).
            self.metrics.cluster_view = lambda: cluster_view(coord) if coord.active else None
        if self.backup is not None and hasattr(self.backup, "on_upload"):
            self.backup.on_upload = self._on_upload

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        self.opts.check_exposure()  # no unauthenticated service beyond loopback unless --insecure
        host = self.opts.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        throttle = peer_protocol.Throttle(bytes_per_second=float(self.opts.max_bytes_per_second) or None,
                                     max_streams=max(1, self.opts.transfer_threads))
        tls = self._tls()
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
        self._throttle = throttle
        # Listening on every interface: other hosts reach us by our host name (a Pod's resolves to its IP).
        adv_host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        self.address = self.opts.advertise or f"{adv_host}:{port}"
        sock = layout.control_socket(self.store.root)
        sock.unlink(missing_ok=True)
        self._control_server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        control_pb2_grpc.add_LocalControlServicer_to_server(_Control(self), self._control_server)
        self._control_server.add_insecure_port(f"unix:{sock}")
        self._control_server.start()
        os.chmod(sock, 0o600)
        addrs = [a or (self.address if r == self._me else "") for r, a in self.candidates]
        if self.coordinator is not None:
            if not self.opts.coordinator_candidates and not self.opts.coordinator:
                addrs[self._my_candidate] = self.address
            self.coordinator.address = addrs[self._my_candidate]
            if self._my_candidate == 0:
                self.coordinator.activate(max(time.time_ns(), self.epoch + 1))
        tls, token, mmb = self._tls(), self.token, self.opts.max_message_bytes
        self._cands = Candidates(addrs, lambda a: rpc.make_channel(a, token=token, tls=tls,
                                                                   max_message_bytes=mmb))
        coord = ",".join(addrs)
        if self.opts.metrics_port is not None:
            mport = self.metrics.serve(host, self.opts.metrics_port)
            print(f"METRICS {adv_host}:{mport}", flush=True)
        self._thread = threading.Thread(target=self._loop, name="mtc-heartbeat", daemon=True)
        self._thread.start()
        log.info("replicator rank %d/%d of job %s listening on %s (coordinator %s)",
                 self.rank, self.nodes, self.job, self.address, coord)
        return port

    def _tls(self) -> TlsOptions | None:
        if not self.opts.tls_cert:
            return None
        return TlsOptions(cert_file=Path(self.opts.tls_cert), key_file=Path(self.opts.tls_key),
                          ca_file=Path(self.opts.tls_ca) if self.opts.tls_ca else None)

    def wake(self) -> None:
        self._wake.set()

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop taking work, let in-flight transfers finish or abandon them (never half-visible)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=grace_seconds + self.opts.rpc_timeout_seconds)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._control_server is not None:
            self._control_server.stop(0)
        if self._server is not None:
            rpc.stop_server(self._server, grace_seconds)
        if self._transfer_server is not None:
            self._transfer_server.stop(grace_seconds)
        self.metrics.stop()
        if self._cands is not None:
            self._cands.close()
        layout.control_socket(self.store.root).unlink(missing_ok=True)
        # Abandoned fetches leave only temporary directories: remove them now.
        layout.remove_tmp_dirs(layout.steps_dir(self.store.root))
        for owner_dir in (self.store.root / layout.PEER_DIR).glob("*"):
            layout.remove_tmp_dirs(owner_dir)

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
        if self.backup is not None:
            self.backup.backup._limiter = None  # emergency: no upload throttle
        step, finished, why = -1, self.backup is None, "no backup tier configured" if self.backup is None else ""
        # The bucket commit is the coordinator's: once no candidate has answered for a while (long enough
        # for a standby to take over), waiting out the rest of the grace cannot help and only delays exit.
        unreachable_limit = max(3.0, 4 * self._interval)
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
                why = f"coordinator unreachable: {_details(e)}"
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
        if finished and self.coordinator is not None:
            # The other hosts learn the outcome from this coordinator: stay a few heartbeats longer.
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
                                               self._failover_window())
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(_details(e)) from None
            raise
        return list(resp.savers), resp.generation

    def fetch_for_sidecar(self, owner: int, step: int, manifest_only: bool, replace_local: bool,
                          timeout_seconds: float) -> tuple[str, bytes]:
        """Bring ``owner``'s data of ``step`` here (or just its manifest) from the fastest other tier.

        Returns (the copy's directory relative to the local root, the manifest JSON when ``manifest_only``).
        A copy of a byte-identical data-parallel replica serves as well. ``replace_local``: the local copy
        is bad — drop it, fetch another.
        """
        layout.step_name(step)
        if not 0 <= owner < self.nodes:
            raise ValueError(f"unknown rank {owner}: the job has ranks 0..{self.nodes - 1}")
        if replace_local:
            if self.store.manifest(owner, step) is not None or self.store.step_dir(owner, step).exists():
                log.warning("the sidecar found a bad copy of rank %d step %d: dropping it", owner, step)
                self.store.delete(owner, step)
                self._wake.set()
        elif (m := self.store.manifest(owner, step)) is not None:
            rel = self.store.step_dir(owner, step).relative_to(self.store.root).as_posix()
            return (("", m.to_json()) if manifest_only else (rel, b""))
        srcs, savers = self._other_sources(owner, step, timeout_seconds)
        errors = []
        for src in srcs:
            if src.kind != "bucket" and src.holder_rank == self.rank:
                continue  # this host's own copy: absent or bad
            where = "bucket" if src.kind == "bucket" else f"rank {src.holder_rank} at {src.holder_address}"
            try:
                if manifest_only:
                    if src.kind == "bucket":
                        if self.backup is None:
                            raise RuntimeError("no backup tier configured")
                        m = self.backup.backup.read_manifest(step, src.owner_rank)
                    else:
                        m = peer_client.get_manifest(src.holder_address, src.owner_rank, step, token=self.token,
                                                     tls=self._tls(), timeout_seconds=self.opts.rpc_timeout_seconds)
                    return "", m.to_json()
                if not self.store.has(src.owner_rank, step, src.content_hash or None):
                    if self.store.has(src.owner_rank, step):
                        self.store.delete(src.owner_rank, step)  # a stale copy of an older save
                    if src.kind == "bucket":
                        self._download(src.owner_rank, step)
                    else:
                        self._fetch(src.holder_address, src.owner_rank, step, src.content_hash or None)
                self._wake.set()
                rel = self.store.step_dir(src.owner_rank, step).relative_to(self.store.root).as_posix()
                log.info("rank %d's data of step %d fetched for the sidecar from %s", owner, step, where)
                return rel, b""
            except Exception as e:  # the next tier
                log.warning("fetching rank %d step %d from %s failed: %s", owner, step, where, e)
                errors.append(f"{where}: {type(e).__name__}: {_details(e)}")
        if not srcs:
            raise FileNotFoundError(f"rank {owner}'s data of step {step} is on no tier the coordinator knows "
                                    f"(savers {savers})")
        raise RuntimeError(f"rank {owner}'s data of step {step} is unreachable: " + "; ".join(errors))

    def _other_sources(self, owner: int, step: int, timeout_seconds: float) -> tuple[list[Any], list[int]]:
        """(the coordinator's sources of ``owner``'s ``step`` data beyond this host's RAM disk, fastest
        first; the step's savers)."""
        # A coordinator that just took over learns the holdings from the next heartbeats: ask again a while.
        deadline = time.monotonic() + min(max(timeout_seconds, 1.0), self._failover_window())
        while True:
            resp = self.call_coordinator_until("LocateStep", cpb.LocateStepRequest(step=step, owners=[owner]),
                                               self._failover_window())
            srcs = [x for x in (resp.ranks[0].sources if resp.ranks else [])
                    if x.kind == "bucket" or x.holder_rank != self.rank]
            if srcs or time.monotonic() >= deadline:
                return srcs, list(resp.savers)
            time.sleep(min(0.5, self.opts.heartbeat_seconds))

    def fetch_files_for_sidecar(self, owner: int, step: int, entries: list[layout.FileEntry], dest_rel: str,
                                timeout_seconds: float) -> tuple[str, int]:
        """Bring only ``entries`` (files of ``owner``'s ``step``, as the caller's copy of its manifest lists
        them) into the caller's scratch directory ``dest_rel``: from a peer's RAM disk through the peer
        service, else the bucket with ranged reads. A source whose manifest does not list every entry
        identically (another save, or a replica that names its files differently) fails and the next is tried;
        each file gets its name only once its crc32c matched, and a source that fails mid-way leaves the rest to
        the next.
        Returns (where from, bytes moved)."""
        layout.step_name(step)
        if not 0 <= owner < self.nodes:
            raise ValueError(f"unknown rank {owner}: the job has ranks 0..{self.nodes - 1}")
        if not entries:
            raise ValueError("no files asked for")
        dest = layout.check_fetch_dir(self.store.root, dest_rel)
        layout.remove_tmp_dirs(dest.parent)  # scratch directories of readers that died (unlocked ones)
        t0 = time.monotonic()
        srcs, savers = self._other_sources(owner, step, timeout_seconds)
        errors, moved = [], 0
        for src in srcs:
            todo = [e for e in entries if not (dest / e.name).exists()]
            if not todo:
                break
            where = "bucket" if src.kind == "bucket" else f"peer rank {src.holder_rank}"
            try:
                if src.kind == "bucket":
                    if self.backup is None:
                        raise RuntimeError("no backup tier configured")
                    moved += self.backup.backup.fetch_files(step, src.owner_rank, todo, dest)
                else:
                    # No manifest round trip: the peer offers the files as its manifest lists them (a mismatch
                    # is refused), and each file must match the asked-for crc32c on arrival.
                    addr = src.holder_address
                    moved += peer_client.fetch_files(addr, src.owner_rank, step, todo, dest, token=self.token,
                                                     tls=self._tls(), throttle=self._throttle,
                                                     timeout_seconds=self.opts.transfer_timeout_seconds)
                self.counters.add("reshard_files", len(todo))
                self.counters.add("reshard_bytes", sum(e.size for e in todo))
                log.info("%d files (%d bytes) of rank %d step %d fetched for the sidecar from %s in %.3fs",
                         len(todo), sum(e.size for e in todo), owner, step, where, time.monotonic() - t0)
                return where, moved
            except Exception as e:  # the next tier
                log.warning("fetching %d files of rank %d step %d from %s failed: %s", len(todo), owner, step,
                            where, e)
                errors.append(f"{where}: {type(e).__name__}: {_details(e)}")
        if not srcs:
            raise FileNotFoundError(f"rank {owner}'s data of step {step} is on no tier the coordinator knows "
                                    f"(savers {savers})")
        raise RuntimeError(f"files of rank {owner}'s step {step} are unreachable: " + "; ".join(errors))

    # ------------------------------------------------------------------ heartbeat loop
    def _loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                delay = self.heartbeat()
                failures = 0
            except (grpc.RpcError, _NoCoordinator) as e:
                failures += 1
                self.counters.add("heartbeat_failures")
                if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Our incarnation was superseded (a report under our rank registered after us, e.g.
                    # a forged one or a brief double start): take a new one and report everything again,
                    # so no other process can lock this host out.
                    self.incarnation = new_incarnation()
                    self._acked = None
                    logs.set_context(job=self.job, rank=self.rank, incarnation=self.incarnation)
                if failures % 10 == 1:
                    log.warning("heartbeat to the coordinator failed: %s",
                                e.details() if isinstance(e, grpc.RpcError) else e)
                # Never sooner than the interval, growing with jitter: no retry storm on a struggling
                # coordinator. A candidate watching for a takeover keeps the plain interval.
                watching = self._my_candidate is not None and isinstance(e, _NoCoordinator)
                delay = self._interval * random.uniform(0.8, 1.2) if watching else \
                    max(self._interval, retry.backoff_seconds(failures, self._interval))
            except Exception:  # keep the daemon alive; the next heartbeat retries
                log.exception("heartbeat handling failed")
                delay = self._interval
            self._wake.wait(delay)
            self._wake.clear()

    def call_coordinator(self, method: str, request: Any, timeout: float) -> Any:
        """One RPC to the serving coordinator (the first candidate that answers)."""
        if self._cands is None:
            raise RuntimeError("the replicator is not started")
        return self._cands.call(method, request, timeout, probe_timeout=self._probe_timeout())

    def call_coordinator_until(self, method: str, request: Any, within_seconds: float) -> Any:
        """:meth:`call_coordinator`, retried (with backoff) across a coordinator failover for ``within_seconds``."""
        if self._cands is None:
            raise RuntimeError("the replicator is not started")
        return self._cands.call_until(method, request, self.opts.rpc_timeout_seconds,
                                      time.monotonic() + within_seconds)

    def _failover_window(self) -> float:
        """How long a restore waits for another coordinator candidate to take over."""
        lost = self.coordinator.lost_after() if self.coordinator is not None else 10 * self.opts.heartbeat_seconds
        return max(3 * self.opts.rpc_timeout_seconds, lost + 4 * self.opts.heartbeat_seconds)

    def _probe_timeout(self) -> float:
        return min(self.opts.rpc_timeout_seconds, max(0.5, self.opts.heartbeat_seconds))

    def _send(self, req: cpb.HeartbeatRequest) -> cpb.HeartbeatResponse:
        """Heartbeat the lowest-ranked candidate that answers; a candidate takes over when all lower ones are down."""
        assert self._cands is not None
        timeout = self.opts.rpc_timeout_seconds
        last: Exception | None = None
        for i in range(len(self._cands.addresses)):
            if i == self._my_candidate and self.coordinator is not None and not self.coordinator.active:
                now = time.monotonic()
                if self._lower_down_since is None:
                    self._lower_down_since = now
                # Half the lost-host time (at least two intervals) of silence from every lower candidate
                # before taking over: a lost heartbeat or a quick restart does not move the coordinator.
                if now - self._lower_down_since < max(2 * self.opts.heartbeat_seconds,
                                                      self.coordinator.lost_after() / 2):
                    raise _NoCoordinator(f"lower coordinator candidates unreachable ({last}); waiting to take over")
                log.warning("no lower coordinator candidate answers: rank %d takes over", self.rank)
                self.coordinator.activate(max(time.time_ns(), self.epoch + 1))
            try:
                resp = self._cands.call_one(i, "Heartbeat", req, timeout, self._probe_timeout())
            except grpc.RpcError as e:
                if e.code() not in FAILOVER_CODES:
                    raise
                last = e.code().name
                continue
            if self._my_candidate is not None and i < self._my_candidate:
                self._lower_down_since = None
                if self.coordinator is not None and self.coordinator.active:
                    self.coordinator.deactivate(f"lower candidate {self._cands.addresses[i]} serves")
            return resp
        raise _NoCoordinator(f"no coordinator candidate answers ({last})")

    def heartbeat(self) -> float:
        inv = self.store.inventory()
        # Copies of ranks this job no longer has (it was re-initialised on fewer hosts, e.g. Orbax after a
        # slice was lost) cannot be addressed: not reported, so the coordinator accepts the rest.
        inv = [h for h in inv if h.owner_rank < self.nodes]
        own = self.store.own_steps()
        digest = inventory_digest(inv)
        self._note_saves(inv)
        req = cpb.HeartbeatRequest(
            job=self.job, rank=self.rank, incarnation=self.incarnation, address=self.address,
            newest_saved_step=own[-1] if own else -1,
            backup_requests=self.store.backup_requests(),
            inventory_digest=digest, known_epoch=self.epoch, preempting=self.preempting, nodes=self._fence_nodes,
        )
        if self._backup_now:
            self._backup_now = False
            if own:
                req.backup_requests.append(own[-1])
        current = {h.key: h for h in inv}
        if self._acked is None:
            req.full_report = True
            changed = inv
        else:
            base, acked = self._acked
            req.base_digest = base
            changed = [h for h in inv if acked.get(h.key) != h]
            req.removed.extend(cpb.Deletion(owner_rank=o, step=s) for o, s in acked if (o, s) not in current)
        for h in changed:
            pbh = req.holdings.add(owner_rank=h.owner_rank, step=h.step, content_hash=h.content_hash,
                                   size=h.size, tier=str(h.tier), generation=h.generation)
            for a, b in h.savers:
                pbh.savers.add(first=a, last=b)
        if self.backup is not None:
            # Kept until a coordinator took them: a failed heartbeat (e.g. during a failover) loses none.
            self._backup_reports = (self._backup_reports + self.backup.drain_reports())[-64:]
            req.backups.extend(self._backup_reports)
        resp = self._send(req)
        faults.point("heartbeat.after_response")
        self._backup_reports = []
        if resp.acked_digest and resp.acked_digest == digest:
            self._acked = (digest, current)
        else:
            self._acked = None
            self._wake.set()  # the coordinator has no picture of this host (restart, failover): report all now
        if resp.epoch < self.epoch:
            log.warning("ignoring the answer of a deposed coordinator (epoch %d < %d)", resp.epoch, self.epoch)
            return self._interval
        self.epoch = resp.epoch
        self._interval = max(0.05, resp.heartbeat_interval_ms / 1000.0 or self.opts.heartbeat_seconds)
        self.newest_complete = resp.newest_complete_step
        self.metrics.newest_complete_step = resp.newest_complete_step
        if resp.preemption_noticed and not self.preemption_noticed:
            log.warning("the coordinator reports a preemption notice")
            self.preemption_noticed = True
        for d in resp.deletions:
            if not self._busy(d.owner_rank, d.step):
                faults.point("gc.before_delete")
                self.store.delete(d.owner_rank, d.step)
                self.counters.add("deletions")
        for c in resp.copies:
            if c.source_rank == self.rank:
                if self.store.attest_replica(c.owner_rank, c.step, c.content_hash):
                    self.counters.add("hash_only")
                    self._wake.set()
                continue
            if not self.store.has(c.owner_rank, c.step, c.content_hash):
                self._submit("copy", c.owner_rank, c.step, self._copy, c)
        if resp.HasField("restore"):
            self._submit("restore", self.rank, resp.restore.step, self._restore, resp.restore)
        if resp.HasField("backup") and self.backup is not None:
            if self.preempting:
                # Emergency backup: its own thread at normal priority, not the idle-priority pool.
                self._submit("backup", -1, resp.backup.step, self.backup.run_task, resp.backup, self.store,
                             urgent=True)
            else:
                self._submit("backup", -1, resp.backup.step, self.backup.run_task, resp.backup, self.store)
        # Jittered so that hosts started together do not report in lockstep.
        return self._interval * random.uniform(0.9, 1.1)

    def _busy(self, owner: int, step: int) -> bool:
        with self._lock:
            return any(k[1] == owner and k[2] == step for k in self._in_flight) or any(
                k[0] == "backup" and k[2] == step for k in self._in_flight)

    def _submit(self, kind: str, owner: int, step: int, fn: Callable[..., Any], *args: Any,
                urgent: bool = False) -> None:
        key = (kind, owner, step)
        if not self._retry.ready(key):
            return
        with self._lock:
            if key in self._in_flight or self._stopping.is_set():
                return
            self._in_flight.add(key)

        def run() -> None:
            ok = False
            try:
                fn(*args)
                ok = True
                self._retry.succeeded(key)
            except Exception as e:
                delay = self._retry.failed(key)
                msg = f"{kind} of rank {owner} step {step} failed: {e}"
                log.warning("%s (attempt %d; next in %.1fs)", msg, self._retry.failures(key), delay)
                self.errors = (self.errors + [msg])[-20:]
                if kind == "copy":
                    self.counters.add("copy_failures")
            finally:
                with self._lock:
                    self._in_flight.discard(key)
                if ok:
                    self._wake.set()  # report the result at once (a failure changed nothing to report)

        if urgent:
            threading.Thread(target=run, name=f"mtc-urgent-{kind}", daemon=True).start()
            return
        try:
            self._pool.submit(run)
        except RuntimeError:  # pool shut down
            with self._lock:
                self._in_flight.discard(key)

    def _fetch(self, address: str, owner: int, step: int, content_hash: str | None) -> layout.StepManifest:
        """Fetch ``owner``'s ``step`` from the peer at ``address`` (single-flight, see :meth:`_once`)."""
        return self._once(owner, step, content_hash, lambda: self._fetch_now(address, owner, step, content_hash))

    def _download(self, owner: int, step: int) -> layout.StepManifest:
        """Fetch ``owner``'s ``step`` from the bucket (single-flight, see :meth:`_once`)."""
        if self.backup is None:
            raise RuntimeError("no backup tier configured")
        parent = self.store.step_dir(owner, step).parent

        def download() -> layout.StepManifest:
            self.backup.download(step, owner, parent)
            m = self.store.manifest(owner, step)
            if m is None:
                raise RuntimeError(f"the download of rank {owner} step {step} left no committed copy")
            return m

        return self._once(owner, step, None, download)

    def _once(self, owner: int, step: int, content_hash: str | None,
              fetch: Callable[[], layout.StepManifest]) -> layout.StepManifest:
        """Bring ``owner``'s ``step`` here once, from whichever tier: a copy task, a restore and a sidecar's
        fetch may want the same directory at the same time; later callers wait for the first instead of
        moving the bytes twice (and colliding on its commit)."""
        key = (owner, step)
        with self._lock:
            running = self._fetching.get(key)
            if running is None:
                self._fetching[key] = threading.Event()
        if running is not None:
            running.wait(self.opts.transfer_timeout_seconds)
            m = self.store.manifest(owner, step)
            if m is None or (content_hash and m.content_hash != content_hash):
                raise RuntimeError(f"concurrent fetch of rank {owner} step {step} did not produce it")
            return m
        try:
            return fetch()
        finally:
            with self._lock:
                self._fetching.pop(key).set()

    def _fetch_now(self, address: str, owner: int, step: int, content_hash: str | None) -> layout.StepManifest:
        dest = self.store.step_dir(owner, step).parent
        t0 = time.monotonic()
        m = peer_client.fetch_step(address, owner, step, dest, token=self.token, tls=self._tls(),
                                timeout_seconds=self.opts.transfer_timeout_seconds,
                                throttle=self._throttle, expected_content_hash=content_hash,
                                spare_dir=layout.spare_dir(self.store.root))
        dt = time.monotonic() - t0
        log.info("copy: fetched rank %d step %d from %s: %d bytes in %.3fs (%.2f GiB/s)",
                 owner, step, address, m.total_bytes, dt, m.total_bytes / max(dt, 1e-9) / 2**30)
        return m

    def _copy(self, task: cpb.CopyTask) -> None:
        if self.store.has(task.owner_rank, task.step):
            return
        faults.point("copy.before_fetch")
        t0 = time.monotonic()
        m = self._fetch(task.source_address, task.owner_rank, task.step, task.content_hash or None)
        self.metrics.observe_transfer("peer_copy", time.monotonic() - t0)
        self.counters.add("copies")
        self.counters.add("copy_bytes", m.total_bytes)

    def _restore(self, task: cpb.RestoreTask) -> None:
        errors = []
        t0 = time.monotonic()
        with self._lock:
            self._restoring.add(task.step)
        for src in task.sources:
            if self.store.holds_data_for(self.rank, task.step, src.content_hash or None):
                return
            try:
                t1 = time.monotonic()
                if src.kind == "bucket":
                    self._download(src.owner_rank, task.step)
                else:
                    if self.store.has(src.owner_rank, task.step):
                        # A stale copy under the same name (e.g. an older save of this step): replace it.
                        self.store.delete(src.owner_rank, task.step)
                    faults.point("restore.peer.before_fetch")
                    self._fetch(src.holder_address, src.owner_rank, task.step, src.content_hash or None)
                now = time.monotonic()
                m = self.store.manifest(src.owner_rank, task.step)
                nbytes = m.total_bytes if m is not None else 0
                self.metrics.observe_transfer("restore_bucket" if src.kind == "bucket" else "restore_peer",
                                              now - t1)
                self.metrics.restore_seconds.observe(now - t0)
                self.counters.add("restores")
                self.counters.add("restore_bytes", nbytes)
                log.info("restore: rank %d now holds its data of step %d from %s rank %d: %d bytes in %.3fs",
                         self.rank, task.step, src.kind, src.holder_rank, nbytes, now - t0)
                return
            except Exception as e:  # try the next source
                errors.append(f"{src.kind} {src.holder_address or ''}: {e}")
        if errors:
            raise RuntimeError("; ".join(errors))

    def _note_saves(self, inv: list[Any]) -> None:
        """Count and log each own step that appeared on the RAM disk since the last heartbeat."""
        own = {h.step: h.size for h in inv if h.owner_rank == self.rank and str(h.tier) == "local"}
        if self._seen_own is None:  # at start: what is already there was saved by an earlier incarnation
            self._seen_own = set(own)
            return
        with self._lock:
            restored = self._restoring & set(own)
            self._restoring -= restored
        for step in sorted(set(own) - self._seen_own - restored):
            self.counters.add("saves")
            self.counters.add("save_bytes", own[step])
            log.info("save: rank %d committed step %d on the RAM disk: %d bytes", self.rank, step, own[step])
        self._seen_own = set(own)

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
        with self._lock:
            in_flight = sorted(self._in_flight)
        st = control_pb2.GetLocalStatusResponse(
            job=self.job, rank=self.rank, nodes=self.nodes, address=self.address or "",
            metrics_address=self.metrics.metrics_address or "",
            own_steps=self.store.own_steps(),
            peer_steps=[control_pb2.LocalPiece(owner_rank=o, step=s) for o, s in self.store.peer_steps()],
            newest_complete_step=self.newest_complete,
            in_flight=[control_pb2.LocalTask(kind=k, owner_rank=o, step=s) for k, o, s in in_flight],
            counters=self.counters.snapshot(), recent_errors=list(self.errors),
        )
        if self.backup is not None:
            b = self.backup.status()
            st.has_backup = True
            st.backup_uploaded_bytes = int(b.get("uploaded_bytes", 0))
            st.backup_last_error = str(b.get("last_error", ""))
        return st


def build_replicator(opts: ReplicatorOptions, store: Any = None) -> Any:
    """A :class:`replicator.daemon.Replicator` for fully resolved options (rank and nodes known).

    ``store``: a :class:`replicator.local.store.RamDiskStore` (subclass) to use instead of the default one.
    """
    backup = None
    scheduler = None
    if opts.backup_url:
        from replicator.backup.tier import make_backup

        backup, scheduler = make_backup(opts, opts.job, opts.rank, opts.nodes)
    return Replicator(opts, rank=opts.rank, nodes=opts.nodes, job=opts.job,
                      data_parallelism=opts.data_parallelism, backup=backup,
                      backup_scheduler_factory=scheduler, store=store)
