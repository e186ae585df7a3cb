"""`mtc replicator` in Orbax mode: answers unchanged Orbax's multi-tier checkpointing handshake.

The daemon watches ``<local>/replicator.yaml``. For every one it sees (a new one later = the job restarted)
it runs one handshake, without a process restart:

1. stop the previous :class:`~replicator.daemon.Replicator` (if any), ingest every committed ``<local>/<N>``
   Orbax left behind into the store (:class:`~replicator.orbax.store.OrbaxStore`);
2. start a new Replicator (new incarnation, same listen address) with job, rank, nodes, slices and the
   backup interval taken from the yaml; peer and coordinator addresses come from our own flags;
3. ask the coordinator which step every host restores (``PrepareRestore``: it pins one step for all hosts
   and waits until each holds its data locally, fetching from peers or the bucket);
4. clean ``<local>`` (stale markers, interrupted saves, links of earlier restores, steps at or above the
   restore step), write exactly one marker -- the directory ``<job>-s<N>-n<rank>-w0.restore`` of hard links
   to the files of this rank's data of N (Orbax deleting the restored step later removes only the links),
   or the empty step-0 file when nothing is restorable -- and only
   then acknowledge by deleting ``replicator.yaml`` (Orbax looks for markers only after the ack, so the
   planning is bounded by its ``jax_initialization_timeout_seconds``, not by its fixed 300 s marker wait).

Non-fatal problems go to ``replicator.errors`` (Orbax logs them); fatal ones to ``replicator.failed``
(Orbax raises ``RuntimeError``). Between handshakes the Replicator's heartbeat ingests each step Orbax
commits, so it is replicated, backed up and collected like a native step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import coordinator_pb2 as cpb
from replicator.coordinator.client import retry_after_seconds
from replicator.coordinator.topology import JobTopology
from replicator.net.address import join_host_port, split_host_port
from replicator.net.retry import JITTER
from replicator.options import ConfigError, ReplicatorOptions
from replicator.orbax import allocation, elastic
from replicator.orbax import contract as oc
from replicator.orbax.handshake_clock import HandshakeClock
from replicator.orbax.store import OrbaxStore
from replicator.preemption import PreemptionRecord, ShutdownLatch, sigterm_skips_flush
from sidecar import faults, layout

log = logging.getLogger(__name__)

# How often replicator.yaml (and jax-init-info.txt) is looked for: two stats every 10 ms cost nothing, and the
# handshake starts at most 10 ms after Orbax wrote the file (0.1 s before: up to 0.1 s of every handshake as
# Orbax sees it, and the hosts' handshakes spread over that much).
POLL_SECONDS = 0.01
# While not every host has reported: each host asks the coordinator (GetStatus) every 20 ms, less often in
# larger jobs (at most ~HOSTS_POLLS_PER_SECOND calls a second on the coordinator), never less than every 0.1 s.
HOSTS_POLLS_PER_SECOND = 1000
# The coordinator trusts a plan only on reports made after the request (PrepareRestore), every host's after
# every host's request: this host reports 1, 2 and 3 hosts-polls after asking (every host asks within a
# hosts-poll or so of the others, having seen the last host report), then at each of these offsets, also after
# its own answer came, instead of at its next heartbeat (up to --heartbeat-seconds later: 2 s by default). With
# (0.02, 0.1, 0.3) s, cancelled at the answer, the last host to ask waited for the others' next heartbeats.
PLAN_REPORT_POLLS = 3
PLAN_REPORT_OFFSETS = (0.1, 0.3)
# Then, while the call is open, this host reports every nodes / HOSTS_POLLS_PER_SECOND seconds (20 ms at least):
# a host waiting for the byte-identical replica its group fetches from the bucket (every local directory wiped) is
# given its copy from that host in its next heartbeat's answer, which came up to --heartbeat-seconds (2 s by
# default) after the bytes landed.
# In-flight RPCs of the daemon a new handshake replaces get this long to end (see handshake()).
HANDSHAKE_STOP_GRACE_SECONDS = 0.25
# PrepareRestore is asked in slices of this length, so that SIGTERM or a newer handshake is noticed.
PREPARE_SLICE_SECONDS = 5.0
# The step the guide says the replicator service reserves for "no checkpoint" (never restored in Orbax mode).
RESERVED_STEP = 0


class HandshakeError(RuntimeError):
    """This host cannot give Orbax a consistent restore: reported to Orbax as fatal."""


def _resolve_listen(listen: str) -> str:
    """``HOST:0`` -> ``HOST:<free port>``: every incarnation of the Replicator serves on the same address."""
    host, port = split_host_port(listen)
    if port:
        return listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return join_host_port(host, s.getsockname()[1])


def replicator_options(opts: ReplicatorOptions, cfg: oc.ReplicatorConfig, listen: str) -> ReplicatorOptions:
    """The native daemon's options for one Orbax incarnation (ConfigError when they do not fit)."""
    slices = len(cfg.peer_ranks) + 1
    if cfg.nodes % slices or sorted(JobTopology(cfg.nodes, slices).replicas_of(cfg.node_rank)) != sorted(
        cfg.peer_ranks
    ):
        # Not the slice-major layout our topology assumes: treat every host as its own failure domain
        # (ring copies still give each step an in-cluster copy; identical replicas are not exploited).
        log.warning("peer-ranks %s of rank %d/%d are not slice-major; replicas are not paired by slice",
                    list(cfg.peer_ranks), cfg.node_rank, cfg.nodes)
        slices = 1
    if cfg.assume_data_parallelism != slices:
        log.info("assume-data-parallelism %d, %d slice(s) from peer-ranks: replicas are paired by slice",
                 cfg.assume_data_parallelism, slices)
    resolved = dataclasses.replace(
        opts,
        job=cfg.job_name,
        rank=cfg.node_rank,
        nodes=cfg.nodes,
        data_parallelism=slices,
        listen=listen,
        backup_interval_minutes=float(cfg.backup_interval_minutes or 0),
        backup_interval_steps=int(cfg.backup_interval_steps or 0),
    )
    # Our address flags describe the allocation (stable), Orbax's ranks the current incarnation: a host
    # Orbax renumbered (an elastic event) keeps its address and its place among the coordinator candidates.
    hosts_per_slice = cfg.nodes // slices
    me = allocation.find_self(resolved, listen, hosts_per_slice)
    if me is None:
        me = cfg.node_rank  # the flags do not say which host this is: assume Orbax's ranks never change
    resolved = dataclasses.replace(resolved, allocation_index=me)
    if me != cfg.node_rank:
        log.info("allocation host %d is rank %d of %d in this incarnation", me, cfg.node_rank, cfg.nodes)
    if not opts.advertise:
        own = resolved.peer_address(me)
        if own:
            resolved = dataclasses.replace(resolved, advertise=own)
    if not opts.coordinator_candidates and not opts.coordinator:
        cands = allocation.candidates(resolved, me, slices, hosts_per_slice)
        if cands:
            resolved = dataclasses.replace(resolved, coordinator_candidates=cands)
    return resolved.validate()


