"""The fault tests' view of erasure coding (``--redundancy ec:K+M``, tests/faults/test_erasure.py): the parity each
host's RAM disk holds (read from the shared filesystem, as the replicator lays it out:
:mod:`replicator.erasure.holder`), whether it verifies, bit rot put into the parity block a rebuild reads first,
and whether a host's restore came from its code group (its replicator's log says where its data came from)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from replicator.erasure.holder import PARITY_DIR, RECORD_NAME, ParityRecord, shard_name
from sidecar import checksums, layout


def listed_parity(root: Path) -> dict[tuple[int, str], Path]:
    """Every committed parity host ``root`` lists: (step, digest) -> its directory (its ``GROUP.json`` exists)."""
    out = {}
    for sd in (Path(root) / PARITY_DIR).glob("*"):
        if layout.parse_step_name(sd.name) is None:
            continue
        for d in sd.glob("*"):
            if not d.name.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX)) and (d / RECORD_NAME).is_file():
                out[(int(sd.name), d.name)] = d
    return out


def newest_parity(root: Path) -> int:
    """The newest step whose parity host ``root`` holds committed (-1: none)."""
    return max((s for s, _ in listed_parity(root)), default=-1)


def parity_record(root: Path, step: int) -> ParityRecord | None:
    """Host ``root``'s parity record of ``step`` (None: it holds none)."""
    found = [d for (s, _), d in listed_parity(root).items() if s == step]
    return ParityRecord.from_json((found[0] / RECORD_NAME).read_bytes()) if found else None


def parity_problems(root: Path, step: int | None = None) -> list[str]:
    """What is wrong with the parity host ``root`` lists (of ``step`` only, when given): each record must parse
    and every shard match its size and crc32c. A parity deleted while read is skipped (GC)."""
    out = []
    for (s, digest), d in listed_parity(root).items():
        if step is not None and s != step:
            continue
        try:
            rec = ParityRecord.from_json((d / RECORD_NAME).read_bytes())
            if (rec.step, rec.digest) != (s, digest):
                out.append(f"{d}: a record of step {rec.step} digest {rec.digest}")
                continue
            for f in rec.files:
                data = (d / f.name).read_bytes()
                if len(data) != f.size or checksums.crc32c(data) != f.crc32c:
                    out.append(f"{d / f.name}: {len(data)} bytes, crc32c {checksums.crc32c(data):08x}, its record "
                               f"says {f.size} bytes, {f.crc32c:08x}")
        except FileNotFoundError:
            continue
        except ValueError as e:
            out.append(f"{d}: {e}")
    return out


def rot_first_read_parity(ram: Callable[[int], Path], lost: int, step: int) -> tuple[int, str, Path]:
    """Flip a byte of the parity block host ``lost``'s rebuild of ``step`` reads first: the first parity fragment of
    the rotation whose data fragment 0 is ``lost``'s (read for that stripe's missing data). Returns (its holder,
    the group's digest, the shard file). ``ram(rank)``: host ``rank``'s RAM dir."""
    rec = parity_record(ram(lost), step)
    if rec is None:
        raise FileNotFoundError(f"host {lost} holds no parity of step {step}")
    lay = rec.group.layout
    rotation = lay.data_rotation(lost, 0)
    holder = lay.holders(rotation)[lay.k]
    shard = listed_parity(ram(holder))[(step, rec.digest)] / shard_name(rotation, 0)
    data = bytearray(shard.read_bytes())
    data[min(100, len(data) - 1)] ^= 0x20
    shard.write_bytes(bytes(data))
    return holder, rec.digest, shard


def rebuilt_from_group(log_text: str, rank: int, step: int, redundancy: str) -> bool:
    """Host ``rank``'s replicator log says its rank's data of ``step`` came from its code group (``redundancy``,
    e.g. "ec:3+1"), by the coordinator's restore task or the sidecar's fetch, not from a copy or the bucket."""
    return re.search(rf"rank {rank} now holds rank {rank}'s data of step {step} \((task|sidecar)\) from code group "
                     rf"{re.escape(redundancy)} ", log_text) is not None
