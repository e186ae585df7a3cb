"""Reach data beyond this host's RAM disk through the host's replicator (its local control socket).

The replicator knows the other tiers: it asks the coordinator where a rank's data of a step lives and
fetches it — from a peer's RAM disk, else the bucket — verifying every file's crc32c before committing the
copy under ``<root>/peer/<owner>/<step>``. The sidecar then reads it like any local copy — or, for the host's
own data it lacks, while it lands (``stream``, see ``sidecar.landing``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc
from sidecar import commit, layout
from sidecar.landing import Landing, landed_map

log = logging.getLogger(__name__)

LOCATE_TIMEOUT_SECONDS = 30.0
# How long a training process waits for its host's replicator to serve before its first decision that needs the
# other tiers (as long as the Pathways worker's startup probe allows it: 120 probes, 1 s apart), and how often
# it asks (a fine poll: the replicator usually serves within a second of the trainer's start).
REPLICATOR_WAIT_SECONDS = 120.0
REPLICATOR_POLL_SECONDS = 0.02


class ReplicatorUnavailableError(FileNotFoundError):
    """The host's replicator does not serve right now (not started yet, restarting, or its host being
    replaced): the tiers beyond this host's RAM disk are out of reach for the moment. A
    ``FileNotFoundError``, so that a restore retries it while the step is complete elsewhere."""


class ReplicatorFetcher:
    """:class:`sidecar.reader.ReplicatorLink` over the host replicator's ``LocateStep``/``FetchStep`` calls."""

    # ``FetchFiles`` names a file (or a file of pieces) in the reader's scratch directory only once the bytes it
    # wrote matched the crc32cs asked for (replicator/peer/sinks.py, the bucket's ranged fetch), and only the
    # reader and that call write there: the reader need not verify those bytes again.
    files_verified = True

    def __init__(self, root: Path, timeout_seconds: float = 300.0,
                 located: dict[int, tuple[tuple[int, ...], int]] | None = None,
                 manifests: dict[tuple[int, int], layout.StepManifest] | None = None):
        self.root = Path(root)
        self.timeout = timeout_seconds
        # step -> (savers, generation), shared by the fetchers of one restore: one LocateStep per restore.
        self.located = {} if located is None else located
        # (owner, step) -> its manifest, shared likewise by the ranks of one call (one process serving several
        # hosts' devices): each other saver's manifest is fetched once per call, not once per rank.
        self.manifests = {} if manifests is None else manifests

    def _stub(self) -> tuple[grpc.Channel, control_pb2_grpc.LocalControlStub]:
        sock = layout.control_socket(self.root)
        if not sock.exists():
            raise ReplicatorUnavailableError(
                f"no replicator serves {self.root} (no {sock}): cannot reach other tiers")
        # Manifests of large steps exceed gRPC's default 4 MiB (a block crc32c per MiB of shard data).
        ch = grpc.insecure_channel(f"unix:{sock}", options=[
            ("grpc.max_receive_message_length", layout.MAX_MANIFEST_BYTES + (1 << 20))])
        return ch, control_pb2_grpc.LocalControlStub(ch)

    def _call(self, method: str, request: object, timeout: float) -> object:
        ch, stub = self._stub()
        try:
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            msg = f"replicator of {self.root}: {method}: {e.details() if hasattr(e, 'details') else e}"
            if code == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(msg) from None
            if code == grpc.StatusCode.UNAVAILABLE:  # its socket is there, nobody answers: restarting
                raise ReplicatorUnavailableError(msg) from None
            raise OSError(msg) from None
        finally:
            ch.close()

    def locate(self, step: int) -> tuple[tuple[int, ...], int]:
        hit = self.located.get(step)
        if hit is not None:
            return hit
        resp = self._call("LocateStep", control_pb2.LocalLocateRequest(step=step), LOCATE_TIMEOUT_SECONDS)
        self.located[step] = found = (tuple(resp.savers), int(resp.generation))
        return found

    def manifest(self, owner: int, step: int, min_generation: int = 0) -> layout.StepManifest:
        hit = self.manifests.get((owner, step))
        if hit is not None and hit.generation >= min_generation:
            return hit
        resp = self._call("FetchStep", control_pb2.FetchStepRequest(owner_rank=owner, step=step, manifest_only=True,
                                                                    timeout_seconds=self.timeout,
                                                                    min_generation=min_generation),
                          self.timeout + 5)
        self.manifests[(owner, step)] = m = layout.parse_manifest(resp.manifest_json)
        return m

    def fetch_files(self, owner: int, step: int, files: Sequence[layout.FileEntry],
                    pieces: Sequence[layout.FilePiece] = ()) -> Path:
        """Bring only ``files`` of ``owner``'s ``step`` into a new scratch directory of this process under
        ``<root>/fetch`` (each verified by its crc32c before it gets its name); the caller removes it with
        ``commit.remove_owned_dir`` once read. ``pieces``: only these byte ranges of them, where the tier can
        send ranges (a peer), each verified alike; else the whole files."""
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        try:
            rel = dest.relative_to(self.root).as_posix()
            req = control_pb2.FetchFilesRequest(
                owner_rank=owner, step=step, dest_dir=rel, timeout_seconds=self.timeout,
                files=[control_pb2.StepFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in files],
                pieces=[control_pb2.FilePiece(name=pc.name, offset=pc.offset, length=pc.length, crc32c=pc.crc32c)
                        for pc in pieces])
            resp = self._call("FetchFiles", req, self.timeout + 5)
        except BaseException:
            commit.remove_owned_dir(dest)
            raise
        log.debug("%d files of rank %d step %d from %s", len(files), owner, step, resp.source)
        return dest

    def stream(self, owner: int, step: int) -> Landing:
        """``owner``'s ``step`` as the replicator brings it here (``StreamStep``): readable while it lands.

        Returns once the replicator has named the copy (its manifest, where it is written); a thread then
        follows the stream until the copy is committed or fails (:meth:`Landing.close` stops it)."""
        ch, stub = self._stub()
        call = stub.StreamStep(control_pb2.FetchStepRequest(owner_rank=owner, step=step,
                                                            timeout_seconds=self.timeout), timeout=self.timeout + 5)
        try:
            first = next(call)
            manifest = layout.StepManifest.from_json(first.manifest_json)
            out = Landing(self.root, manifest, first.tmp_dir, first.step_dir, first.part_suffix,
                          timeout_seconds=self.timeout, close=call.cancel)
        except StopIteration:
            ch.close()
            raise OSError(f"replicator of {self.root}: StreamStep ended without an answer") from None
        except grpc.RpcError as e:
            ch.close()
            msg = f"replicator of {self.root}: StreamStep: {e.details() if hasattr(e, 'details') else e}"
            if hasattr(e, "code") and e.code() == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(msg) from None
            raise OSError(msg) from None
        except BaseException:
            call.cancel()
            ch.close()
            raise
        out.update(landed_map(first.landed), first.committed)
        if first.committed:
            call.cancel()
            ch.close()
            return out

        def follow() -> None:
            try:
                for msg in call:
                    out.update(landed_map(msg.landed), msg.committed)
                    if msg.committed:
                        return
                out.fail("the replicator's stream ended before the copy was committed")
            except grpc.RpcError as e:
                out.fail(f"{e.code().name if hasattr(e, 'code') else ''} "
                         f"{e.details() if hasattr(e, 'details') else e}".strip())
            finally:
                ch.close()

        threading.Thread(target=follow, name="mtc-landing", daemon=True).start()
        return out

    def fetch(self, owner: int, step: int, replace: bool = False) -> Path:
        resp = self._call("FetchStep", control_pb2.FetchStepRequest(owner_rank=owner, step=step, replace_local=replace,
                                                                    timeout_seconds=self.timeout), self.timeout + 5)
        d = layout.resolve_under(self.root, resp.step_dir)
        return d


