"""Property tests of every gRPC method (Peer, Coordinator, LocalControl) against real servers on loopback.

Requests are built from the proto descriptors with hypothesis strategies (every field, nested messages and
repeated fields, hostile names and extreme numbers). For each request the servers must answer with a
result or a clear status (never UNKNOWN / INTERNAL: an unhandled exception), write nothing outside the RAM
directories, list no broken step, and keep serving (health check and a real call afterwards).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as _d
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtc_rpc import control_pb2, coordinator_pb2, peer_pb2
from replicator.daemon import Replicator
from replicator.options import ReplicatorOptions
from sidecar import layout
from tests.crash import kit

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CALL_TIMEOUT_SECONDS = 5.0
# A clear answer: anything but an unhandled exception (UNKNOWN/INTERNAL) or a server gone (UNAVAILABLE).
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DATA_LOSS,
         grpc.StatusCode.ABORTED}

HOSTILE_NAMES = ["../../etc/passwd", "/etc/passwd", "a/../../b", layout.MANIFEST_NAME, "\x00", ".", "..", "",
                 "steps/1/MANIFEST.json", "0.0.bin", "1.0.bin", "x" * 5000, "peer/1/../../../x"]
# Addresses a forged report may carry: loopback or garbage only (the fuzzer must not reach the network).
ADDRESSES = ["", "127.0.0.1:1", "127.0.0.1:0", "[::1]:1", "not an address", "localhost:99999", "unix:/nonexistent",
             "127.0.0.1:-5", ":::::"]


# --------------------------------------------------------------------------- strategies from descriptors

def _int_strategy(bits: int, signed: bool) -> st.SearchStrategy[int]:
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = [v for v in (-1, 0, 1, 2, 3, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1) if lo <= v <= hi]
    return st.one_of(st.integers(max(lo, -2), min(hi, 12)), st.sampled_from(edges), st.integers(lo, hi))


def _field(f: _d.FieldDescriptor, depth: int) -> st.SearchStrategy:
    t = f.type
    if f.name in ("address", "source_address", "holder_address"):
        return st.sampled_from(ADDRESSES)
    if f.name == "wait_seconds":
        # Bounded: long waits holding server threads are issue #12 item 4 (the coordinator's), not fuzzed here.
        return st.one_of(st.floats(-2.0, 0.3), st.sampled_from([math.nan, -math.inf, 0.0]))
    if t in (f.TYPE_INT64, f.TYPE_SINT64, f.TYPE_SFIXED64):
        return _int_strategy(64, True)
    if t in (f.TYPE_INT32, f.TYPE_SINT32, f.TYPE_SFIXED32):
        return _int_strategy(32, True)
    if t in (f.TYPE_UINT64, f.TYPE_FIXED64):
        return _int_strategy(64, False)
    if t in (f.TYPE_UINT32, f.TYPE_FIXED32):
        return _int_strategy(32, False)
    if t in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=64 if t == f.TYPE_DOUBLE else 32)
    if t == f.TYPE_BOOL:
        return st.booleans()
    if t == f.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(HOSTILE_NAMES + ["t", "local", "peer", "bucket"]))
    if t == f.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == f.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [999])
    if t == f.TYPE_MESSAGE:
        return message_strategy(f.message_type, depth + 1)
    raise AssertionError(f"unhandled field type {t} of {f.full_name}")


def message_strategy(desc: _d.Descriptor, depth: int = 0) -> st.SearchStrategy:
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    fields = {}
    for f in desc.fields:
        s = _field(f, depth)
        if f.is_repeated:
            s = st.lists(s, max_size=4 if depth else 6)
        fields[f.name] = s
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def _methods(module, service: str) -> list[_d.MethodDescriptor]:
    return list(module.DESCRIPTOR.services_by_name[service].methods)


PEER = _methods(peer_pb2, "Peer")
COORDINATOR = _methods(coordinator_pb2, "Coordinator")
# Preempt is the preStop hook's notice: any request to it, by design, starts the preemption flush and records
# it (preemption.json), so "a fuzzed request changes nothing" cannot hold for it; the preemption timeline
# tests (tests/deploy/test_preemption_timeline.py) cover it. Every other local method is fuzzed.
CONTROL = [m for m in _methods(control_pb2, "LocalControl") if m.name != "Preempt"]


# --------------------------------------------------------------------------- real servers

class Servers:
    """Two in-process replicators (rank 0 also serves the coordinator), each with committed steps."""

    def __init__(self, base: Path):
        self.base = base
        self.daemons: list[Replicator] = []
        for rank in (0, 1):
            root = self.ram(rank)
            for step in (1, 2):
                kit.save_step(root, rank, 2, step)
        coord = ""
        for rank in (0, 1):
            opts = ReplicatorOptions(local_dir=self.ram(rank), listen="127.0.0.1:0", job="t", rank=rank, nodes=2,
                                     coordinator=coord, heartbeat_seconds=0.2, rpc_timeout_seconds=5,
                                     transfer_timeout_seconds=10, bulk_priority="normal").validate()
            d = Replicator(opts, rank=rank, nodes=2, job="t")
            d.start()
            self.daemons.append(d)
            coord = coord or d.address
        self.channel = grpc.insecure_channel(self.daemons[0].address)
        self.control = grpc.insecure_channel(f"unix:{layout.control_socket(self.ram(0))}")
        self.outside = self._outside()

    def ram(self, rank: int) -> Path:
        return self.base / "ram" / str(rank)

    def _outside(self) -> set[str]:
        """Every path under the sandbox that is not inside a RAM directory."""
        out = set()
        for dirpath, dirnames, filenames in os.walk(self.base):
            rel = Path(dirpath).relative_to(self.base)
            if rel.parts[:1] == ("ram",) and len(rel.parts) >= 2:
                continue
            out.update(str(rel / n) for n in dirnames + filenames)
        return out

    def check(self) -> None:
        """Still serving, nothing written outside the RAM directories, nothing broken listed."""
        for ch in (self.channel,):
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        ch = self.channel
        ch.unary_unary(f"/{PEER[0].containing_service.full_name}/ListSteps", request_serializer=peer_pb2.ListStepsRequest.SerializeToString,
                       response_deserializer=peer_pb2.ListStepsResponse.FromString)(
            peer_pb2.ListStepsRequest(), timeout=5)
        self.control.unary_unary(f"/{CONTROL[0].containing_service.full_name}/GetLocalStatus",
                                 request_serializer=control_pb2.GetLocalStatusRequest.SerializeToString,
                                 response_deserializer=control_pb2.GetLocalStatusResponse.FromString)(
            control_pb2.GetLocalStatusRequest(), timeout=5)
        assert self._outside() == self.outside
        for rank in (0, 1):
            kit.check_nothing_broken(self.ram(rank), rank)
            allowed = {layout.STEPS_DIR, layout.PEER_DIR, layout.CONTROL_SOCKET, "replica-of.json"}
            assert {p.name for p in self.ram(rank).iterdir()} <= allowed

    def stop(self) -> None:
        self.channel.close()
        self.control.close()
        for d in self.daemons:
            d.stop(grace_seconds=0.5)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    base = Path(tempfile.mkdtemp(prefix="mtc-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    s = Servers(base)
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(base, ignore_errors=True)


def _call(channel: grpc.Channel, method: _d.MethodDescriptor, request, raw: bool = False) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    out_cls = message_factory.GetMessageClass(method.output_type)
    ser = (lambda b: b) if raw else type(request).SerializeToString
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path, request_serializer=ser, response_deserializer=out_cls.FromString)
            for _ in stream(request, timeout=CALL_TIMEOUT_SECONDS):
                pass
        else:
            channel.unary_unary(path, request_serializer=ser, response_deserializer=out_cls.FromString)(
                request, timeout=CALL_TIMEOUT_SECONDS)
    except grpc.RpcError as e:
        code = e.code()
        if raw and code == grpc.StatusCode.INTERNAL and "deserializ" in (e.details() or "").lower():
            return  # grpc's own answer to bytes that are no protobuf message
        if code == grpc.StatusCode.UNAVAILABLE and "try the next candidate" in (e.details() or ""):
            return  # the coordinator's deliberate redirect (a caller of another node count, Orbax mode)
        assert code in CLEAR, f"{path}: {code.name} {e.details()!r} for {request!r}"[:2000]


@pytest.mark.parametrize("method", PEER + COORDINATOR, ids=lambda m: f"{m.containing_service.name}.{m.name}")
@SETTINGS
@given(data=st.data())
def test_fuzzed_requests(servers: Servers, method: _d.MethodDescriptor, data) -> None:
    request = data.draw(message_strategy(method.input_type), label="request")
    _call(servers.channel, method, request)
    servers.check()


@pytest.mark.parametrize("method", CONTROL, ids=lambda m: f"{m.containing_service.name}.{m.name}")
@SETTINGS
@given(data=st.data())
def test_fuzzed_local_control(servers: Servers, method: _d.MethodDescriptor, data) -> None:
    request = data.draw(message_strategy(method.input_type), label="request")
    _call(servers.control, method, request)
    servers.check()


def test_a_wait_as_long_as_the_call_deadline_is_answered_before_it(servers: Servers) -> None:
    """A fetch asking to wait as long as (or longer than) its caller's deadline gets the server's answer before
    that deadline, never DEADLINE_EXCEEDED with nothing (found by the fuzzer: timeout_seconds 5 under a 5 s
    call, for a generation of step 1 that never comes)."""
    m = next(x for x in CONTROL if x.name == "FetchStep")
    request = control_pb2.FetchStepRequest(step=1, manifest_only=True, timeout_seconds=CALL_TIMEOUT_SECONDS + 5,
                                           min_generation=99)  # never reached: the server waits as long as it may
    _call(servers.control, m, request)
    servers.check()


@pytest.mark.parametrize("method", PEER + COORDINATOR + CONTROL,
                         ids=lambda m: f"{m.containing_service.name}.{m.name}")
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_raw_bytes(servers: Servers, method: _d.MethodDescriptor, raw: bytes) -> None:
    channel = servers.control if method.containing_service.name == "LocalControl" else servers.channel
    _call(channel, method, raw, raw=True)
    servers.check()


# --------------------------------------------------------------------------- bearer token under fuzz

TOKEN = "s3cret-token-for-the-fuzzer"


@pytest.fixture(scope="module")
def token_server() -> Iterator[tuple[Replicator, Path]]:
    base = Path(tempfile.mkdtemp(prefix="mtc-fuzz-token-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    (base / "token").write_text(TOKEN)
    kit.save_step(base / "ram", 0, 1, 1)
    opts = ReplicatorOptions(local_dir=base / "ram", listen="127.0.0.1:0", job="t", rank=0, nodes=1,
                             token_file=str(base / "token"), heartbeat_seconds=0.2, rpc_timeout_seconds=5,
                             bulk_priority="normal").validate()
    d = Replicator(opts, rank=0, nodes=1, job="t")
    d.start()
    try:
        yield d, base
    finally:
        d.stop(grace_seconds=0.5)
        shutil.rmtree(base, ignore_errors=True)


_printable = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)


@settings(max_examples=40, deadline=None)
@given(key=st.sampled_from(["authorization", "x-token", "authorization-bin"]), value=_printable,
       method=st.sampled_from(PEER + COORDINATOR))
def test_forged_credentials_are_unauthenticated(token_server, key: str, value: str, method) -> None:
    d, base = token_server
    before = sorted(str(p.relative_to(base)) for p in base.rglob("*"))
    meta = [(key, value.encode() if key.endswith("-bin") else value)]
    path = f"/{method.containing_service.full_name}/{method.name}"
    cls = message_factory.GetMessageClass(method.input_type)
    out = message_factory.GetMessageClass(method.output_type)
    with grpc.insecure_channel(d.address) as ch:
        call = (ch.unary_stream if method.server_streaming else ch.unary_unary)(
            path, request_serializer=cls.SerializeToString, response_deserializer=out.FromString)
        with pytest.raises(grpc.RpcError) as e:
            result = call(cls(), timeout=CALL_TIMEOUT_SECONDS, metadata=meta)
            if method.server_streaming:
                list(result)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert sorted(str(p.relative_to(base)) for p in base.rglob("*")) == before
