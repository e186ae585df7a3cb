"""TaskRunner.once: the single-flight of a step's data between copy tasks, restores and sidecar fetches."""

from __future__ import annotations

import threading

import pytest

from replicator.metrics import HostCounters
from replicator.tasks import TaskRunner
from sidecar import layout

MANIFEST = layout.StepManifest(job="t", step=5, rank=0, nodes=2, files=())


def _runner() -> TaskRunner:
    return TaskRunner(threads=1, bulk_priority=0, backoff_base_seconds=0.1, wait_seconds=10.0,
                      counters=HostCounters(), on_success=lambda: None)


def test_a_waiter_whose_concurrent_fetch_failed_fetches_itself() -> None:
    """A copy task's fetch failed (its peer restarting): the restore that waited for it tries on its own
    instead of failing over to a slower tier."""
    tasks = _runner()
    held: list[layout.StepManifest] = []
    leading, release = threading.Event(), threading.Event()

    def failing() -> layout.StepManifest:
        leading.set()
        release.wait(10)
        raise ConnectionError("peer unreachable")

    def working() -> layout.StepManifest:
        held.append(MANIFEST)
        return MANIFEST

    errors: list[BaseException] = []

    def leader() -> None:
        try:
            tasks.once(0, 5, None, failing, lambda: held[0] if held else None)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=leader)
    t.start()
    assert leading.wait(10)
    threading.Timer(0.2, release.set).start()
    assert tasks.once(0, 5, None, working, lambda: held[0] if held else None) == MANIFEST
    t.join(10)
    assert [type(e) for e in errors] == [ConnectionError] and held == [MANIFEST]


def test_a_waiter_gives_up_after_its_own_attempt_fails_too() -> None:
    tasks = _runner()

    def failing() -> layout.StepManifest:
        raise ConnectionError("peer unreachable")

    with pytest.raises(ConnectionError):
        tasks.once(0, 5, None, failing, lambda: None)
    # Nothing left behind: the next caller leads.
    assert tasks.once(0, 5, None, lambda: MANIFEST, lambda: None) == MANIFEST
