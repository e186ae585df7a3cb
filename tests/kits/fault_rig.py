"""The fault tests' rig (issue #33): a test network of its own (tests/kits/faultnet.py), real replicator daemons
in it (tests/kits/fault_cluster.py), a trainer saving throughout, two coordinator probes, and one case run
as cut -> keep saving -> heal -> progress -> restore, checked by the history checker
(tests/kits/fault_history.py). The tests are in tests/faults/; ``make test-faults``; needs root.

Two slices of two hosts; candidates 0 and 2; heartbeats every 0.5 s, a host lost after 6 s. Each case:
the trainer saves a small step on every host every second; the fault starts once the newest saved step
is redundant (a step complete only on the host about to be cut would rightly stop being complete); the
fault lasts about three host-lost times; after the heal a newer step must be complete and a restore
prepared within :data:`PROGRESS_BOUND_SECONDS`.

With ``savers`` (the network cases, issue #45) each host's rank is saved by a process in that host's namespace
through the sidecar's writer (:mod:`tests.kits.fault_saver`), and with ``fetch_restores`` the restore after the
heal must fetch across the network: the restoring host is replaced first (daemon stopped, RAM dir wiped,
started again), so its rank's data of the step can only come from a peer or the bucket; the bytes it fetched
are read from its replicator's typed local status and must be above 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc

from replicator.backup.bucket import BackupStore
from replicator.backup.storage.filesystem import FileStore
from sidecar import layout
from tests.kits import fault_erasure, faultnet
from tests.kits.fault_cluster import CANDIDATES, NODES, FaultCluster, Trainer, check_copy, local_status
from tests.kits.fault_history import SUMMARY, Case

HEARTBEAT_SECONDS = 0.5
LOST_SECONDS = 6.0
CUT_SECONDS = 3 * LOST_SECONDS
PROGRESS_BOUND_SECONDS = 45.0
# From the cut on, the old coordinator may answer from its stale view until it declared every other host
# lost (LOST_SECONDS after their last report), checked on its next call; then never.
ISOLATED_AFTER_SECONDS = LOST_SECONDS + 2 * HEARTBEAT_SECONDS + 1.0
SETTLE_TIMEOUT_SECONDS = 60.0
COPY_SAMPLE_SECONDS = 1.0  # how often a slow or lossy case reads where every rank's newest peer copy is
# The host replaced before the restore after the heal (fetch_restores): not a candidate, so the restore does not
# wait for a failover.
FETCH_RANK = 3

def wait_for(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Rig:
    """The network, the cluster, the trainer and two probes (the controller's, and one on host 0)."""

    def __init__(self, net: faultnet.FaultNetwork, base: Path, savers: bool = False,
                 fetch_restores: bool = False, redundancy: str = "") -> None:
        self.net = net
        # ``redundancy`` (e.g. "ec:3+1"): the daemons' --redundancy ("": the default, a whole copy per rank).
        self.redundancy = redundancy
        self.cluster = FaultCluster(net, base, HEARTBEAT_SECONDS, LOST_SECONDS,
                                    extra=["--redundancy", redundancy] if redundancy else None)
        self.trainer = Trainer(self.cluster)
        self.savers, self.fetch_restores = savers, fetch_restores
        cands = [self.cluster.addresses[r] for r in CANDIDATES]
        self.controller = self.cluster.probe(net.bridge_ns, "controller", direct=",".join(cands))
        self.host0 = self.cluster.probe(net.host_ns[0], "host0", direct=cands[0])

    def latest(self, after: float = 0.0) -> dict | None:
        recs = [r for r in self.controller.records() if r["who"] == "client" and r.get("code") == "OK"
                and r["t"] > after]
        return recs[-1] if recs else None

    def redundant(self, step: int) -> bool:
        r = self.latest(time.monotonic() - 2)
        return bool(r and step in r["redundant"])

    def start(self) -> None:
        self.cluster.start()
        wait_for(lambda: self.latest(), SETTLE_TIMEOUT_SECONDS, "a coordinator answering the controller")
        if self.savers:
            self.trainer.start_savers()
        self.trainer.start()
        wait_for(lambda: self.trainer.step >= 3 and self.redundant(self.trainer.step - 1), SETTLE_TIMEOUT_SECONDS,
                 "the first steps redundant")

    def quiesce(self) -> None:
        """Pause the trainer until its newest step is redundant (then resume it yourself)."""
        self.trainer.pause()
        step = self.trainer.step
        wait_for(lambda: self.redundant(step), SETTLE_TIMEOUT_SECONDS, f"step {step} redundant")

    def run_case(self, name: str, fault: Callable[[], None], cut_seconds: float = CUT_SECONDS,
                 after_heal: Callable[[], None] | None = None, train_during_fault: bool = True,
                 fetch_rank: int | tuple[int, ...] = FETCH_RANK, keep_up_ranks: tuple[int, ...] = (),
                 before_replace: Callable[[int], None] | None = None, **case_kw: object) -> Case:
        """Quiesce, fault, keep saving (unless not ``train_during_fault``) for ``cut_seconds``, heal, wait
        for progress, restore (with ``fetch_restores``: onto host ``fetch_rank`` replaced first; a tuple: those
        hosts replaced together, the bytes fetched summed, each host's above 0). ``before_replace(step)``: called
        once the step to restore is redundant, before the hosts are replaced. During the fault, every
        :data:`COPY_SAMPLE_SECONDS` the newest peer copy (ec: parity) of each of ``keep_up_ranks`` is read. The
        case's history is returned for :func:`assert_passed`."""
        fetch_ranks = (fetch_rank,) if isinstance(fetch_rank, int) else fetch_rank
        self.quiesce()
        t_cut = time.monotonic()
        fault()
        if train_during_fault:
            self.trainer.resume()
        copies: list[dict] = []
        end = time.monotonic() + cut_seconds  # from the fault's end (a fault may take time: a restart)
        while (left := end - time.monotonic()) > 0:  # bounded by the fault's length
            if keep_up_ranks:
                copies += self.newest_copies(keep_up_ranks)
            time.sleep(min(left, COPY_SAMPLE_SECONDS) if keep_up_ranks else left)
        t_heal = time.monotonic()
        self.net.heal()
        self.trainer.resume()
        if after_heal is not None:
            after_heal()
        extra: list[str] = []
        t_progress = None
        try:
            first_after = wait_for(lambda: next((s["step"] for s in self.trainer.saves if s["t"] > t_heal), None),
                                   5, "a save after the heal")
            rec = wait_for(lambda: (r := self.latest(t_heal)) and r["newest"] >= first_after and r,
                           PROGRESS_BOUND_SECONDS, f"step {first_after} complete after the heal")
            t_progress = rec["t"]
        except TimeoutError as e:
            extra.append(str(e))
        self.trainer.pause()  # a restore stops training
        restored: dict = {}
        if t_progress and self.fetch_restores:
            try:
                self.replace_for_restore(fetch_ranks, before_replace)
            except TimeoutError as e:
                extra.append(str(e))
        if t_progress:
            restored = self.cluster.restore(wait_seconds=PROGRESS_BOUND_SECONDS)
        restored["t_end"] = time.monotonic()
        fetched = None
        if "step" in restored:
            extra += self.check_restored(restored["step"])
            if self.fetch_restores:
                for r in fetch_ranks:
                    got, why = self.fetched(r, restored["step"])
                    fetched = None if got is None else (fetched or 0) + got
                    extra += why
        time.sleep(1.0)  # the probes' answers after the restore
        case = Case(name, t_cut, t_heal, self.client_streams(), self.direct(), list(self.trainer.saves),
                    PROGRESS_BOUND_SECONDS, t_progress, restored, extra=extra, copies=copies,
                    keep_up_ranks=keep_up_ranks, fetch_required=self.fetch_restores, bytes_fetched=fetched,
                    **case_kw)  # type: ignore[arg-type]
        return case

    def replace_for_restore(self, ranks: tuple[int, ...],
                            before_replace: Callable[[int], None] | None = None) -> None:
        """The newest saved step redundant, then hosts ``ranks`` replaced (each daemon stopped by pid, its RAM
        dir wiped, started again): their ranks' data of that step is now on a peer, in parity (ec) or in the
        bucket only."""
        step = self.trainer.step
        wait_for(lambda: self.redundant(step), SETTLE_TIMEOUT_SECONDS, f"step {step} redundant before the restore")
        if before_replace is not None:
            before_replace(step)
        self.cluster.replace(*ranks)

    def fetched(self, rank: int, step: int) -> tuple[int | None, list[str]]:
        """The bytes host ``rank``'s replicator fetched from a peer or the bucket since it was replaced (its
        typed local status, ``restore_bytes``), and what is wrong with them."""
        try:
            st = local_status(self.cluster.ram(rank))
        except grpc.RpcError as e:
            return None, [f"host {rank}'s local status after the restore: {e.code().name}"]
        # restore_bytes counts only data brought from a peer or the bucket (a copy already on the RAM disk is
        # attested with 0 bytes and not counted); the last restore itself may be such an attestation (a second
        # task for the step it just fetched), so it is not the measure.
        nbytes = int(st.counters.get("restore_bytes", 0))
        out = []
        if nbytes <= 0:
            out.append(f"host {rank} (replaced) fetched no bytes for the restore of step {step}")
        return nbytes, out

    def newest_copies(self, ranks: tuple[int, ...]) -> list[dict]:
        """Now: the newest second copy of each of ``ranks`` (-1: none): a peer copy on any host, from each host's
        replicator's typed local status (a host that does not answer counts as holding nothing), or a step
        committed in the ``file://`` bucket (which counts as a copy: a peer copy older than a step backed up may
        rightly be deleted before the next one lands). In ec mode (no whole copies): the newest step whose
        parity host ``rank`` holds committed on its RAM disk, or the bucket's."""
        bucket = BackupStore(FileStore(self.cluster.base / "bucket"), "t").committed_steps()
        newest = dict.fromkeys(ranks, max(bucket, default=-1))
        if self.redundancy.startswith("ec:"):
            t = time.monotonic()
            return [{"t": t, "owner": r, "step": max(s, fault_erasure.newest_parity(self.cluster.ram(r)))}
                    for r, s in newest.items()]
        for holder in range(NODES):
            try:
                st = local_status(self.cluster.ram(holder))
            except grpc.RpcError:
                continue
            for p in st.peer_steps:
                if p.owner_rank in newest:
                    newest[p.owner_rank] = max(newest[p.owner_rank], p.step)
        t = time.monotonic()
        return [{"t": t, "owner": r, "step": s} for r, s in newest.items()]

    def check_restored(self, step: int) -> list[str]:
        out = []
        for rank in range(NODES):
            try:
                check_copy(self.cluster.ram(rank) / layout.STEPS_DIR / str(step), rank, step)
            except (AssertionError, OSError, ValueError) as e:
                out.append(f"rank {rank}'s restored step {step}: {type(e).__name__}: {e}")
        return out

    def check_every_copy(self) -> list[str]:
        """Every committed step directory on every host (own and peer copies) verifies bit for bit."""
        out = []
        for rank in range(NODES):
            ram = self.cluster.ram(rank)
            dirs = [(rank, d) for d in (ram / layout.STEPS_DIR).glob("[0-9]*")]
            dirs += [(int(p.name), d) for p in (ram / layout.PEER_DIR).glob("[0-9]*") for d in p.glob("[0-9]*")]
            for owner, d in dirs:
                try:
                    check_copy(d, owner, int(d.name))
                except FileNotFoundError:
                    continue  # deleted meanwhile (retention)
                except (AssertionError, OSError, ValueError) as e:
                    out.append(f"{d}: {type(e).__name__}: {e}")
        return out

    def client_streams(self) -> list[list[dict]]:
        return [[r for r in p.records() if r["who"] == "client"] for p in (self.controller, self.host0)]

    def direct(self) -> list[dict]:
        return [r for p in (self.controller, self.host0) for r in p.records() if r["who"] != "client"]


def assert_passed(rig: Rig, case: Case, known_defect: bool = False) -> None:
    """The history checked, the case counted in the summary line (a known defect's apart)."""
    violations = case.check()
    SUMMARY.add(case.name, violations, case.seconds_to_progress(), known_defect=known_defect,
                bytes_fetched=case.bytes_fetched)
    assert not violations, "\n".join(violations) + "\n" + rig.cluster.logs()
