"""The fault tests' history checker: every save outcome and every coordinator answer of a case, and the
invariants they must satisfy (docs/testing.md, "Fault injection").

A case has a fault window ``[t_cut, t_heal]`` (``time.monotonic()``). Invariants:

- every save succeeded;
- each ``CoordinatorClient`` (one per probe process) never returned a newest complete step lower than one it
  returned before, nor an answer of a lower coordinator epoch than one it returned before;
- no complete step is lost: after the heal a newest complete step at least the highest ever returned, and
  newer than the last step saved before the heal, is returned within the progress bound, and a restore
  is prepared of a step at least that high;
- with ``fetch_required`` (the network cases): the restore after the heal fetched more than 0 bytes from a
  peer or the bucket onto the host replaced before it (its replicator's typed local status);
- with ``slow_only`` (slow or lossy links, no partition): besides the bounds on saves, lost hosts and the lag
  of the newest complete step, at least :data:`MIN_ANSWERS_PER_SECOND` answers within those bounds, and the
  newest peer copy of each of ``keep_up_ranks`` (the ranks whose copies do not cross the slow link) at most
  ``max_lag_steps`` behind the step saved 2 s earlier, sampled at least :data:`MIN_COPY_SAMPLES` times;
- with ``old_coordinator`` (the serving candidate cut off): a later candidate served during the cut with a
  newer epoch, and the old one answered no client from ``isolated_after`` seconds into the cut until the heal,
  nor after the heal unless with an epoch newer than its successor's (serving afresh, not from its stale view).

:data:`SUMMARY` collects the cases; tests/faults/conftest.py prints it, with the run's skipped, failed and
errored tests and the bytes each case's restore fetched across the network (``bytes_fetched``), as one JSON
line at the end of every run that selects fault tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# A slow or lossy case's coordinator must keep answering: both probes together poll about 6 times a second; a
# second without one answer (within the bounds) on average is a coordinator that stopped serving.
MIN_ANSWERS_PER_SECOND = 1.0
MIN_COPY_SAMPLES = 5  # per rank whose copies must keep up, over the fault (one a second)


@dataclass
class Summary:
    cases: int = 0
    passed: int = 0
    violations: int = 0
    worst_seconds_to_progress: float = 0.0
    details: list[dict] = field(default_factory=list)

    known_defects: int = 0
    bytes_fetched: dict[str, int] = field(default_factory=dict)  # per case: its restore's bytes across the network

    def add(self, name: str, violations: list[str], seconds_to_progress: float | None,
            known_defect: bool = False, bytes_fetched: int | None = None) -> None:
        """Count a checked case; a known defect's case (a strict xfail) is counted apart."""
        if bytes_fetched is not None:
            self.bytes_fetched[name] = bytes_fetched
        if known_defect:
            self.known_defects += 1
            self.details.append({"case": name, "known_defect": True, "violations": violations,
                                 "seconds_to_progress": seconds_to_progress})
            return
        self.cases += 1
        self.passed += not violations
        self.violations += len(violations)
        if seconds_to_progress is not None:
            self.worst_seconds_to_progress = max(self.worst_seconds_to_progress, seconds_to_progress)
        self.details.append({"case": name, "violations": violations, "seconds_to_progress": seconds_to_progress})

    def line(self, **outcomes: int) -> str:
        """The run's JSON line: the checked cases, then ``outcomes`` (the run's skipped, failed and errors)."""
        return json.dumps({"cases": self.cases, "passed": self.passed, "violations": self.violations,
                           "worst_seconds_to_progress": round(self.worst_seconds_to_progress, 2),
                           "known_defects": self.known_defects, **outcomes,
                           "bytes_fetched": dict(self.bytes_fetched)})


SUMMARY = Summary()


def _ok(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("code") == "OK"]


