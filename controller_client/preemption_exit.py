"""The trainer's exit code after a preemption save: how the JobSet learns "resume me", not "I am done".

The rendered JobSets (`mtc manifests`) complete when the training program exits 0 (Pathways: the head's
``controller`` container, the success policy ``All`` on ``head``; multi-controller: every worker Pod).
A program that saved after a preemption notice (``reached_preemption()``) and returned would therefore end
the job Completed with steps left. It exits :data:`PREEMPTED_EXIT_CODE` instead: the Job's
``podFailurePolicy`` turns that exit code into a Job failure with reason ``PodFailurePolicy``, and the
JobSet's first failure-policy rule restarts the JobSet without counting against ``maxRestarts``
(controller_client/manifests_jobsets.py, docs/deploy.md "Failure handling").
"""

from __future__ import annotations

# EX_TEMPFAIL of sysexits.h ("try again later"): distinct from 1 (an error), 2 (usage) and 128 + N (signal N).
PREEMPTED_EXIT_CODE = 75


def exit_code(*, preempted: bool, steps_left: bool = True) -> int:
    """The training program's exit status: 0 when it finished, ``PREEMPTED_EXIT_CODE`` after a preemption save.

    ``preempted``: ``reached_preemption()`` was true when the loop stopped. ``steps_left``: the loop stopped
    before its last step (a notice that comes after the last step changes nothing: the job is done).
    """
    return PREEMPTED_EXIT_CODE if preempted and steps_left else 0
