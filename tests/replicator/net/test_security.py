"""Token auth, (mutual) TLS, message bounds and error→status mapping on real gRPC servers on 127.0.0.1."""

from __future__ import annotations

import datetime
import errno
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller_client.demo.ports import free_port as _free_port
from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.net import rpc, security
from replicator.net.security import TlsOptions
from replicator.peer import client as peer_client
from replicator.peer import server as peer_server
from sidecar import checksums, commit, layout
from sidecar.checksums import ChecksumError
from sidecar.layout import FileEntry, ManifestError, StepManifest

TOKEN = "tok-0123456789abcdef"
NODES = 2


def make_step(root: Path, rank: int, step: int, sizes: dict[str, int]) -> StepManifest:
    parent = layout.steps_dir(root)
    tmp = commit.make_tmp_dir(parent, step)
    rng = np.random.default_rng(step)
    entries = []
    for name, size in sizes.items():
        data = rng.integers(0, 256, size, dtype=np.uint8)
        data.tofile(tmp / name)
        entries.append(FileEntry(name, size, checksums.crc32c(data)))
    m = StepManifest(job="t", step=step, rank=rank, nodes=NODES, files=tuple(entries))
    commit.write_manifest(tmp, m)
    commit.commit_dir(tmp, parent / str(step))
    return m


def start_peer(
    root: Path, *, token: str | None = TOKEN, tls: TlsOptions | None = None, data_port: bool = True
) -> tuple[grpc.Server, str, peer_server.TransferServer | None]:
    ts = None
    if data_port:
        ts = peer_server.TransferServer()
        ts.start()
    servicer = peer_server.PeerServicer(root, 0, NODES, transfer_server=ts)
    server, port = rpc.create_server(
        "127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)], token=token, tls=tls
    )
    server.start()
    return server, f"127.0.0.1:{port}", ts


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    root = tmp_path / "src"
    make_step(root, 0, 5, {"a.bin": 1000, "b.bin": 70000})
    server, address, ts = start_peer(root)
    yield address, root
    assert ts is not None
    ts.stop()
    rpc.stop_server(server, 0.5)


