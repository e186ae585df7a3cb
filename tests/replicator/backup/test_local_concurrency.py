"""file:// store shared by several processes (replicators of one job): writes never lose their folder."""

import multiprocessing as mp
import uuid

from replicator.backup.storage import open_store


def _hammer(root: str, n: int, q) -> None:  # type: ignore[no-untyped-def]
    store = open_store(root)
    errors = []
    for _ in range(n):
        name = f"job/sub/.probe-{uuid.uuid4().hex[:8]}"
        try:
            store.write(name, b"1", create_only=True)
            store.delete(name)  # prunes the now-empty folders, racing the others' writes
        except Exception as e:  # collected and asserted on below
            errors.append(f"{type(e).__name__}: {e}")
    q.put(errors)


def test_concurrent_write_and_prune_in_one_folder(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), 400, q)) for _ in range(4)]
    for p in procs:
        p.start()
    errors = [e for _ in procs for e in q.get(timeout=120)]
    for p in procs:
        p.join(timeout=30)
    assert errors == []