class OrbaxMode:
    """One host's Orbax-mode daemon: a poll loop over ``<local>`` and one handshake per ``replicator.yaml``."""

    def __init__(self, opts: ReplicatorOptions, build: Any = None):
        self.opts = opts
        self.local = Path(opts.local_dir)
        self.listen = _resolve_listen(opts.listen)
        self.stopping = threading.Event()
        self.daemon: Any = None
        self.store: OrbaxStore | None = None
        self.handshakes = 0
        self._announced = False
        self._jax_info_written = False
        if build is None:
            from replicator.daemon import build_replicator

            build = build_replicator
        self._build = build

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Answer handshakes until :attr:`stopping` is set."""
        while not self.stopping.is_set():
            try:
                self.local.mkdir(parents=True, exist_ok=True)
                self._ensure_jax_init_info()
                try:
                    cfg = oc.read_config(self.local)
                except ValueError as e:
                    self._fatal(f"unusable {oc.REPLICATOR_FILE}: {e}", None)
                    cfg = None
                if cfg is not None:
                    self.handshake(cfg)
            except Exception:  # keep serving: the next yaml gets a fresh handshake
                log.exception("Orbax-mode loop failed")
            self.stopping.wait(POLL_SECONDS)

    def stop(self) -> None:
        self.stopping.set()
        self._stop_daemon()

    def _ensure_jax_init_info(self) -> None:
        """Written at start (a file of an earlier daemon may name another process id: the host's place in
        the job changed) and again whenever it is missing."""
        if not self.opts.jax_coordinator:
            return
        if not self._jax_info_written or not (self.local / oc.JAX_INIT_INFO_FILE).exists():
            oc.write_jax_init_info(self.local, self.opts.jax_process_id, self.opts.jax_coordinator)
            self._jax_info_written = True

    def _stop_daemon(self, grace_seconds: float = 2.0) -> None:
        d, self.daemon = self.daemon, None
        if d is not None:
            d.stop(grace_seconds=grace_seconds)

    # ------------------------------------------------------------------ reports to Orbax
    def _error(self, text: str) -> None:
        try:
            oc.report_error(self.local, f"mtc replicator: {text}")
        except OSError as e:
            log.warning("cannot report to Orbax (%s): %s", e, text)

    def _fatal(self, text: str, cfg: oc.ReplicatorConfig | None) -> None:
        """``replicator.failed`` first, then the ack: Orbax checks for failures once the yaml is gone."""
        oc.report_fatal(self.local, f"mtc replicator: {text}")
        try:
            oc.acknowledge(self.local, cfg, missing_ok=True)
        except ValueError:
            pass  # a newer handshake arrived meanwhile: the loop answers it next

    # ------------------------------------------------------------------ handshake
    def handshake(self, cfg: oc.ReplicatorConfig) -> None:
        self.handshakes += 1
        clock = HandshakeClock(self.handshakes)
        log.info("handshake %d: job %s rank %d/%d, peers %s", self.handshakes, cfg.job_name, cfg.node_rank,
                 cfg.nodes, list(cfg.peer_ranks))
        # The job restarted: what the previous incarnation's daemon still serves (a long poll, a copy to a
        # host that restarts too) is abandoned, never half-visible; waiting 2 s for it delayed every restore.
        self._stop_daemon(HANDSHAKE_STOP_GRACE_SECONDS)
        clock.mark("stop")
        try:
            opts = replicator_options(self.opts, cfg, self.listen)
        except (ConfigError, ValueError) as e:
            self._fatal(f"rank {cfg.node_rank}: {e}", cfg)
            return
        daemon = None
        try:
            remapped = self._adopt_layout(cfg, opts)
            store = OrbaxStore(self.local, cfg.node_rank, job=cfg.job_name, nodes=cfg.nodes, on_error=self._error)
            store.ingest()
            if remapped.changed:
                store.forget_replicas(remapped.steps)
            for owner, step, content_hash in remapped.attest:
                store.attest_replica(owner, step, content_hash)
            elastic.write_layout(self.local, elastic.Layout(cfg.job_name, cfg.node_rank, cfg.nodes,
                                                            opts.data_parallelism))
            faults.point("orbax.after_ingest")
            clock.mark("layout")
            daemon = self._build(opts, store=store)
            daemon.start()
            clock.mark("start")
        except Exception as e:  # a bind failure, an unusable bucket, ...
            log.exception("cannot start the replicator")
            if daemon is not None:
                daemon.stop(grace_seconds=0.0)  # whatever started before the failure
            self._fatal(f"rank {cfg.node_rank}: cannot start: {type(e).__name__}: {e}", cfg)
            return
        self.daemon, self.store = daemon, store
        if not self._announced:
            self._announced = True
            print(f"LISTENING {daemon.address}", flush=True)
        try:
            step, target = self._plan(daemon, store, cfg, opts, clock)
            clock.mark("plan")
            if self.stopping.is_set():
                return
            faults.point("orbax.before_marker")
            self._clean_links()
            oc.prepare_for_restore(self.local, step)
            if step is None:
                oc.write_no_restore_marker(self.local, cfg.job_name, cfg.node_rank)
            else:
                oc.write_restore_marker(self.local, cfg.job_name, step, cfg.node_rank, target)
                faults.point("orbax.after_marker")
        except HandshakeError as e:
            self._fatal(f"rank {cfg.node_rank}: {e}", cfg)
            return
        except Exception as e:  # never leave Orbax waiting without an answer
            log.exception("handshake failed")
            self._fatal(f"rank {cfg.node_rank}: handshake failed: {type(e).__name__}: {e}", cfg)
            return
        try:
            oc.acknowledge(self.local, cfg, missing_ok=True)
            faults.point("orbax.after_ack")
        except ValueError as e:
            log.warning("not acknowledged: %s", e)  # a newer yaml: answered by the next handshake
            return
        clock.mark("marker")
        clock.done("nothing to restore" if step is None else f"restore step {step} from {target}",
                   getattr(daemon, "metrics", None))

    def _adopt_layout(self, cfg: oc.ReplicatorConfig, opts: ReplicatorOptions) -> elastic.RemapReport:
        """A changed node count or rank (an elastic event): re-label what this host holds (see elastic.py).

        Steps Orbax committed under the previous layout are ingested under it first, so that their
        manifests say whose data they are.
        """
        new = elastic.Layout(cfg.job_name, cfg.node_rank, cfg.nodes, opts.data_parallelism)
        prev = elastic.read_layout(self.local)
        if prev is not None and (prev.rank, prev.nodes) != (new.rank, new.nodes):
            OrbaxStore(self.local, prev.rank, job=prev.job, nodes=prev.nodes, on_error=self._error).ingest()
        if opts.backup_url and elastic.holds_nothing(self.local):
            self._fetch_other_layout_backup(opts, new)
        report = elastic.remap(self.local, new, prev)
        if report.unmapped:
            self._error(f"rank {cfg.node_rank}: steps {sorted(report.steps)} of the previous layout cannot be "
                        f"restored ({report.unmapped}); moved to {self.local / elastic.UNMAPPED_DIR}")
        elif report.changed:
            log.info("elastic: rank %d/%d (was %s): %d piece(s) re-labelled, %d dropped, %d new rank(s) attested",
                     new.rank, new.nodes, f"{prev.rank}/{prev.nodes}" if prev else "unrecorded",
                     len(report.relabelled), len(report.dropped), len(report.attest))
        return report

    def _fetch_other_layout_backup(self, opts: ReplicatorOptions, new: elastic.Layout) -> None:
        """An empty host, and the newest backup was saved by another node count (which the coordinator
        cannot plan with): download this host's position's data of it; :func:`elastic.remap` re-labels it."""
        from replicator.backup.bucket import BackupStore
        from replicator.backup.storage import open_store

        backup = BackupStore(open_store(opts.backup_url), new.job)
        steps = backup.committed_steps()
        if not steps:
            return
        rec, _ = backup.commit_record(steps[-1])
        if rec.nodes == new.nodes:
            return  # the coordinator plans it like any backup
        try:
            source = elastic.bucket_source_rank(rec.nodes, rec.rank_hashes, new)
        except ValueError as e:
            self._error(f"rank {new.rank}: cannot use backup step {rec.step}: {e}")
            return
        staging = self.local / elastic.STAGING_DIR
        staging.mkdir(exist_ok=True)
        try:
            backup.download_rank(rec.step, source, staging)
        except Exception as e:
            raise RuntimeError(f"cannot download rank {source} of backup step {rec.step} ({rec.nodes} nodes) "
                               f"from {opts.backup_url}: {type(e).__name__}: {e}") from e
        log.info("elastic: downloaded rank %d of backup step %d (%d nodes) for rank %d/%d", source, rec.step,
                 rec.nodes, new.rank, new.nodes)

    def _clean_links(self) -> None:
        """Remove every ``<local>/<N>`` an earlier restore left (links into the store: the data stays there)."""
        for child in self.local.iterdir():
            if layout.parse_step_name(child.name) is None or not oc.is_restored_copy(child):
                continue
            if child.is_symlink():
                child.unlink()
            else:
                shutil.rmtree(child)  # hard links: our copy keeps its own

    def _plan(self, daemon: Any, store: OrbaxStore, cfg: oc.ReplicatorConfig, opts: ReplicatorOptions,
              clock: HandshakeClock | None = None) -> tuple[int | None, Path | None]:
        """(step, directory with this rank's data) to restore, or (None, None) when nothing is restorable.
        Marks ``clock``'s ``hosts`` phase when every host has reported."""
        deadline = time.monotonic() + opts.handshake_timeout_seconds
        resp = None
        registered = False
        last_error = "no answer"
        answered = False  # the coordinator answered this host's GetStatus since its last failure
        poll = min(0.1, max(0.02, cfg.nodes / HOSTS_POLLS_PER_SECOND))
        cancel_reports: Callable[[], None] = _nothing
        while not self.stopping.is_set() and time.monotonic() < deadline:
            # A plan made before every host reported may miss data ("nothing to restore", or an older step
            # from the bucket while a newer one sits on the RAM disks of hosts not yet heard): ask only once
            # every host has reported, so the plan is made on all of them.
            waiting = self._not_registered(daemon, opts, cfg)
            registered = not waiting
            if waiting.startswith(_NO_STATUS):
                answered = False
            elif not answered:
                # The coordinator answers now (it may have started after this host): report at once, not
                # after the heartbeat's back-off from its failed first reports (an interval or more).
                answered = True
                daemon.wake()
            if waiting:
                last_error = waiting
                self.stopping.wait(poll)
                continue
            if clock is not None and "hosts" not in clock.phases:
                clock.mark("hosts")
            wait = max(0.0, min(PREPARE_SLICE_SECONDS, deadline - time.monotonic() - 0.5))
            try:
                req = cpb.PrepareRestoreRequest(step=-1, wait_seconds=wait, nodes=cfg.nodes)
                cancel_reports()
                resp, cancel_reports = _ask_for_plan(daemon, req, wait + opts.rpc_timeout_seconds, poll)
            except grpc.RpcError as e:
                last_error = f"coordinator {opts.coordinator_address()}: {e.code().name} {e.details()}"
                resp = None
                # A busy coordinator says when to come back; follow it, jittered (no retry storm).
                advice = retry_after_seconds(e)
                self.stopping.wait(advice * JITTER.uniform(1.0, 1.5) if advice is not None else 0.2)
                continue
            if resp.step < 0 or (resp.ready and cfg.node_rank in resp.ready_ranks):
                break
            last_error = resp.reason
            self.stopping.wait(poll)
        if self.stopping.is_set():
            return None, None
        if resp is None or not registered:
            raise HandshakeError(f"no restore plan within {opts.handshake_timeout_seconds}s: {last_error}")
        if resp.step == RESERVED_STEP:
            # The guide: "Step 0 is reserved by the replicator service to indicate 'no checkpoint'" (and
            # Orbax's colocated manager never restores it): a job whose only complete step is 0 starts over.
            log.info("the newest complete step is step 0, which is reserved for 'no checkpoint': nothing to "
                     "restore")
            return None, None
        if resp.step < 0:
            log.info("nothing to restore: %s", resp.reason)
            held = sorted((set(store.own_steps()) | {s for _, s in store.peer_steps()}) - {RESERVED_STEP})
            if held:
                # Orbax starts from scratch: say so, and what is missing (e.g. after an elastic event no
                # survivor held some in-slice position's data), instead of a silent "nothing".
                self._error(f"rank {cfg.node_rank}: nothing to restore although this host holds steps "
                            f"{held}: {resp.reason}")
            return None, None
        if not resp.ready:
            if cfg.node_rank not in resp.ready_ranks:
                raise HandshakeError(f"step {resp.step}: {resp.reason}")
            self._error(f"restoring step {resp.step}, but {resp.reason}")
        owners = self._valid_owners(daemon, opts, resp.step, cfg)
        target = store.data_dir_for(resp.step, owners)
        if target is None:
            raise HandshakeError(f"the coordinator planned step {resp.step}, but this host holds no data of "
                                 f"rank {cfg.node_rank} for it")
        return resp.step, target

    def _status(self, daemon: Any, opts: ReplicatorOptions, **request: Any) -> cpb.GetStatusResponse:
        return daemon.call_coordinator("GetStatus", cpb.GetStatusRequest(**request), opts.rpc_timeout_seconds)

    def _not_registered(self, daemon: Any, opts: ReplicatorOptions, cfg: oc.ReplicatorConfig) -> str:
        """Why the coordinator's plan cannot be trusted yet ("" once every host has reported to it).

        Orbax restores every process together, so a lost host is waited for (its replacement), not skipped.
        A coordinator of another node count is a previous incarnation's (its host has not seen its new
        yaml yet, or serves an older job): its plan would be over the wrong ranks.
        """
        try:
            st = self._status(daemon, opts, nodes=cfg.nodes)
        except grpc.RpcError as e:
            return f"{_NO_STATUS}: {e.code().name} {e.details()}"
        if st.HasField("topology") and st.topology.nodes != cfg.nodes:
            return (f"the coordinator at {st.coordinator_address or '?'} serves {st.topology.nodes} hosts, "
                    f"replicator.yaml says {cfg.nodes} (a previous incarnation)")
        if st.hosts_reported < cfg.nodes:
            return f"not every host has reported to the coordinator ({st.hosts_reported} of {cfg.nodes})"
        return ""

    def _valid_owners(self, daemon: Any, opts: ReplicatorOptions, step: int, cfg: oc.ReplicatorConfig) -> set[int]:
        """Owners whose data of ``step`` on this host the coordinator accepts for its rank (hash-checked)."""
        rank = cfg.node_rank
        try:
            st = self._status(daemon, opts, detail_steps=[step], rank_first=rank, rank_count=1, nodes=cfg.nodes)
        except grpc.RpcError as e:
            log.warning("no status from the coordinator (%s): restoring own data only", e.code().name)
            return {rank}
        owners = {s.owner_rank for d in st.step_details if d.step == step for r in d.ranks if r.rank == rank
                  for s in r.sources if s.holder_rank == rank}
        return owners or {rank}


_NO_STATUS = "no status from the coordinator"


def _nothing() -> None:
    pass


def _ask_for_plan(daemon: Any, req: cpb.PrepareRestoreRequest, timeout: float,
                  poll: float) -> tuple[cpb.PrepareRestoreResponse, Callable[[], None]]:
    """PrepareRestore, this host reporting meanwhile (:data:`PLAN_REPORT_POLLS`); returns the answer and what
    cancels the first reports, which are kept after the answer: a host that asked after this one needs this
    host's reports made after its own request too (call it before asking again: one schedule at a time)."""
    cancel = daemon.wake_after(plan_report_offsets(poll))
    cancel_paced = daemon.wake_after(paced_report_offsets(req.nodes, req.wait_seconds))
    try:
        return daemon.call_coordinator("PrepareRestore", req, timeout), cancel
    except BaseException:
        cancel()
        raise
    finally:
        cancel_paced()


def paced_report_offsets(nodes: int, seconds: float) -> tuple[float, ...]:
    """This host's reports after :func:`plan_report_offsets` while its PrepareRestore call is open (seconds)."""
    pace = max(0.02, nodes / HOSTS_POLLS_PER_SECOND)
    first = PLAN_REPORT_OFFSETS[-1] + pace
    return tuple(round(first + i * pace, 3) for i in range(max(0, int((seconds - first) / pace) + 1)))


def plan_report_offsets(poll: float) -> tuple[float, ...]:
    """When this host reports after asking for the plan (seconds; see :data:`PLAN_REPORT_POLLS`)."""
    early = [round(poll * (i + 1), 3) for i in range(PLAN_REPORT_POLLS)]
    return tuple(sorted(set(early) | {o for o in PLAN_REPORT_OFFSETS if o > early[-1]}))


def flush_on_sigterm(mode: OrbaxMode, grace_seconds: float, started_wall: float) -> PreemptionRecord | None:
    """SIGTERM (a preemption notice) in Orbax mode: the current incarnation's Replicator flushes the newest
    complete step to the bucket like a native one (``<local>/preemption.json``), before the daemon stops.

    Orbax commits its last step (its own preemption save) before the trainer exits, and Kubernetes sends the
    native-sidecar replicator SIGTERM only after that: the step is on the RAM disk, and the heartbeat,
    woken by the flush, ingests and reports it first. No Replicator yet (no handshake) = nothing to flush.
    A restart recorded since ``started_wall`` (``mtc preempt --on-restart skip``: a JobSet restart, the RAM
    disk outlives the Pod), and with ``--sigterm-flush after-hook`` a SIGTERM no hook came before (an in-place
    restart), is no notice: no flush, by native mode's rule (:func:`replicator.preemption.sigterm_skips_flush`).
    """
    daemon = mode.daemon
    if daemon is None or grace_seconds <= 0:
        log.info("SIGTERM: no preemption flush (%s)", "no handshake yet" if daemon is None else "no grace left")
        return None
    skip = sigterm_skips_flush(mode.local, started_wall, noticed=daemon.preemption.state.preempting,
                               sigterm_flush=mode.opts.sigterm_flush)
    if skip:
        log.info("%s", skip)
        return None
    return daemon.preemption.flush(grace_seconds)


def run_orbax_mode(opts: ReplicatorOptions) -> int:
    """Serve Orbax's handshakes in the foreground until SIGTERM (exit 0); bad configuration -> exit 2.

    Prints ``LISTENING HOST:PORT`` once the first Replicator serves (after the first handshake started:
    rank and nodes come from Orbax's ``replicator.yaml``).
    """
    try:
        if not opts.orbax_mode:
            raise ConfigError("Orbax mode is --local-dir without --rank/--nodes")
        mode = OrbaxMode(opts)
    except (ConfigError, ValueError, OSError) as e:
        print(f"mtc replicator: {e}", file=sys.stderr)
        return 2
    started_wall = time.time()
    latch = ShutdownLatch().install()
    log.info("Orbax mode: waiting for %s in %s (replicator address %s)", oc.REPLICATOR_FILE, mode.local,
             mode.listen)
    loop = threading.Thread(target=mode.serve, name="mtc-orbax", daemon=True)
    loop.start()
    latch.wait()
    mode.stopping.set()
    loop.join(timeout=PREPARE_SLICE_SECONDS + opts.rpc_timeout_seconds)
    if latch.sigterm:
        flush_on_sigterm(mode, opts.preemption_grace_seconds - (time.monotonic() - latch.got[0][1]), started_wall)
    mode.stop()
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
