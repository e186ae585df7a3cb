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


def test_rate_limit_keeps_a_burst_per_template_then_counts_what_it_dropped() -> None:
    now = [0.0]
    f = logs.RateLimitFilter(burst=3, window_seconds=60, clock=lambda: now[0])

    def rec(msg: str, name: str = "grpc._common") -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None)

    passed = [f.filter(rec("Exception deserializing message!")) for _ in range(10)]
    assert passed == [True] * 3 + [False] * 7
    assert f.filter(rec("another template")) and f.filter(rec("Exception deserializing message!", "other"))
    now[0] = 61.0
    r = rec("Exception deserializing message!")
    assert f.filter(r) and "(7 similar lines suppressed in the last 60s)" in r.getMessage()


def test_garbage_protobufs_do_not_flood_the_replicators_log(tmp_path) -> None:
    """Issue #19: 200 garbage requests wrote 200 ERROR tracebacks; now a burst, and the daemon still serves."""
    import signal
    import subprocess
    import sys
    import time

    import grpc

    from mtc_rpc import peer_pb2, peer_pb2_grpc
    from tests.kits.jax_procs import REPO, free_port

    port, err = free_port(), tmp_path / "err"
    proc = subprocess.Popen([sys.executable, "-m", "replicator.main", "--local-dir", str(tmp_path / "ram"),
                             "--rank", "0", "--nodes", "1", "--job", "t", "--listen", f"127.0.0.1:{port}"],
                            stderr=err.open("w"), stdout=subprocess.DEVNULL, cwd=str(REPO))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ram" / "replicator.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            raw = ch.unary_unary("/mtc.v1.Peer/OpenTransfer", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)  # fmt: skip
            for i in range(200):
                with pytest.raises(grpc.RpcError):
                    raw(b"\xff\xff\xff\x0f\x01garbage" + bytes([i]), timeout=5)
            steps = peer_pb2_grpc.PeerStub(ch).ListSteps(peer_pb2.ListStepsRequest(), timeout=5)
            assert list(steps.steps) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    text = err.read_text()
    assert 1 <= text.count("Exception deserializing message!") <= 10, text[-3000:]
