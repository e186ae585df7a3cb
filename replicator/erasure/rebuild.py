"""Rebuild this host's own rank's data of a step from its code group (a ``RestoreSource`` of tier
``TIER_PARITY``), pipelined along chains of the other members (:mod:`replicator.erasure.pipeline`), spread
over them (:mod:`replicator.erasure.spread`) or decoded here.

It reads the parity holders' ``GROUP.json`` (their crc32c rows merged), then has each of this rank's K shards
decoded from the intact fragments of the other members (every fragment and every rebuilt fragment is checked
against its crc32c), unpacks the stream into a temporary step directory (every file checked against its
crc32c, the manifest's content hash against the group's), and commits it as this rank's step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from replicator.erasure.host import EcHost, GroupReads, open_group, task_links
from replicator.erasure.pipeline import PipelineError, pipeline_stream
from replicator.erasure.spread import SpreadError, spread_stream
from replicator.erasure.stream import unpack_stream
from replicator.erasure.wire import CodeGroupSpec
from sidecar import commit, faults, layout
from sidecar.layout import ManifestError, StepManifest

log = logging.getLogger(__name__)


def _mid_point(pieces: Iterator[memoryview]) -> Iterator[memoryview]:
    """``pieces`` with the ``ec.rebuild.mid`` fault point once the first one is written (the rest still to come)."""
    for i, piece in enumerate(pieces):
        if i == 1:
            faults.point("ec.rebuild.mid")
        yield piece


def _helped_modes(host: EcHost, step: int, g: GroupReads) -> list[tuple[str, Callable[..., Iterator[memoryview]]]]:
    """The rebuild modes to try before decoding here, in order: pipelined, then spread (``host.pipeline``,
    ``host.spread``); none, said in a warning, when fewer than two other parity holders answered."""
    if not host.spread:
        return []
    if len(g.holders) < 2:
        log.warning("rebuild of rank %d step %d: %d other parity holder(s) answered (%s), a pipelined or spread "
                    "rebuild needs two: decoding it here", host.rank, step, len(g.holders), list(g.holders))
        return []
    modes: list[tuple[str, Callable[..., Iterator[memoryview]]]] = [("spread", spread_stream)]
    return [("pipelined", pipeline_stream), *modes] if host.pipeline else modes


def rebuild_own(host: EcHost, step: int, group: CodeGroupSpec) -> StepManifest:
    """Rebuild this rank's data of ``step`` from ``group``'s other members and commit it as its own step.

    Pipelined (``host.pipeline``, :mod:`replicator.erasure.pipeline`: along chains of the other members) when
    two or more other parity holders answer, else, or if that fails for any reason, spread (``host.spread``,
    :mod:`replicator.erasure.spread`) over them, so this host receives each rebuilt byte once; if that fails
    too, or fewer than two answered (a warning says so), decoded here from the K fragments of each stripe.
    The final log line names the mode that ran (its record's ``rebuild_mode``: pipelined, spread or here).
    NotEnoughFragmentsError when some stripe has fewer than K intact fragments (too many members lost, unreachable or corrupt); ChecksumError / ManifestError when what was rebuilt does
    not verify; nothing is committed then. FileExistsError when the step is committed here already."""
    lay = group.layout
    pos = lay.position(host.rank)
    expected = group.content_hashes[pos]
    final = host.own_step_dir(step)
    if (final / layout.MANIFEST_NAME).is_file():
        raise FileExistsError(f"step directory {final} already exists")
    t0 = time.monotonic()
    how = "here (each stripe from K fragments)"
    with task_links(host) as links:
        g = open_group(host, step, group, links, lost={host.rank})
        manifest, dec = g.manifest, g.decoder

        def unpacked(pieces: Iterator[memoryview]) -> tuple[StepManifest, Path]:
            tmp = commit.make_tmp_dir(final.parent, step)
            try:
                with contextlib.closing(pieces):  # read-ahead threads and helper streams end here
                    m = unpack_stream(_mid_point(pieces), manifest.manifest_bytes[pos], manifest.stream_bytes[pos],
                                      tmp)
                if (m.rank, m.step, m.content_hash) != (host.rank, step, expected):
                    raise ManifestError(f"rebuilt manifest of rank {m.rank} step {m.step} ({m.content_hash[:12]}), "
                                        f"the code group names rank {host.rank} step {step} ({expected[:12]})")
            except BaseException:
                commit.remove_owned_dir(tmp)
                raise
            return m, tmp

        got: tuple[StepManifest, Path] | None = None
        modes = _helped_modes(host, step, g)
        for n, (mode, stream) in enumerate(modes):
            try:
                got = unpacked(stream(host, step, group, g, links))
                how = f"{mode} over ranks {list(g.holders)}"
                break
            except (PipelineError, SpreadError, OSError, ValueError) as e:
                log.warning("%s rebuild of rank %d step %d failed (%s); rebuilding it %s", mode, host.rank, step, e,
                            modes[n + 1][0] if n + 1 < len(modes) else "here")
        if got is None:
            got = unpacked(dec.stream(host.rank))
        m, tmp = got
        try:
            commit.commit_dir(tmp, final)
        except BaseException:
            commit.remove_owned_dir(tmp)
            raise
        moved = links.bytes
    if dec.corrupt or dec.unreadable:
        log.warning("rebuild of step %d passed over corrupt fragments %s and unreadable ones %s", step,
                    dec.corrupt[:8], dec.unreadable[:8])
    dt = max(time.monotonic() - t0, 1e-9)
    log.info("rebuilt rank %d step %d from its code group (ec:%d+%d, lost %s, rebuild mode %s): %d bytes from %d "
             "read in %.3fs (%.1f MiB/s)", host.rank, step, lay.k, lay.m, sorted(dec.lost | {host.rank}), how,
             m.total_bytes, moved, dt, m.total_bytes / dt / 2**20, extra={"rebuild_mode": how.split()[0]})
    return m
