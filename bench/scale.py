"""Control-plane scale benchmark: the real coordinator service with simulated hosts (one JSON line).

    python -m bench.scale [--sizes 1000,4000,10000] [--grpc-calls 3000]

Simulated job: ``N`` hosts in 2 data-parallel slices (as in issue #9's measurements), every host holding
its own data of 2 steps plus the attestation of its replica's identical data (steady state), keep 2.

- ``round_seconds_<N>``: CPU seconds of one round in which every host reports a newly saved step (a delta)
  and then one quiet round (digest only), in-process through ``Coordinator.Heartbeat`` (planner cost);
  best of 3. ``grpc_round_cpu_seconds_<N>``: server CPU of one round of N unchanged heartbeats over real
  gRPC on loopback. ``round_growth_exponent``: the larger slope of log(round) over log(N) of the two
  (1.0 = linear in N, O(1) per heartbeat).
- ``heartbeat_cost_vs_noop_10k``: server-process CPU per unchanged heartbeat at the largest N over real
  gRPC on loopback, divided by the CPU per call of a no-op handler of the same RPC in the same run
  (clients in a separate process, so only the server's CPU is counted).
- ``coordinator_core_fraction_10k``: that CPU per heartbeat times the heartbeats per second the
  coordinator asks for at the largest N with the default options (interval stretched to N / 200 s).
- ``restore_plan_seconds_10k``: planning ``PrepareRestore``'s plan after losing one host, and after losing a
  whole slice (the worse of the two; both are reported too).
- ``status_bytes_10k``: default ``GetStatus`` answer size with a slice lost (``status_hosts_bytes_10k``:
  with per-host detail).
- ``round_during_backup_vs_quiet_10k``: CPU of a quiet round while a backup of the newest step runs (every
  heartbeat asks the bucket scheduler for its upload task) / a quiet round without one, at the largest N.
- ``host_query_seconds_10k``: the controller's side of a ``STEPS`` query at the largest N without a
  coordinator (what ``latest_step()`` does): N hosts' answers (2 steps saved by every rank, each host
  holding its own data) encoded into the colocated result rows, decoded and reduced by the shared
  completeness rule, CPU seconds, best of 3; ``host_answer_bytes_10k``: the largest answer row's JSON
  (bounded independent of N: savers travel as rank ranges; the row is ``QUERY_BYTES``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from concurrent import futures

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.tier_wire import to_wire
from replicator.tiers import Holding, Tier, inventory_digest

JOB = "bench"
SLICES = 2


class _Ctx:
    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float:
        return 30.0


def _holdings(topo: JobTopology, rank: int, steps: list[int]) -> list[Holding]:
    out = []
    i = topo.index_in_slice(rank)
    for s in steps:
        out.append(Holding(rank, s, f"s{s}-i{i}", 1 << 20, Tier.LOCAL))
        for rep in topo.replicas_of(rank):
            out.append(Holding(rep, s, f"s{s}-i{i}", 1 << 20, Tier.REPLICA))
    return out


def _pb(hs: list[Holding]) -> list[pb.Holding]:
    return [pb.Holding(owner_rank=h.owner_rank, step=h.step, content_hash=h.content_hash, size=h.size,
                       tier=to_wire(h.tier)) for h in hs]


class Sim:
    """N simulated hosts reporting to one in-process Coordinator the way the daemon does (digest + deltas)."""

    def __init__(self, n: int):
        self.topo = JobTopology(n, SLICES, 1)
        self.coord = Coordinator(self.topo, JOB, keep_local=2, heartbeat_seconds=2.0)
        self.inv: dict[int, list[Holding]] = {}
        self.digest: dict[int, str] = {}
        self.epoch = self.coord.epoch  # the hosts have had one answer (a report counts under its epoch)
        self.ctx = _Ctx()

    def beat(self, rank: int, new: list[Holding] | None = None, gone: list[tuple[int, int]] = ()) -> pb.HeartbeatResponse:
        req = pb.HeartbeatRequest(job=JOB, rank=rank, incarnation=1, address=f"10.0.0.{rank}:7070",
                                  known_epoch=self.epoch, newest_saved_step=-1)
        if rank not in self.digest:
            req.full_report = True
            req.holdings.extend(_pb(self.inv[rank]))
        else:
            req.base_digest = self.digest[rank]
            if new or gone:
                keep = {(h.owner_rank, h.step): h for h in self.inv[rank] if (h.owner_rank, h.step) not in gone}
                for h in new or []:
                    keep[(h.owner_rank, h.step)] = h
                self.inv[rank] = list(keep.values())
                req.holdings.extend(_pb(new or []))
                req.removed.extend(pb.Deletion(owner_rank=o, step=s) for o, s in gone)
        req.inventory_digest = inventory_digest(self.inv[rank])
        resp = self.coord.Heartbeat(req, self.ctx)
        self.epoch = resp.epoch
        self.digest[rank] = resp.acked_digest
        return resp

    def populate(self, steps: list[int]) -> None:
        for r in range(self.topo.nodes):
            self.inv[r] = _holdings(self.topo, r, steps)
        for r in range(self.topo.nodes):
            self.beat(r)

    def save_round(self, step: int) -> None:
        """Every host commits ``step`` (and its replica's attestation) and drops its oldest step."""
        for r in range(self.topo.nodes):
            old = min(h.step for h in self.inv[r])
            gone = [(h.owner_rank, h.step) for h in self.inv[r] if h.step == old]
            self.beat(r, _holdings(self.topo, r, [step]), gone)

    def quiet_round(self) -> None:
        for r in range(self.topo.nodes):
            self.beat(r)


def _round_seconds(n: int, reps: int = 3) -> tuple[float, Sim]:
    """Best of ``reps`` (save round + quiet round) CPU times: the box is shared, the minimum is the cost."""
    sim = Sim(n)
    sim.populate([1, 2])
    sim.quiet_round()
    best = math.inf
    for step in range(3, 3 + reps):
        gc.collect()
        t0 = time.process_time()
        sim.save_round(step)
        sim.quiet_round()
        best = min(best, time.process_time() - t0)
        assert sim.coord.state.newest_complete_step() == step, "the simulated save did not complete"
    return best, sim


def _round_during_backup(sim: Sim, reps: int = 3) -> float:
    """Quiet rounds while a backup runs (nobody reports an upload, so it stays in progress) / without."""
    import tempfile

    from replicator.backup.bucket import BackupStore
    from replicator.backup.scheduler import BucketScheduler
    from replicator.backup.storage.filesystem import FileStore

    def best() -> float:
        out = math.inf
        for _ in range(reps):
            gc.collect()
            t0 = time.process_time()
            sim.quiet_round()
            out = min(out, time.process_time() - t0)
        return out

    quiet = best()
    with tempfile.TemporaryDirectory(prefix="mtc-bench-scale-") as d:
        sched = BucketScheduler(BackupStore(FileStore(d), JOB), sim.topo, interval_steps=1)
        before = sim.coord.backup
        sim.coord.backup = sched
        try:
            sim.beat(0)  # starts the backup of the newest complete step
            assert sched.current is not None, sched.last_error
            during = best()
        finally:
            sim.coord.backup = before
            sim.coord.state.clear_backup_in_progress(sched.current.step)
    return during / quiet


def _restore_plan(sim: Sim) -> tuple[float, float]:
    st = sim.coord.state
    n, h = sim.topo.nodes, sim.topo.hosts_per_slice
    t0 = time.perf_counter()
    st.forget_host(n // 3, 0.0)
    one = st.restore_plan(restoring=False)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in range(0, h):  # slice 0
        st.forget_host(r, 0.0)
    whole = st.restore_plan(restoring=False)
    t_slice = time.perf_counter() - t0
    newest = st.newest_complete_step()
    assert one.step == newest and whole.step == newest, (one.reason, whole.reason)
    return t_one, t_slice


# ------------------------------------------------------------------------------------------ real gRPC

class _Noop(pb_grpc.CoordinatorServicer):
    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse()


def _client(address: str, n: int, calls: int, threads: int, digests_file: str) -> None:
    """Child process: ``calls`` unchanged heartbeats of random ranks, ``threads`` at a time."""
    import random

    with open(digests_file) as f:
        digests = json.load(f)
    epoch = digests.pop("epoch")
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CoordinatorStub(channel)
    rng = random.Random(1)
    reqs = []
    # calls == n: one round (every host once, shuffled); otherwise random hosts.
    ranks = rng.sample(range(n), n) if calls == n else [rng.randrange(n) for _ in range(calls)]
    for r in ranks:
        d = digests[str(r)]
        reqs.append(pb.HeartbeatRequest(job=JOB, rank=r, incarnation=1, address=f"10.0.0.{r}:7070",
                                        inventory_digest=d, base_digest=d, known_epoch=epoch,
                                        newest_saved_step=-1))
    with futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda q: stub.Heartbeat(q, timeout=30), reqs))
    channel.close()


