"""Logs: --log-format json with Cloud Logging fields, every line stamped with job, rank and incarnation."""

from __future__ import annotations

import argparse
import io
import json
import logging

import pytest

from replicator import logs
from tests.kits.cluster import manager, save_steps, wait_for


@pytest.fixture
def restore_logging():
    saved = logs.context()
    yield
    logs._context.clear()
    logs._context.update(saved)
    logs.configure("warning")


def test_json_lines_carry_severity_message_and_context(restore_logging) -> None:
    buf = io.StringIO()
    logs.configure("info", "json", stream=buf)
    logs.set_context(job="j", rank=3, incarnation=42)
    logging.getLogger("replicator.x").info("copied %d bytes", 10)
    try:
        raise OSError("disk")
    except OSError:
        logging.getLogger("replicator.x").exception("failed")
    logging.getLogger("replicator.x").debug("hidden at info")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[0]["severity"] == "INFO" and lines[0]["message"] == "copied 10 bytes"
    assert (lines[0]["job"], lines[0]["rank"], lines[0]["incarnation"]) == ("j", 3, 42)
    assert lines[1]["severity"] == "ERROR" and "OSError: disk" in lines[1]["message"]


def test_text_lines_are_stamped_and_flags_and_env_are_read(restore_logging) -> None:
    buf = io.StringIO()
    logs.configure("warning", "text", stream=buf)
    logs.set_context(job="j", rank=1, incarnation=7)
    logging.getLogger("a").warning("hello")
    assert "WARNING job=j rank=1 incarnation=7 a: hello" in buf.getvalue()
    p = argparse.ArgumentParser()
    logs.add_arguments(p)
    assert logs.format_from(p.parse_args([]), {}) == "text"
    assert logs.format_from(p.parse_args([]), {"MTC_LOG_FORMAT": "JSON"}) == "json"
    assert logs.format_from(p.parse_args(["--log-format", "json"]), {"MTC_LOG_FORMAT": "text"}) == "json"
    with pytest.raises(SystemExit):
        p.parse_args(["--log-format", "xml"])


@pytest.mark.slow
def test_daemon_logs_each_save_and_copy_as_json(cluster_factory) -> None:
    cl = cluster_factory(nodes=4, data_parallelism=1, extra=["--log-format", "json"])
    cl.start_all()
    mgr = manager(cl, 1, 4)
    save_steps(mgr, [3], replicated_over_slices=False)

    def lines(rank: int) -> list[dict]:
        text = (cl.base / "logs" / f"replicator-{rank}.log").read_text()
        return [json.loads(x) for x in text.splitlines() if x.startswith("{")]

    def has(rank: int, prefix: str) -> bool:
        return any(x["message"].startswith(prefix) for x in lines(rank))

    wait_for(lambda: all(has(r, "save: rank") for r in range(4)), what="save lines")
    wait_for(lambda: any(has(r, "copy: fetched rank") for r in range(4)), timeout=60, what="copy lines")
    for r in range(4):
        got = lines(r)
        assert got, f"rank {r} logged nothing as JSON"
        stamped = [x for x in got if x.get("rank") == r and x.get("job") == "t" and x.get("incarnation")]
        assert stamped and all(x["severity"] in ("INFO", "WARNING", "ERROR", "DEBUG") for x in got)
        save = next(x for x in got if x["message"].startswith("save: rank"))
        assert "step 3" in save["message"] and "bytes" in save["message"]
    mgr.close()
