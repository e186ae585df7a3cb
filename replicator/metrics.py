"""Prometheus metrics of one replicator (and of the coordinator it may serve), in one place.

Every metric is defined here, with the typed, locked counters the daemon updates from its transfer
threads (:class:`HostCounters`), and the HTTP endpoint (``--metrics-port``). Values that describe the
whole job (newest complete step, redundancy, lost hosts, backup health) are read from the coordinator
at scrape time, so only the coordinator's replicator reports them: alerts need no de-duplication.
Metrics are separate from logs: nothing here logs per event.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from replicator.restore_phases import RestoreRecord

if TYPE_CHECKING:
    from replicator.orbax.handshake_clock import HandshakeRecord

log = logging.getLogger(__name__)

CounterName = Literal[
    "saves",  # own steps committed on this host's RAM disk (seen by the daemon)
    "save_bytes",
    "copies",  # peer copies fetched by this host
    "copy_bytes",
    "copy_failures",
    "restores",  # this rank's data of a restore step fetched from a peer or the bucket
    "restore_bytes",
    "reshard_files",  # files of other ranks' steps fetched for a restore onto another mesh (FetchFiles)
    "reshard_bytes",
    "hash_only",  # data-parallel replicas recorded without moving bytes
    "deletions",  # pieces deleted on the coordinator's GC word
    "heartbeat_failures",
    "backup_uploads",  # ranks uploaded to the bucket by this host
    "backup_upload_bytes",
    "backup_upload_failures",
    "parity_tasks",  # erasure coding: this host's parity of a step computed and committed
    "parity_bytes",
]
COUNTER_NAMES: tuple[str, ...] = get_args(CounterName)

# Seconds: a RAM-disk copy of a few MiB takes milliseconds, a bucket upload of a large rank minutes.
TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
COORDINATOR_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Restore phases: a plan's round trip takes milliseconds, a fetch from the bucket minutes.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TransferKind = Literal["peer_copy", "restore_peer", "restore_bucket", "backup_upload"]


class HostCounters:
    """Typed, locked event counters of one host's replicator (pool threads update them concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, name: CounterName, n: int = 1) -> int:
        """Add ``n`` (>= 0) to counter ``name``; returns the new value. Unknown names raise KeyError."""
        if name not in self._values:
            raise KeyError(f"unknown counter {name!r}; known: {', '.join(COUNTER_NAMES)}")
        if n < 0:
            raise ValueError(f"counters only grow, got {n}")
        with self._lock:
            self._values[name] += int(n)
            return self._values[name]

    def get(self, name: CounterName) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """The job-wide facts the coordinator exports (read under its lock at scrape time)."""

    newest_complete_step: int  # -1: none
    newest_redundant: bool
    hosts: int
    hosts_registered: int
    hosts_lost: int
    pinned_steps: tuple[int, ...] = ()
    backup_configured: bool = False
    backup_last_success_unix: float | None = None
    backup_skipped: int = 0
    backup_failures: int = 0
    backup_interval_seconds: float = 0.0
    backup_in_progress_step: int = -1


