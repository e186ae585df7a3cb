"""`mtc status` / `mtc steps` show the job's redundancy (GetSummaryResponse.redundancy), "" as unknown.

The coordinator does not fill the field yet (issue #35): a real gRPC Admin server on loopback answers with
the values under test, and the real CLI reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from controller_client.admin.common import redundancy_text
from controller_client.cli import main
from mtc_rpc import admin_pb2 as pb
from mtc_rpc import admin_pb2_grpc, coordinator_pb2
from replicator.net import rpc


class _Admin(admin_pb2_grpc.AdminServicer):
    redundancy = ""

    def GetSummary(self, request: pb.GetSummaryRequest, context: grpc.ServicerContext) -> pb.GetSummaryResponse:
        return pb.GetSummaryResponse(job="j", nodes=6, hosts_registered=6, newest_complete_step=4,
                                     newest_redundant=True, restore_target=-1, newest_backup_step=-1,
                                     backup_in_progress_step=-1, redundancy=self.redundancy)

    def ListSteps(self, request: pb.ListStepsRequest, context: grpc.ServicerContext) -> pb.ListStepsResponse:
        return pb.ListStepsResponse(job="j", nodes=6, newest_complete_step=4, steps=[
            pb.StepInfo(step=4, complete=True, redundant=True, local_ranks=list(range(6)))])


@pytest.fixture
def admin() -> Iterator[tuple[_Admin, str]]:
    servicer = _Admin()
    server, port = rpc.create_server("127.0.0.1:0", [(admin_pb2_grpc.add_AdminServicer_to_server, servicer)])
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.mark.parametrize(("spec", "shown"), [
    ("copies:1", "copies:1 (survives 1 lost host)"),
    ("copies:2", "copies:2 (survives 2 lost hosts)"),
    ("ec:4+2", "ec:4+2 (survives 2 lost hosts per code group)"),
    ("ec:3+1", "ec:3+1 (survives 1 lost host per code group)"),
    ("", "unknown"),
])
def test_status_and_steps_show_it(admin: tuple[_Admin, str], capsys: pytest.CaptureFixture[str], spec: str,
                                  shown: str) -> None:
    servicer, address = admin
    servicer.redundancy = spec
    assert main(["status", "--coordinator", address]) == 0
    assert shown in capsys.readouterr().out
    assert main(["status", "--coordinator", address, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["redundancy"] == (spec or None)
    assert main(["steps", "--coordinator", address]) == 0
    assert f"job j ({spec or 'redundancy unknown'}): steps by tier" in capsys.readouterr().out
    assert main(["steps", "--coordinator", address, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["redundancy"] == (spec or None)


def test_odd_values() -> None:
    assert redundancy_text("copies:0").startswith("copies:0 (no peer copy")
    assert redundancy_text("lrc:6+2+2") == "lrc:6+2+2"  # a newer coordinator's mode: shown as it is


def test_the_coordinator_status_carries_the_field() -> None:
    """GetStatusResponse.redundancy (23): the coordinator's own status message, for the hosts and the manager."""
    field = coordinator_pb2.GetStatusResponse.DESCRIPTOR.fields_by_name["redundancy"]
    assert field.number == 23 and field.type == field.TYPE_STRING
    assert pb.GetSummaryResponse.DESCRIPTOR.fields_by_name["redundancy"].number == 24
