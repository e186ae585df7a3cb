"""bench.peer's floor of a peer copy lands the step's files whole, in place (the pages of the previous round's
files are overwritten, not replaced)."""

from __future__ import annotations

import os
from pathlib import Path

from bench import peer


def test_the_floor_lands_every_file_in_place(tmp_path: Path) -> None:
    sizes = [3 << 20, 1, (5 << 20) + 7]
    sources = []
    for i, n in enumerate(sizes):
        sources.append(tmp_path / f"src-{i}")
        sources[-1].write_bytes(os.urandom(n))
    dests = [(tmp_path / f"dst-{i}", n) for i, n in enumerate(sizes)]
    srv, stop, t = peer._serve_files(sources)
    try:
        port = srv.getsockname()[1]
        peer._floor_receive(port, dests)
        inodes = [os.stat(p).st_ino for p, _ in dests]
        for p, _ in dests:  # the next round must overwrite every byte
            p.write_bytes(b"\0" * os.stat(p).st_size)
        peer._floor_receive(port, dests)
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()
    assert [os.stat(p).st_ino for p, _ in dests] == inodes
    for src, (dst, n) in zip(sources, dests, strict=True):
        assert dst.read_bytes() == src.read_bytes()
        assert os.stat(dst).st_size == n