@dataclass
class Case:
    """One case's history; :meth:`check` returns its violations (empty: passed)."""

    name: str
    t_cut: float
    t_heal: float
    client_streams: list[list[dict]]  # per probe process: its client records, in order
    direct: list[dict]  # direct records of every probe
    saves: list[dict]
    progress_bound: float
    t_progress: float | None = None  # first answer after the heal with a step saved after the heal
    restored: dict = field(default_factory=dict)  # the restore after progress: step, seconds, t_end
    old_coordinator: str = ""
    successor: str = ""
    isolated_after: float = 0.0
    # A step complete only on the host about to be cut (its copy in flight): answers may fall back from it,
    # but never below the newest step answered before it.
    unreplicated: int = -1
    # A slow link, no partition: no host is declared lost during the fault, each save (write and the
    # daemon's acknowledgement) takes at most save_seconds_bound, and the newest complete step lags the
    # newest saved step (2 s earlier) by at most max_lag_steps.
    slow_only: bool = False
    save_seconds_bound: float = 2.0
    max_lag_steps: int = 2
    extra: list[str] = field(default_factory=list)  # violations found by the test itself (copies, files)
    # The restore after the heal had to fetch across the network; what it fetched (None: not read).
    fetch_required: bool = False
    bytes_fetched: int | None = None
    # slow_only: the ranks whose copies must keep up, and samples {t, owner, step} of their newest peer copy.
    keep_up_ranks: tuple[int, ...] = ()
    copies: list[dict] = field(default_factory=list)

    def highest_before_heal(self) -> int:
        return max((r["newest"] for s in self.client_streams for r in _ok(s) if r["t"] <= self.t_heal),
                   default=-1)

    def seconds_to_progress(self) -> float | None:
        end = self.restored.get("t_end")
        return None if end is None or "step" not in self.restored else end - self.t_heal

    def check(self) -> list[str]:
        v: list[str] = list(self.extra)
        v += [f"save of step {s['step']} failed: {s['error']}" for s in self.saves if not s["ok"]]
        for i, stream in enumerate(self.client_streams):
            v += self._check_monotonic(i, stream)
        highest = self.highest_before_heal()
        last_saved = max((s["step"] for s in self.saves if s["t"] <= self.t_heal), default=-1)
        if self.t_progress is None:
            v.append(f"no newest complete step above {max(highest, last_saved)} within {self.progress_bound}s "
                     "of the heal")
        if "step" not in self.restored:
            v.append(f"no restore after the heal: {self.restored.get('error', 'not attempted')}")
        elif self.restored["step"] < highest:
            v.append(f"restore prepared step {self.restored['step']} below the complete step {highest}")
        took = self.seconds_to_progress()
        if took is not None and took > self.progress_bound:
            v.append(f"progress took {took:.1f}s after the heal (bound {self.progress_bound}s)")
        if self.fetch_required and "step" in self.restored and not (self.bytes_fetched or 0) > 0:
            v.append(f"the restore of step {self.restored['step']} fetched {self.bytes_fetched} bytes across "
                     "the network (none: it proved nothing about the network)")
        if self.old_coordinator:
            v += self._check_failover()
        if self.slow_only:
            v += self._check_slow()
        return v

    def _check_monotonic(self, i: int, stream: list[dict]) -> list[str]:
        v: list[str] = []
        high = floor = -1
        epoch = 0
        for r in _ok(stream):
            got = max(r.get("steps_epoch", 0), r["epoch"])
            if min(r.get("steps_epoch", got), r["epoch"]) < epoch:
                v.append(f"client {i}: an answer of epoch {min(r.get('steps_epoch', got), r['epoch'])} after "
                         f"epoch {epoch} (t={r['t'] - self.t_cut:.2f}s after the cut)")
            epoch = max(epoch, got)
            n = r["newest"]
            if n < high:
                if high == self.unreplicated and n >= floor:
                    high = n  # the in-flight step fell back with its host's loss: allowed, once
                    continue
                v.append(f"client {i}: newest complete step {n} after {high} (t={r['t'] - self.t_cut:.2f}s "
                         "after the cut)")
                high = n  # one violation per fall, not one per answer after it
                continue
            if n > high and n == self.unreplicated:
                floor = high
            high = max(high, n)
        return v

    def _check_slow(self) -> list[str]:
        v: list[str] = []
        during = [s for s in self.saves if self.t_cut <= s["t"] <= self.t_heal]
        for s in during:
            if s["seconds"] > self.save_seconds_bound or not s.get("notified", True):
                v.append(f"save of step {s['step']} took {s['seconds']:.2f}s (bound {self.save_seconds_bound}s), "
                         f"every daemon acknowledged: {s.get('notified')}")
        if len(during) < (self.t_heal - self.t_cut) / 2:  # the trainer saves once a second
            v.append(f"{len(during)} saves during the {self.t_heal - self.t_cut:.0f} s fault")
        answered = 0  # answers within the bounds
        for r in _ok([r for stream in self.client_streams for r in stream]):
            if not self.t_cut + 2.0 <= r["t"] <= self.t_heal:
                continue
            within = True
            if r.get("lost"):
                within = False
                v.append(f"ranks {r['lost']} declared lost on a slow link ({r['t'] - self.t_cut:.1f}s in)")
            saved = max((s["step"] for s in self.saves if s["t"] + s["seconds"] <= r["t"] - 2.0), default=-1)
            if r["newest"] < saved - self.max_lag_steps:
                within = False
                v.append(f"newest complete step {r['newest']} lags step {saved}, saved 2 s before "
                         f"({r['t'] - self.t_cut:.1f}s in)")
            answered += within
        need = int(MIN_ANSWERS_PER_SECOND * (self.t_heal - self.t_cut - 2.0))
        if answered < need:
            v.append(f"{answered} answers within the bounds from the coordinator during the fault (at least "
                     f"{need} required)")
        v += self._check_copies_keep_up()
        return v

    def _check_copies_keep_up(self) -> list[str]:
        v: list[str] = []
        for owner in self.keep_up_ranks:
            samples = [c for c in self.copies if c["owner"] == owner and self.t_cut + 2.0 <= c["t"] <= self.t_heal]
            if len(samples) < MIN_COPY_SAMPLES:
                v.append(f"rank {owner}'s copies sampled {len(samples)} times during the fault "
                         f"(at least {MIN_COPY_SAMPLES} required)")
            for c in samples:
                saved = max((s["step"] for s in self.saves if s["ok"] and s["t"] + s["seconds"] <= c["t"] - 2.0),
                            default=-1)
                if c["step"] < saved - self.max_lag_steps:
                    v.append(f"rank {owner}'s newest peer copy is of step {c['step']}, step {saved} saved 2 s "
                             f"before ({c['t'] - self.t_cut:.1f}s in)")
        return v

    def _check_failover(self) -> list[str]:
        v: list[str] = []
        epoch_before = max((r["epoch"] for s in self.client_streams for r in _ok(s) if r["t"] < self.t_cut),
                           default=0)
        during = [r for s in self.client_streams for r in _ok(s) if self.t_cut < r["t"] <= self.t_heal]
        successor = [r["epoch"] for r in during if r["address"] == self.successor and r["epoch"] > epoch_before]
        if not successor:
            v.append(f"no answer from {self.successor} with an epoch above {epoch_before} during the cut")
        successor_epoch = max(successor, default=epoch_before)
        old = [r for r in self.direct if r["who"] == f"direct:{self.old_coordinator}"]
        for r in _ok(old):
            if self.t_cut + self.isolated_after <= r["t"] <= self.t_heal:
                v.append(f"isolated {self.old_coordinator} answered a client during the cut "
                         f"(t={r['t'] - self.t_cut:.1f}s into it, newest {r['newest']})")
            elif r["t"] > self.t_heal and r["epoch"] <= successor_epoch:
                v.append(f"old coordinator answered {r['t'] - self.t_heal:.1f}s after the heal with epoch "
                         f"{r['epoch']} (successor's {successor_epoch}), newest {r['newest']}")
        return v


def judge_cut_restore(got: dict) -> list[str]:
    """A restore a cut interrupted either completed after the heal (a step) or failed with a clear error: the
    exception's type and a message, not an empty line or a crash without output."""
    if isinstance(got.get("step"), int):
        return []
    kind, _, message = str(got.get("error", "")).partition(": ")
    if kind.isidentifier() and message.strip():
        return []
    return [f"the restore cut off mid-way neither completed nor failed clearly: {got}"]

