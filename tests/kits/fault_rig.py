"""The fault tests' rig (issue #33): a test network of its own (tests/kits/faultnet.py), real replicator daemons
in it (tests/kits/fault_cluster.py), a trainer saving throughout, two coordinator probes, and one case run
as cut -> keep saving -> heal -> progress -> restore, checked by the history checker
(tests/kits/fault_history.py). The tests are in tests/faults/; ``make test-faults``; needs root.

Two slices of two hosts; candidates 0 and 2; heartbeats every 0.5 s, a host lost after 6 s. Each case:
the trainer saves a small step on every host every second; the fault starts once the newest saved step
is redundant (a step complete only on the host about to be cut would rightly stop being complete); the
fault lasts about three host-lost times; after the heal a newer step must be complete and a restore
prepared within :data:`PROGRESS_BOUND_SECONDS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sidecar import layout
from tests.kits import faultnet
from tests.kits.fault_cluster import CANDIDATES, NODES, FaultCluster, Trainer, check_copy
from tests.kits.fault_history import SUMMARY, Case

HEARTBEAT_SECONDS = 0.5
LOST_SECONDS = 6.0
CUT_SECONDS = 3 * LOST_SECONDS
PROGRESS_BOUND_SECONDS = 45.0
# From the cut on, the old coordinator may answer from its stale view until it declared every other host
# lost (LOST_SECONDS after their last report), checked on its next call; then never.
ISOLATED_AFTER_SECONDS = LOST_SECONDS + 2 * HEARTBEAT_SECONDS + 1.0
SETTLE_TIMEOUT_SECONDS = 60.0

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

    def __init__(self, net: faultnet.FaultNetwork, base: Path) -> None:
        self.net = net
        self.cluster = FaultCluster(net, base, HEARTBEAT_SECONDS, LOST_SECONDS)
        self.trainer = Trainer(self.cluster)
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
                 **case_kw: object) -> Case:
        """Quiesce, fault, keep saving (unless not ``train_during_fault``) for ``cut_seconds``, heal, wait
        for progress, restore. The case's history is returned for :func:`assert_passed`."""
        self.quiesce()
        t_cut = time.monotonic()
        fault()
        if train_during_fault:
            self.trainer.resume()
        time.sleep(cut_seconds)
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
        restored = self.cluster.restore(wait_seconds=PROGRESS_BOUND_SECONDS) if t_progress else {}
        restored["t_end"] = time.monotonic()
        if "step" in restored:
            extra += self.check_restored(restored["step"])
        time.sleep(1.0)  # the probes' answers after the restore
        case = Case(name, t_cut, t_heal, self.client_streams(), self.direct(), list(self.trainer.saves),
                    PROGRESS_BOUND_SECONDS, t_progress, restored, extra=extra, **case_kw)  # type: ignore[arg-type]
        return case

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
    SUMMARY.add(case.name, violations, case.seconds_to_progress(), known_defect=known_defect)
    assert not violations, "\n".join(violations) + "\n" + rig.cluster.logs()