def _all_calls(stub: peer_pb2_grpc.PeerStub) -> list[tuple[str, object]]:
    t = rpc.RPC_TIMEOUT_SECONDS
    return [
        ("ListSteps", lambda: stub.ListSteps(peer_pb2.ListStepsRequest(), timeout=t)),
        ("GetManifest", lambda: stub.GetManifest(peer_pb2.GetManifestRequest(rank=0, step=5), timeout=t)),
        ("OpenTransfer", lambda: stub.OpenTransfer(peer_pb2.OpenTransferRequest(rank=0, step=5), timeout=t)),
        ("ReadFiles", lambda: list(stub.ReadFiles(peer_pb2.ReadFilesRequest(rank=0, step=5), timeout=t))),
    ]


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [("authorization", "Bearer wrong")],
        [("authorization", TOKEN)],
        [("authorization", "Basic " + TOKEN)],
        [("authorization", "Bearer " + TOKEN + "x")],
        [("x-token", TOKEN)],
    ],
    ids=["none", "wrong", "no-scheme", "basic", "longer", "other-key"],
)
def test_requests_without_the_token_are_unauthenticated(peer: tuple[str, Path], metadata: object) -> None:
    address, root = peer
    before = sorted(p.name for p in root.rglob("*"))
    with grpc.insecure_channel(address) as ch:
        if metadata is not None:
            ch = grpc.intercept_channel(ch, _StaticMetadata(metadata))  # type: ignore[arg-type]
        stub = peer_pb2_grpc.PeerStub(ch)
        for name, call in _all_calls(stub):
            with pytest.raises(grpc.RpcError) as ei:
                call()  # type: ignore[operator]
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        # Unknown methods are denied the same way, so methods cannot be probed without the token.
        probe = ch.unary_unary("/mtc.v1.Peer/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as ei:
            probe(b"", timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert sorted(p.name for p in root.rglob("*")) == before


class _StaticMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: list[tuple[str, str]]):
        self.metadata = metadata

    def _d(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return security._CallDetails(
            d.method, d.timeout, self.metadata, d.credentials, d.wait_for_ready, d.compression
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._d(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._d(client_call_details), request)


def test_right_token_works_and_health_is_open(peer: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = peer
    with rpc.make_channel(address, token=TOKEN) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for _, call in _all_calls(stub):
            call()  # type: ignore[operator]
        unknown = ch.unary_unary("/mtc.v1.Peer/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as ei:
            unknown(b"", timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(address) as ch:  # no token at all
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "mtc.v1.Peer"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    dest = tmp_path / "d"
    with pytest.raises(grpc.RpcError) as ei:
        peer_client.fetch_step(address, 0, 5, dest, token="not-the-token")
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not dest.exists() or list(dest.iterdir()) == []
    peer_client.fetch_step(address, 0, 5, dest, token=TOKEN)
    checksums.verify_step_dir(dest / "5")


def test_client_message_limit(peer: tuple[str, Path]) -> None:
    address, _ = peer
    with rpc.make_channel(address, token=TOKEN, max_message_bytes=1024) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        with pytest.raises(grpc.RpcError) as ei:  # a 64 KiB chunk exceeds what this client accepts
            list(stub.ReadFiles(peer_pb2.ReadFilesRequest(rank=0, step=5, files=["b.bin"]), timeout=10))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(ValueError):
        rpc.make_channel(address, max_message_bytes=0)


def test_token_and_bearer_helpers(tmp_path: Path) -> None:
    for bad in ("", " padded", "with space", "tab\t", "é", "x" * 5000):
        with pytest.raises(ValueError):
            security.validate_token(bad)
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert security.read_token_file(f) == TOKEN
    assert security.bearer_matches([("authorization", "Bearer " + TOKEN)], TOKEN)
    assert security.bearer_matches([("x", "y"), ("Authorization", b"Bearer " + TOKEN.encode())], TOKEN)
    assert not security.bearer_matches([("authorization", "Bearer " + TOKEN[:-1])], TOKEN)
    assert not security.bearer_matches(None, TOKEN)


def test_status_mapping() -> None:
    S = grpc.StatusCode
    cases = [
        (FileNotFoundError("x"), S.NOT_FOUND),
        (ValueError("x"), S.INVALID_ARGUMENT),
        (ManifestError("x"), S.INVALID_ARGUMENT),
        (ChecksumError("f", 1, 2), S.DATA_LOSS),
        (FileExistsError("x"), S.ALREADY_EXISTS),
        (PermissionError("x"), S.PERMISSION_DENIED),
        (OSError(errno.ENOSPC, "full"), S.RESOURCE_EXHAUSTED),
        (TimeoutError(), S.DEADLINE_EXCEEDED),
        (OSError(errno.EIO, "io"), S.INTERNAL),
        (RuntimeError("x"), S.INTERNAL),
    ]
    for exc, code in cases:
        assert rpc.status_for(exc) == code, exc


# --------------------------------------------------------------------------- TLS


def _write_certs(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: str,
        signer: ec.EllipticCurvePrivateKey,
        ca: bool,
        usage: x509.ObjectIdentifier | None,
    ) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    out = {}
    certs = {"ca": (ca_key, build("mtc-test-ca", ca_key, "mtc-test-ca", ca_key, True, None))}
    for who, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        k = ec.generate_private_key(ec.SECP256R1())
        certs[who] = (k, build(f"mtc-{who}", k, "mtc-test-ca", ca_key, False, usage))
    for who, (k, c) in certs.items():
        out[f"{who}_cert"] = d / f"{who}.crt"
        out[f"{who}_cert"].write_bytes(c.public_bytes(serialization.Encoding.PEM))
        out[f"{who}_key"] = d / f"{who}.key"
        out[f"{who}_key"].write_bytes(
            k.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return out


def test_mutual_tls_round_trip(tmp_path: Path) -> None:
    c = _write_certs(tmp_path)
    root = tmp_path / "src"
    m = make_step(root, 0, 5, {"a.bin": 1000, "b.bin": (3 << 20) + 7})
    server_tls = TlsOptions.from_args(c["server_cert"], c["server_key"], c["ca_cert"])
    client_tls = TlsOptions(c["client_cert"], c["client_key"], c["ca_cert"])
    assert server_tls is not None and server_tls.mutual
    # Under TLS the daemon runs no plaintext data port: the bytes go over the encrypted stream.
    server, address, _ = start_peer(root, tls=server_tls, data_port=False)
    try:
        got = peer_client.fetch_step(address, 0, 5, tmp_path / "d", token=TOKEN, tls=client_tls)
        assert got == m
        checksums.verify_step_dir(tmp_path / "d" / "5")
        # Token is still required on top of TLS.
        with pytest.raises(grpc.RpcError) as ei:
            peer_client.list_steps(address, tls=client_tls)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Mutual TLS: a client without a certificate, or a plaintext client, cannot even connect.
        for tls in (TlsOptions(ca_file=c["ca_cert"]), None):
            with pytest.raises(grpc.RpcError) as ei:
                peer_client.list_steps(address, token=TOKEN, tls=tls, timeout_seconds=5)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        rpc.stop_server(server, 0.5)


def test_tls_without_ca_is_server_auth_only(tmp_path: Path) -> None:
    c = _write_certs(tmp_path)
    root = tmp_path / "src"
    make_step(root, 0, 5, {"a.bin": 10})
    server_tls = TlsOptions(c["server_cert"], c["server_key"])
    assert not server_tls.mutual
    server, address, _ = start_peer(root, tls=server_tls, data_port=False)
    try:
        held = peer_client.list_steps(address, token=TOKEN, tls=TlsOptions(ca_file=c["ca_cert"]))
        assert [(h.owner_rank, h.step) for h in held] == [(0, 5)]
    finally:
        rpc.stop_server(server, 0.5)


def test_tls_options_validation(tmp_path: Path) -> None:
    f = tmp_path / "x.pem"
    f.write_text("x")
    assert TlsOptions.from_args(None, None, None) is None
    with pytest.raises(ValueError, match="together"):
        TlsOptions(cert_file=f)
    with pytest.raises(ValueError, match="does not exist"):
        TlsOptions(f, tmp_path / "missing.key")
    with pytest.raises(ValueError, match="needs"):
        TlsOptions(ca_file=f).server_credentials()


def test_create_server_on_busy_port_fails_clearly(peer: tuple[str, Path]) -> None:
    address, _ = peer
    with pytest.raises(OSError, match="cannot bind"):
        rpc.create_server(address, [])


# --------------------------------------------------------------------------- secure by default (#12.5)


def _run_replicator(tmp_path: Path, *args: str, wait_seconds: float = 3.0,
                    until_serving: bool = False) -> tuple[int | None, str]:
    """Start the real ``mtc-replicator``; (exit code or None if still running after ``wait_seconds``, stderr).

    ``until_serving``: stop waiting (None) as soon as it serves (its control socket exists) and still runs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "replicator.main", "--local-dir", str(tmp_path / "ram"), "--rank", "0",
           "--nodes", "1", "--job", "t", *args]
    sock = tmp_path / "ram" / "replicator.sock"
    sock.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + wait_seconds
        rc = None
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc is not None or (until_serving and sock.exists()):
                break
            time.sleep(0.1)
        if until_serving and rc is None:
            time.sleep(0.5)  # a moment past serving: it does not exit right after binding
            rc = proc.poll()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    return rc, proc.stderr.read() if proc.stderr else ""


def test_replicator_beyond_loopback_without_token_or_tls_refuses_to_start(tmp_path: Path) -> None:
    rc, err = _run_replicator(tmp_path, "--listen", f"0.0.0.0:{_free_port()}", wait_seconds=60)
    assert rc == 2, err
    assert "--insecure" in err and "--token-file" in err
    assert not (tmp_path / "ram" / "replicator.sock").exists()


def test_replicator_beyond_loopback_starts_with_token_or_insecure(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    for extra in (["--token-file", str(token)], ["--insecure"]):
        rc, err = _run_replicator(tmp_path, "--listen", f"0.0.0.0:{_free_port()}", *extra, wait_seconds=60,
                                  until_serving=True)
        assert rc is None, f"{extra}: exited {rc}: {err}"


def test_exposure_rule_in_options(tmp_path: Path) -> None:
    from replicator.options import ConfigError, ReplicatorOptions

    def opts(**kw: object) -> ReplicatorOptions:
        return ReplicatorOptions(local_dir=tmp_path, rank=0, nodes=1, **kw)  # type: ignore[arg-type]

    for listen in ("127.0.0.1:0", "localhost:7070", "[::1]:7070", "127.0.0.2:1"):
        opts(listen=listen).check_exposure()
    for listen in ("0.0.0.0:7070", "[::]:7070", "10.0.0.5:7070", "myhost:7070"):
        with pytest.raises(ConfigError, match="--insecure"):
            opts(listen=listen).check_exposure()
        opts(listen=listen, insecure=True).check_exposure()
        opts(listen=listen, token_file=str(tmp_path / "t")).check_exposure()
