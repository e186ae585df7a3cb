"""Rebuild this host's own rank's data of a step from its code group (a ``RestoreSource`` of tier
``TIER_PARITY``), spread over the other members (:mod:`replicator.erasure.spread`) or decoded here.

It reads the parity holders' ``GROUP.json`` (their crc32c rows merged), then has each of this rank's K shards
decoded from the intact fragments of the other members (every fragment and every rebuilt fragment is checked
against its crc32c), unpacks the stream into a temporary step directory (every file checked against its
crc32c, the manifest's content hash against the group's), and commits it as this rank's step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from replicator.erasure.host import EcHost, open_group, task_links
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


def rebuild_own(host: EcHost, step: int, group: CodeGroupSpec) -> StepManifest:
    """Rebuild this rank's data of ``step`` from ``group``'s other members and commit it as its own step.

    Spread (``host.spread``, :mod:`replicator.erasure.spread`) over the other parity holders when two or more
    answer, so this host receives each rebuilt byte once; if that fails for any reason, decoded here from the
    K fragments of each stripe. NotEnoughFragmentsError when some stripe has fewer than K intact fragments
    (too many members lost, unreachable or corrupt); ChecksumError / ManifestError when what was rebuilt does
    not verify; nothing is committed then. FileExistsError when the step is committed here already."""
    lay = group.layout
    pos = lay.position(host.rank)
    expected = group.content_hashes[pos]
    final = host.own_step_dir(step)
    if (final / layout.MANIFEST_NAME).is_file():
        raise FileExistsError(f"step directory {final} already exists")
    t0 = time.monotonic()
    how = "here"
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
        if host.spread and len(g.holders) >= 2:
            try:
                got = unpacked(spread_stream(host, step, group, g, links))
                how = f"spread over ranks {list(g.holders)}"
            except (SpreadError, OSError, ValueError) as e:
                log.warning("spread rebuild of rank %d step %d failed (%s); decoding it here", host.rank, step, e)
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
    log.info("rebuilt rank %d step %d from its code group (ec:%d+%d, lost %s, decoded %s): %d bytes from %d read "
             "in %.3fs (%.1f MiB/s)", host.rank, step, lay.k, lay.m, sorted(dec.lost | {host.rank}), how,
             m.total_bytes, moved, dt, m.total_bytes / dt / 2**20)
    return m