class ReplicatorMetrics:
    """The metrics of one replicator process: its own registry (several daemons may share a process)."""

    VIEW_MAX_AGE_SECONDS = 5.0  # two scrapers (an HA Prometheus pair) cost one computation

    def __init__(self, local_dir: Path | str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.counters = HostCounters()
        self.local_dir = Path(local_dir) if local_dir is not None else None
        self.newest_complete_step = -1  # as last heard from the coordinator
        self.cluster_view: Callable[[], ClusterView] | None = None
        self.transfer_seconds = Histogram(
            "mtc_transfer_seconds", "Duration of one step transfer by kind (peer copy, restore, upload)",
            ["kind"], buckets=TRANSFER_BUCKETS, registry=self.registry)
        self.restore_seconds = Histogram(
            "mtc_restore_seconds", "Time for this host to hold its data of a restore step (fetch + verify)",
            buckets=TRANSFER_BUCKETS, registry=self.registry)
        self.restore_phase_seconds = Histogram(
            "mtc_restore_phase_seconds", "Time of one phase of a restore of this host's data: plan (asking the "
            "coordinator where the data is), fetch and verify (crc32c, overlapping fetch) by tier "
            "(docs/operations.md)", ["phase", "tier"], buckets=PHASE_BUCKETS, registry=self.registry)
        self.handshake_phase_seconds = Histogram(
            "mtc_orbax_handshake_phase_seconds", "Orbax mode: time of one phase of a handshake (stop, layout, "
            "start, hosts, plan, marker; docs/orbax.md)", ["phase"], buckets=PHASE_BUCKETS, registry=self.registry)
        self.handshake_seconds = Histogram(
            "mtc_orbax_handshake_seconds", "Orbax mode: from replicator.yaml seen to its acknowledgement",
            buckets=PHASE_BUCKETS, registry=self.registry)
        self._last_restore: RestoreRecord | None = None
        self._last_restore_lock = threading.Lock()
        self._last_handshake: HandshakeRecord | None = None  # one reference, replaced whole
        self.heartbeat_handling_seconds = Histogram(
            "mtc_coordinator_heartbeat_seconds", "Coordinator: time to handle one host heartbeat",
            buckets=COORDINATOR_BUCKETS, registry=self.registry)
        self.plan_seconds = Histogram(
            "mtc_coordinator_plan_seconds", "Coordinator: time to plan and prepare a restore (PrepareRestore; LocateStep for "
            "restores that fetch other ranks' data)",
            buckets=TRANSFER_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(self))
        self._httpd: Any = None
        self.metrics_address = ""
        self._view_lock = threading.Lock()
        self._view: ClusterView | None = None
        self._view_at = 0.0

    def current_view(self) -> ClusterView | None:
        """The coordinator's view, recomputed at most every ``VIEW_MAX_AGE_SECONDS`` (it walks every rank
        under the coordinator's lock: 240 ms at 10,000 hosts, see bench/admin.py), None off the coordinator."""
        if self.cluster_view is None:
            return None
        with self._view_lock:
            now = time.monotonic()
            if self._view is None or now - self._view_at >= self.VIEW_MAX_AGE_SECONDS:
                try:
                    self._view, self._view_at = self.cluster_view(), now
                except Exception:  # a scrape must never fail the daemon
                    log.exception("cannot read the coordinator's view for metrics")
            return self._view

    # ------------------------------------------------------------------ events
    def observe_transfer(self, kind: TransferKind, seconds: float) -> None:
        self.transfer_seconds.labels(kind=kind).observe(max(0.0, seconds))

    def observe_restore(self, record: RestoreRecord) -> None:
        """A finished restore: each of its phases observed, and it is the host's last restore (unless it only
        repeats the last one: :meth:`RestoreRecord.repeats`)."""
        for phase, tier, seconds in record.phases:
            self.restore_phase_seconds.labels(phase=phase, tier=tier).observe(seconds)
        with self._last_restore_lock:
            if not record.repeats(self._last_restore):
                self._last_restore = record

    @property
    def last_restore(self) -> RestoreRecord | None:
        """This host's last finished restore (None: none since the process started)."""
        with self._last_restore_lock:
            return self._last_restore

    def observe_handshake(self, record: HandshakeRecord) -> None:
        """A finished Orbax-mode handshake: its phases and its whole observed; it is the host's last one."""
        for phase, secs in record.phases:
            self.handshake_phase_seconds.labels(phase=phase).observe(secs)
        self.handshake_seconds.observe(record.seconds)
        self._last_handshake = record

    @property
    def last_handshake(self) -> HandshakeRecord | None:
        """This daemon's last finished Orbax-mode handshake (None: none, or not Orbax mode)."""
        return self._last_handshake

    # ------------------------------------------------------------------ HTTP endpoint
    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0 picks a free one); returns the port."""
        self._httpd, _ = start_http_server(port, addr=host or "0.0.0.0", registry=self.registry)
        bound = int(self._httpd.server_port)
        shown = host if host not in ("", "0.0.0.0", "::") else "0.0.0.0"
        self.metrics_address = f"{shown}:{bound}"
        log.info("metrics on http://%s/metrics", self.metrics_address)
        return bound

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


class TimedCoordinator:
    """Wraps the Coordinator servicer to time its handlers; every other attribute is the servicer's."""

    def __init__(self, inner: Any, metrics: ReplicatorMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def Heartbeat(self, request: Any, context: Any) -> Any:
        t0 = time.monotonic()
        try:
            return self._inner.Heartbeat(request, context)
        finally:
            self._metrics.heartbeat_handling_seconds.observe(time.monotonic() - t0)

    def PrepareRestore(self, request: Any, context: Any) -> Any:
        t0 = time.monotonic()
        try:
            return self._inner.PrepareRestore(request, context)
        finally:
            self._metrics.plan_seconds.observe(time.monotonic() - t0)

    def LocateStep(self, request: Any, context: Any) -> Any:
        t0 = time.monotonic()
        try:
            return self._inner.LocateStep(request, context)
        finally:
            self._metrics.plan_seconds.observe(time.monotonic() - t0)


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    m = CounterMetricFamily(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _Collector:
    """Reads the counters, the RAM disk and (on the coordinator) the cluster view at scrape time."""

    def __init__(self, m: ReplicatorMetrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []  # unchecked: the set of metrics depends on the role (coordinator or not)

    def collect(self) -> Iterator[Metric]:
        c = self.m.counters.snapshot()
        copy_bytes = CounterMetricFamily("mtc_copy_bytes", "Bytes this host moved, by kind", labels=["kind"])
        copy_bytes.add_metric(["peer_copy"], c["copy_bytes"])
        copy_bytes.add_metric(["restore"], c["restore_bytes"])
        copy_bytes.add_metric(["reshard"], c["reshard_bytes"])
        copy_bytes.add_metric(["backup_upload"], c["backup_upload_bytes"])
        yield copy_bytes
        yield _counter("mtc_saves", "Own steps committed on this host's RAM disk", c["saves"])
        yield _counter("mtc_save_bytes", "Bytes of own steps committed on this host's RAM disk", c["save_bytes"])
        yield _counter("mtc_copies", "Peer copies fetched by this host", c["copies"])
        yield _counter("mtc_copy_failures", "Failed peer copies", c["copy_failures"])
        yield _counter("mtc_restores", "Restore fetches (peer or bucket) of this host's rank", c["restores"])
        yield _counter("mtc_reshard_files", "Files of other ranks' steps fetched for restores onto another mesh",
                       c["reshard_files"])
        yield _counter("mtc_hash_only_replicas", "Data-parallel replicas recorded by hash", c["hash_only"])
        yield _counter("mtc_deletions", "Pieces deleted on the coordinator's GC word", c["deletions"])
        yield _counter("mtc_heartbeat_failures", "Heartbeats to the coordinator that failed",
                       c["heartbeat_failures"])
        yield _counter("mtc_backup_uploads", "Ranks this host uploaded to the bucket", c["backup_uploads"])
        yield _counter("mtc_backup_upload_failures", "Failed uploads by this host", c["backup_upload_failures"])
        yield _counter("mtc_parity_computed", "Erasure coding: steps whose parity this host computed",
                       c["parity_tasks"])
        yield _counter("mtc_parity_bytes", "Erasure coding: parity bytes this host computed", c["parity_bytes"])
        if self.m.local_dir is not None:
            try:
                du = shutil.disk_usage(self.m.local_dir)
            except OSError:
                du = None
            if du is not None:
                g = GaugeMetricFamily("mtc_ramdisk_bytes", "RAM-disk bytes by state", labels=["state"])
                g.add_metric(["used"], du.used)
                g.add_metric(["free"], du.free)
                g.add_metric(["total"], du.total)
                yield g
        view = self.m.current_view()
        newest = view.newest_complete_step if view is not None else self.m.newest_complete_step
        yield _gauge("mtc_newest_complete_step", "Newest globally complete step (-1: none)", newest)
        if view is None:
            return
        yield _gauge("mtc_step_redundant",
                     "1 when the newest complete step survives the loss of any one host (ec: has all its parity)",
                     1.0 if view.newest_redundant else 0.0)
        yield _gauge("mtc_hosts", "Hosts (ranks) in the job", view.hosts)
        yield _gauge("mtc_hosts_registered", "Hosts whose replicator has reported", view.hosts_registered)
        yield _gauge("mtc_hosts_lost", "Hosts silent for longer than the loss threshold (or never seen)",
                     view.hosts_lost)
        yield _gauge("mtc_pinned_steps", "Steps pinned against GC (restores, operator pins)",
                     len(view.pinned_steps))
        if not view.backup_configured:
            return
        if view.backup_last_success_unix is not None:
            yield _gauge("mtc_backup_last_success_timestamp_seconds", "Unix time of the newest committed backup",
                         view.backup_last_success_unix)
        yield _counter("mtc_backup_skipped", "Backups due while the previous one still ran", view.backup_skipped)
        yield _counter("mtc_backup_failures", "Failed backup uploads, commits or starts", view.backup_failures)
        yield _gauge("mtc_backup_interval_seconds", "Configured backup interval in seconds (0: step-based)",
                     view.backup_interval_seconds)
        yield _gauge("mtc_backup_in_progress_step", "Step being backed up (-1: none)", view.backup_in_progress_step)
