"""`mtc status --jobset`'s reading of a JobSet object (the live API is exercised by tests/cluster)."""

from __future__ import annotations

from controller_client.admin.jobset import state_of


def _js(conditions: list[dict], **status: int) -> dict:
    return {"metadata": {"name": "train", "namespace": "ml"}, "spec": {"failurePolicy": {"maxRestarts": 3}},
            "status": {"conditions": conditions, **status}}


def test_a_failed_jobset_says_why_and_counts() -> None:
    st = state_of(_js([{"type": "Failed", "status": "True", "reason": "ReachedMaxRestarts",
                        "message": "jobset failed due to reaching max number of restarts"}],
                      restarts=5, restartsCountTowardsMax=3))
    assert st.failed and (st.state, st.reason, st.restarts, st.restarts_counted, st.max_restarts) == (
        "Failed", "ReachedMaxRestarts", 5, 3, 3)
    assert "ReachedMaxRestarts" in st.text() and "3/3 counted" in st.text()


def test_a_running_jobset_and_false_conditions() -> None:
    st = state_of(_js([{"type": "Failed", "status": "False"}, {"type": "StartupPolicyCompleted", "status": "True"}]))
    assert (st.state, st.reason, st.failed, st.restarts) == ("Running", "", False, 0)
    done = state_of(_js([{"type": "Completed", "status": "True", "reason": "AllJobsCompleted"}]))
    assert (done.state, done.failed) == ("Completed", False)
