"""A host's rules with its coordinator: what it reports, which answer it accepts, what it does with one.

Pure (no I/O, no threads, no clocks: inputs in, typed decisions out), like the coordinator's planner. The
daemon's :mod:`replicator.heartbeat` calls it for every decision and keeps the I/O (RPCs, the RAM-disk store,
the task threads); the simulation's hosts (``tests/simulation/model.py``) call the same functions over their
simulated I/O, so a defect in a host's rules shows there without being copied into a model (STYLE.md 20).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import tier_pb2
from replicator.tier_wire import holding_to_wire
from replicator.tiers import Holding

HoldingKey = tuple[int, int]  # (owner rank, step)
TaskKey = tuple[str, int, int]  # (kind, owner rank, step) of a task on the host's pool (replicator.tasks)


# ------------------------------------------------------------------ what a host reports
@dataclasses.dataclass(frozen=True)
class Acked:
    """What the coordinator holds of this host: the inventory of a report it acknowledged, and its digest.

    ``parity``: the parity holdings of that report (erasure coding; their shape is the parity duty's)."""

    digest: str
    holdings: Mapping[HoldingKey, Holding]
    parity: Mapping[Any, Any] = dataclasses.field(default_factory=dict)


def reportable(inventory: Iterable[Holding], nodes: int) -> list[Holding]:
    """The holdings a host reports: copies of ranks the job no longer has (it was re-initialised on fewer
    hosts, e.g. Orbax after a slice was lost) cannot be addressed: not reported, so the coordinator accepts the
    rest."""
    return [h for h in inventory if h.owner_rank < nodes]


@dataclasses.dataclass(frozen=True)
class Report:
    """Who reports and what besides its inventory (:func:`request`)."""

    job: str
    rank: int
    incarnation: int
    address: str
    report_seq: int  # numbers this process's reports: the coordinator refuses one delivered late or twice
    known_epoch: int  # the highest coordinator epoch this host accepted
    newest_saved_step: int = -1
    backup_requests: tuple[int, ...] = ()
    preempting: bool = False
    fence_nodes: int = 0  # Orbax mode: the node count the reports carry; 0 native


def request(report: Report, current: Mapping[HoldingKey, Holding], digest: str,
            acked: Acked | None) -> cpb.HeartbeatRequest:
    """The heartbeat: a full report when the coordinator holds no picture of this host (``acked`` None), else
    the holdings changed since ``acked`` and the ones gone (``removed``). ``current``: what the host holds now,
    ``digest`` its inventory digest (its parity included). Parity, backup reports and the last restore are
    added by their owners."""
    req = cpb.HeartbeatRequest(
        job=report.job, rank=report.rank, incarnation=report.incarnation, address=report.address,
        newest_saved_step=report.newest_saved_step, backup_requests=list(report.backup_requests),
        inventory_digest=digest, known_epoch=report.known_epoch, preempting=report.preempting,
        nodes=report.fence_nodes, report_seq=report.report_seq,
    )
    if acked is None:
        req.full_report = True
        changed: Iterable[Holding] = current.values()
    else:
        req.base_digest = acked.digest
        if acked.holdings is current:  # nothing changed since the acknowledged report (a cached inventory)
            changed = ()
        else:
            changed = [h for h in current.values() if acked.holdings.get(h.key) != h]
            req.removed.extend(cpb.Deletion(owner_rank=o, step=s) for o, s in acked.holdings if (o, s) not in current)
    for h in changed:
        holding_to_wire(h, req.holdings.add())
    return req


def acknowledged(resp: cpb.HeartbeatResponse, digest: str, current: Mapping[HoldingKey, Holding],
                 parity: Mapping[Any, Any]) -> Acked | None:
    """What the coordinator holds of this host after ``resp``, the answer to a report of ``digest``
    (``current``, ``parity``): None when it has no picture (restart, failover): the next report is a full one,
    sent at once."""
    if resp.acked_digest and resp.acked_digest == digest:
        return Acked(digest, current, parity)
    return None


@dataclasses.dataclass(frozen=True)
class LastRecords:
    """The host's last restore and last Orbax handshake (:mod:`replicator.metrics`' records: each replaced whole
    when a newer one ends, so compared by identity)."""

    restore: Any = None
    handshake: Any = None


def attach_last_records(req: cpb.HeartbeatRequest, now: LastRecords, taken: LastRecords | None,
                        acked: Acked | None) -> None:
    """Add to ``req`` the records of ``now`` the coordinator does not hold: each is sent once (``taken``: the
    records of the last report it answered, None before any), and again in a full report (``acked`` None: a
    coordinator without this host's picture, restarted or taken over, holds none of them either). The
    coordinator keeps the last one per host for `mtc status`."""
    old = LastRecords() if acked is None or taken is None else taken
    if now.restore is not None and now.restore is not old.restore:
        req.last_restore.CopyFrom(now.restore.to_wire())
    if now.handshake is not None and now.handshake is not old.handshake:
        req.last_handshake.CopyFrom(now.handshake.to_wire())


# ------------------------------------------------------------------ which coordinator and which epoch it accepts
@dataclasses.dataclass(frozen=True)
class Epoch:
    """The verdict on an answer's epoch (:func:`accept_epoch`)."""

    accept: bool  # False: a deposed coordinator's answer, ignored as a whole
    epoch: int  # the highest epoch this host accepted, after this answer
    step_down: bool  # this host's own active candidate is deposed by it: a named command for the caller


def accept_epoch(known: int, answered: int, own_active_epoch: int | None = None) -> Epoch:
    """Follow the answering coordinator's epoch ``answered`` (``known``: the highest accepted so far).

    ``own_active_epoch``: the epoch of this host's own coordinator candidate while it serves (None: not a
    candidate, or not serving). When another candidate serves a newer epoch, ours is deposed, though no host may
    ever report that epoch to it (this one just did elsewhere): serving on, it would answer a restarted trainer on
    this host from a view whose pieces the newer coordinator is deleting (simulation seed 77568, issue #33)."""
    if answered < known:
        return Epoch(False, known, False)
    return Epoch(True, answered, own_active_epoch is not None and answered > own_active_epoch)


@dataclasses.dataclass(frozen=True)
class Takeover:
    """Whether this host's own (standby) candidate takes over now (:func:`takeover`)."""

    now: bool  # False: keep waiting, reporting meanwhile to a higher candidate that serves
    lower_down_since: float  # since when no lower candidate answered (the caller keeps it)

    def silent_seconds(self, now: float) -> float:
        """How long every lower candidate has been silent to this host at ``now``: the coordinator that takes
        over counts their hosts' silence from then, not from its activation (``Coordinator.activate``)."""
        return max(0.0, now - self.lower_down_since)


def takeover(lower_down_since: float | None, now: float, takeover_after: float, hinted: bool = False) -> Takeover:
    """Reached in the candidates' order at its own standby candidate: whether it takes over (every lower one
    silent ``takeover_after`` seconds, counted from ``lower_down_since``, or from ``now`` when first silent; or
    at once when ``hinted``: a client named every lower candidate's host gone, replicator/coordinator/gone.py).

    Meanwhile the host reports to a higher candidate that serves (one took over while ours was cut off, and
    deposed it): silent, this host's data is unknown to it and gets no attestation task, so the step may not
    survive the loss of the hosts that do report (simulation seed 70347, issue #33)."""
    since = now if lower_down_since is None else lower_down_since
    return Takeover(hinted or now - since >= takeover_after, since)


def takeover_epoch(clock_ns: int, known: int) -> int:
    """The epoch this host's candidate takes over with: its clock in nanoseconds, above any epoch accepted."""
    return max(clock_ns, known + 1)


def lower_serves(answered: int, mine: int | None) -> bool:
    """Whether candidate ``answered`` is lower than this host's own (``mine``): the wait restarts and its own
    candidate, if it serves, steps back."""
    return mine is not None and answered < mine


# ------------------------------------------------------------------ what it does with an answer
@dataclasses.dataclass(frozen=True)
class Delete:
    """Delete this host's copy of ``owner_rank``'s ``step`` now: only the one of ``content_hash`` when given (a
    save committed since under the same step stays; the store's check)."""

    owner_rank: int
    step: int
    content_hash: str | None


@dataclasses.dataclass(frozen=True)
class Attest:
    """A hash-only task: record that ``owner_rank``'s data of ``step`` is bytes held here (a witness), or
    ``coming`` here (a copy or the restore of the same answer brings that content)."""

    owner_rank: int
    step: int
    content_hash: str
    coming: bool


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy the task's piece from its source, unless the store holds those bytes already (its question)."""

    task: cpb.CopyTask


@dataclasses.dataclass(frozen=True)
class HoldBack:
    """A copy not taken while this host's own restore of the step brings identical bytes (a data-parallel
    replica's): once it lands, the coordinator asks for a hash-only attestation instead. Meanwhile the copy
    would move the same bytes twice and slow the restore the job waits for (ours_orbax's restore_all_lost in
    bench.emergency: 2.6 s, every host restoring from the bucket while copying a replica's data)."""

    task: cpb.CopyTask


@dataclasses.dataclass(frozen=True)
class Work:
    """An answer's work, in the order it is done: deletions now, then the copies in the answer's order (each a
    hash-only attestation, a copy or one held back), then the restore, (the parity's work,) the backup share."""

    deletions: tuple[Delete, ...]
    copies: tuple[Attest | Copy | HoldBack, ...]
    restore: cpb.RestoreTask | None
    backup: cpb.BackupTask | None  # run only where a bucket is configured
    restoring: dict[int, frozenset[str]]  # step -> the content its restore brings, running or this answer's


def busy(in_flight: Collection[TaskKey], owner: int, step: int) -> bool:
    """A task touches ``owner``'s ``step`` (or a backup the whole step): not to be deleted now."""
    return any(k[1] == owner and k[2] == step for k in in_flight) or any(
        k[0] == "backup" and k[2] == step for k in in_flight)


def restoring_now(resp: cpb.HeartbeatResponse, rank: int, restoring: Mapping[int, frozenset[str]],
                  in_flight: Collection[TaskKey]) -> dict[int, frozenset[str]]:
    """Step -> the content hashes this host's restore of it brings: the restore ``resp`` carries, and any still
    running (among ``in_flight``) from an earlier answer (``restoring``: as the last answer left it)."""
    out = dict(restoring)
    running = {k[2] for k in in_flight if k[0] == "restore" and k[1] == rank}
    if resp.HasField("restore"):
        out[resp.restore.step] = frozenset(s.content_hash for s in resp.restore.sources if s.content_hash)
        running.add(resp.restore.step)  # submitted after the copies
    return {step: hashes for step, hashes in out.items() if step in running}


def work(resp: cpb.HeartbeatResponse, rank: int, restoring: Mapping[int, frozenset[str]],
         in_flight: Collection[TaskKey]) -> Work:
    """What host ``rank`` does with ``resp`` (an answer whose epoch it accepted), given the restores it had
    running (``restoring``, as the last :class:`Work` left it) and its tasks ``in_flight``."""
    deletions = tuple(
        Delete(x.owner_rank, x.step, x.content_hash or None) for x in resp.deletions
        # parity deletions are the parity duty's (this host's parity of the step, not its data)
        if x.tier != tier_pb2.TIER_PARITY and not busy(in_flight, x.owner_rank, x.step))
    # Content this answer tells us to copy or restore here: a witness of it (a hash-only task) is recorded at once.
    coming = {(c.step, c.content_hash) for c in resp.copies if c.source_rank != rank}
    if resp.HasField("restore"):
        coming.update((resp.restore.step, s.content_hash) for s in resp.restore.sources)
    now = restoring_now(resp, rank, restoring, in_flight)
    copies: list[Attest | Copy | HoldBack] = []
    for c in resp.copies:
        if c.source_rank == rank:
            copies.append(Attest(c.owner_rank, c.step, c.content_hash, (c.step, c.content_hash) in coming))
        elif c.content_hash in now.get(c.step, ()):
            copies.append(HoldBack(c))
        else:
            copies.append(Copy(c))
    return Work(deletions, tuple(copies), resp.restore if resp.HasField("restore") else None,
                resp.backup if resp.HasField("backup") else None, now)