def _grpc_cpu_per_call(servicer, sim: Sim, calls: int, threads: int = 4) -> float:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    path = f"/tmp/mtc-bench-scale-{os.getpid()}.json"
    with open(path, "w") as f:
        json.dump({**{str(r): d for r, d in sim.digest.items()}, "epoch": sim.epoch}, f)
    try:
        cmd = [sys.executable, "-m", "bench.scale", "--client", f"127.0.0.1:{port}", "--n", str(sim.topo.nodes),
               "--grpc-calls", str(calls), "--threads", str(threads), "--digests", path]
        # Warm up the connection and code paths, then measure this process's CPU over the calls.
        subprocess.run(cmd[:-4] + ["--threads", "1", "--digests", path, "--warmup"], check=True)
        t0 = time.process_time()
        subprocess.run(cmd, check=True)
        return (time.process_time() - t0) / calls
    finally:
        server.stop(0)
        os.unlink(path)


def _slope(sizes: list[int], seconds: dict[int, float]) -> float:
    """Least-squares slope of log(seconds) over log(N)."""
    xs = [math.log(n) for n in sizes]
    ys = [math.log(seconds[n]) for n in sizes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def _host_query(n: int, reps: int = 3) -> tuple[float, int]:
    """(CPU seconds of the controller's side of one STEPS query over ``n`` hosts, largest answer bytes)."""
    from controller_client.dispatch import QUERY_BYTES
    from sidecar import host, saves

    every = saves.RankRanges.every(n)
    answers = [host.StepsAnswer((1, 2), 0, tuple(saves.StepSave(s, s, every, saves.RankRanges.of([r]))
                                                   for s in (1, 2))) for r in range(n)]
    best, biggest = math.inf, 0
    for _ in range(reps):
        gc.collect()
        t0 = time.process_time()
        rows = [host.encode_result(host.HostQuery.STEPS, {r: a}, QUERY_BYTES) for r, a in enumerate(answers)]
        got = {}
        for row in rows:
            got.update(host.decode_result(host.HostQuery.STEPS, row))
        complete = saves.complete_steps(h for a in got.values() for h in a.held)
        best = min(best, time.process_time() - t0)
        assert complete == [1, 2] and len(got) == n, complete
        biggest = max(int.from_bytes(bytes(row[:4]), "little") for row in rows)
    return best, biggest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,4000,10000")
    ap.add_argument("--grpc-calls", type=int, default=3000)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--digests", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        _client(args.client, args.n, 200 if args.warmup else args.grpc_calls, args.threads, args.digests)
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    result: dict[str, float | int | dict] = {}
    rounds, grpc_rounds = {}, {}
    sim = None
    for n in sizes:
        rounds[n], sim = _round_seconds(n)
        result[f"round_seconds_{n}"] = round(rounds[n], 3)
        # The same service over real gRPC: server CPU of one round of n unchanged heartbeats.
        grpc_rounds[n] = _grpc_cpu_per_call(sim.coord, sim, n) * n
        result[f"grpc_round_cpu_seconds_{n}"] = round(grpc_rounds[n], 3)
    planner_slope, grpc_slope = _slope(sizes, rounds), _slope(sizes, grpc_rounds)
    result["planner_round_growth_exponent"] = round(planner_slope, 3)
    result["grpc_round_growth_exponent"] = round(grpc_slope, 3)
    result["round_growth_exponent"] = round(max(planner_slope, grpc_slope), 3)
    big = sizes[-1]
    tag = f"{big // 1000}k"
    assert sim is not None
    hb = _grpc_cpu_per_call(sim.coord, sim, args.grpc_calls)
    noop = _grpc_cpu_per_call(_Noop(), sim, args.grpc_calls)
    result[f"heartbeat_cpu_ms_{tag}"] = round(hb * 1e3, 4)
    result["noop_cpu_ms"] = round(noop * 1e3, 4)
    result[f"heartbeat_cost_vs_noop_{tag}"] = round(hb / noop, 3)
    interval = sim.coord.heartbeat_interval()
    result[f"heartbeat_interval_seconds_{tag}"] = round(interval, 2)
    result[f"coordinator_core_fraction_{tag}"] = round(hb * big / interval, 4)
    result[f"round_during_backup_vs_quiet_{tag}"] = round(_round_during_backup(sim), 3)
    t_one, t_slice = _restore_plan(sim)
    result[f"restore_plan_seconds_{tag}_one_host"] = round(t_one, 3)
    result[f"restore_plan_seconds_{tag}_one_slice"] = round(t_slice, 3)
    result[f"restore_plan_seconds_{tag}"] = round(max(t_one, t_slice), 3)
    status = sim.coord._status(pb.GetStatusRequest())
    result[f"status_bytes_{tag}"] = status.ByteSize()
    result[f"status_hosts_bytes_{tag}"] = sim.coord._status(pb.GetStatusRequest(hosts=True)).ByteSize()
    q_seconds, q_bytes = _host_query(big)
    result[f"host_query_seconds_{tag}"] = round(q_seconds, 3)
    result[f"host_answer_bytes_{tag}"] = q_bytes
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