def _quick(root: Path, method: str, request: object, timeout: float = 2.0) -> object | None:
    sock = layout.control_socket(root)
    if not sock.exists():
        return None
    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            return getattr(control_pb2_grpc.LocalControlStub(ch), method)(request, timeout=timeout)
    except grpc.RpcError as e:
        log.debug("replicator not reachable on %s: %s", sock, e)
        return None


@dataclasses.dataclass(frozen=True)
class PreemptionNotice:
    """One host's answer to "is there a preemption notice": ``job``: the job has one (this host's, or another
    host's the coordinator told of); ``this_host``: this host's own process got it (its preStop hook or its
    SIGTERM). Both False when the replicator does not answer."""

    job: bool = False
    this_host: bool = False

    def to_wire(self) -> list[bool]:
        return [self.job, self.this_host]

    @classmethod
    def from_wire(cls, data: Any) -> PreemptionNotice:
        job, this_host = data
        return cls(bool(job), bool(this_host))


def preemption_notice(root: Path) -> PreemptionNotice:
    """What the host's replicator knows of a preemption notice (its own, or another host's)."""
    resp = _quick(root, "GetPreemption", control_pb2.GetPreemptionRequest())
    if resp is None:
        return PreemptionNotice()
    return PreemptionNotice(job=bool(resp.noticed), this_host=bool(resp.this_host))


def backup_now(root: Path) -> bool:
    """Ask the host's replicator to back the newest complete step up now; True when it answered."""
    return _quick(root, "BackupNow", control_pb2.BackupNowRequest()) is not None


def replicator_rank(root: Path) -> int | None:
    """The rank the replicator serving ``root`` serves, or None when none answers (not started, restarting)."""
    resp = _quick(root, "GetLocalStatus", control_pb2.GetLocalStatusRequest())
    return None if resp is None else int(resp.rank)


def wait_for_replicator(root: Path, timeout_seconds: float = REPLICATOR_WAIT_SECONDS,
                        poll_seconds: float = REPLICATOR_POLL_SECONDS) -> float:
    """Block until the replicator serving ``root`` answers on its control socket; the seconds waited.

    The multi-controller JobSet starts the training container together with its replicator sidecar, not once
    the replicator serves (docs/deploy.md): a trainer that decided before its replicator served would take a
    RAM disk a restart emptied for "no checkpoint" and a step held on a peer or in the bucket for unreachable.
    A socket left by a replicator that died answers nothing and is waited through. :class:`TimeoutError`
    naming the socket after ``timeout_seconds``."""
    sock = layout.control_socket(root)
    t0 = time.monotonic()
    deadline = t0 + timeout_seconds
    while True:
        if _quick(root, "GetLocalStatus", control_pb2.GetLocalStatusRequest(),
                  timeout=max(poll_seconds, min(2.0, deadline - time.monotonic()))) is not None:
            return time.monotonic() - t0
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no replicator answered on {sock} within {timeout_seconds:g}s: the host's "
                               "mtc-replicator (the Pod's sidecar) is not running or not serving this directory "
                               "(see its log)")
        time.sleep(poll_seconds)
