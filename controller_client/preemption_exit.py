"""The trainer's exit code after a preemption save: how the JobSet learns "resume me", not "I am done".

The rendered JobSets (`mtc manifests`) complete when the training program exits 0 (Pathways: the head's
``controller`` container, the success policy ``All`` on ``head``; multi-controller: every worker Pod).
A program that saved after a preemption notice (``reached_preemption()``) and returned would therefore end
the job Completed with steps left. It exits :data:`PREEMPTED_EXIT_CODE` instead, once the step it saved is
durable (:func:`finish_preempted`: a JobSet restart deletes the healthy Pods too, and with them any upload
still running there): the Job's
``podFailurePolicy`` turns that exit code into a Job failure with reason ``PodFailurePolicy``, and the
JobSet's first failure-policy rule restarts the JobSet without counting against ``maxRestarts``
(controller_client/manifests_jobsets.py, docs/deploy.md "Failure handling").
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)

# EX_TEMPFAIL of sysexits.h ("try again later"): distinct from 1 (an error), 2 (usage) and 128 + N (signal N).
PREEMPTED_EXIT_CODE = 75


def exit_code(*, preempted: bool, steps_left: bool = True) -> int:
    """The training program's exit status: 0 when it finished, ``PREEMPTED_EXIT_CODE`` after a preemption save.

    ``preempted``: ``reached_preemption()`` was true when the loop stopped. ``steps_left``: the loop stopped
    before its last step (a notice that comes after the last step changes nothing: the job is done).
    """
    return PREEMPTED_EXIT_CODE if preempted and steps_left else 0


# How long a program waits, after its save on a notice, for that step to be durable before it exits 75: the
# flush share of the rendered default terminationGracePeriodSeconds (60 s: save 18 s, flush 30 s, exit 12 s;
# controller_client/manifests_jobsets.py preemption_budget). The noticed worker's preStop hook keeps its Pod up
# for save + flush from the notice. Scale it with --termination-grace-seconds.
DURABLE_WAIT_SECONDS = 30.0


class Durable(Protocol):
    """What :func:`finish_preempted` needs: ``CheckpointManager`` or ``ElasticCheckpointer``."""

    def backup_now(self, *, wait: bool = ..., timeout_seconds: float = ...) -> object: ...


def finish_preempted(ckpt: Durable, timeout_seconds: float = DURABLE_WAIT_SECONDS) -> int:
    """After the save on a notice: the newest complete step to the bucket at once, waited for up to
    ``timeout_seconds`` (``backup_now(wait=True)``); returns :data:`PREEMPTED_EXIT_CODE` for ``sys.exit``.

    A step that does not get there in time (a backup of an older step still running, a lost host) is logged,
    and the program exits 75 all the same: the grace period is running out, and the restart restores the newest
    step that did (an older one)."""
    try:
        durable = ckpt.backup_now(wait=True, timeout_seconds=timeout_seconds)
    except (TimeoutError, FileNotFoundError) as e:
        log.warning("exiting %d after the preemption save, not durable: %s", PREEMPTED_EXIT_CODE, e)
    else:
        log.info("exiting %d after the preemption save: %s", PREEMPTED_EXIT_CODE, durable)
    return PREEMPTED_EXIT_CODE
