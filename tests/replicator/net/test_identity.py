"""Certificate identities under mutual TLS: the mtc:// naming rule, its parser and the report authorizer."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import coordinator_pb2_grpc as cpb_grpc
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.net import rpc
from replicator.net.security import (
    IdentityError,
    PeerIdentity,
    RankAuthorizer,
    RankIdentityMode,
    TlsOptions,
    admin_identity,
    identity_from_auth_context,
    identity_from_cert_file,
    parse_identity_uri,
    rank_authorizer,
    rank_identity,
)
from tests.kits.certs import CertAuthority


def test_the_naming_rule() -> None:
    assert rank_identity("t", 3).uri == "mtc://t/rank/3"
    assert admin_identity("t").uri == "mtc://t/admin"
    assert parse_identity_uri("mtc://t/rank/3") == PeerIdentity("t", 3)
    assert parse_identity_uri("mtc://t/rank/0") == PeerIdentity("t", 0)
    assert parse_identity_uri("mtc://t/admin") == PeerIdentity("t", None)
    assert parse_identity_uri("mtc://t/admin").is_admin
    # Other schemes are someone else's business (a SPIFFE id, a web address): no identity, no error.
    assert parse_identity_uri("spiffe://cluster.local/ns/x/sa/y") is None
    assert parse_identity_uri("https://example.com/rank/1") is None
    # Job names are percent-encoded in the URI.
    assert rank_identity("my job:1", 2).uri == "mtc://my%20job%3A1/rank/2"
    assert parse_identity_uri("mtc://my%20job%3A1/rank/2") == PeerIdentity("my job:1", 2)


@pytest.mark.parametrize("bad", [
    "mtc://t/rank/-1", "mtc://t/rank/01", "mtc://t/rank/abc", "mtc://t/rank/", "mtc://t/rank/1/x",
    "mtc://t/ranks/1", "mtc:///rank/1", "mtc://t/rank/1?x=2", "mtc://t/rank/1#f", "mtc://t/Admin",
    "mtc://t/rank/1234567890", "MTC://t/rank/x",
])
def test_malformed_mtc_identities_are_errors_not_guesses(bad: str) -> None:
    with pytest.raises(IdentityError, match="not an mtc identity"):
        parse_identity_uri(bad)


@given(job=st.text(min_size=1, max_size=40), rank=st.integers(0, 10**9 - 1))
def test_uri_round_trip(job: str, rank: int) -> None:
    assert parse_identity_uri(rank_identity(job, rank).uri) == PeerIdentity(job, rank)
    assert parse_identity_uri(admin_identity(job).uri) == PeerIdentity(job, None)


def test_identity_from_auth_context_reads_uri_sans() -> None:
    # As grpcio 1.85 fills it for a client certificate (values are bytes).
    ctx = {"transport_security_type": [b"ssl"], "x509_common_name": [b"rank-1"],
           "x509_subject_alternative_name": [b"localhost", b"mtc://t/rank/1", b"127.0.0.1"],
           "peer_uri": [b"mtc://t/rank/1"]}
    assert identity_from_auth_context(ctx) == PeerIdentity("t", 1)
    # Older gRPC without peer_uri: the SAN list alone.
    assert identity_from_auth_context({"x509_subject_alternative_name": [b"mtc://t/admin"]}) == PeerIdentity("t")
    # No certificate, no SANs, only a CN that looks like a rank: no identity (the CN is not trusted).
    assert identity_from_auth_context({}) is None
    assert identity_from_auth_context(None) is None
    assert identity_from_auth_context({"x509_common_name": [b"mtc://t/rank/1"]}) is None
    with pytest.raises(IdentityError, match="several identities"):
        identity_from_auth_context({"peer_uri": [b"mtc://t/rank/1", b"mtc://t/rank/2"]})


def _ctx(*uris: str, cn: str = "host") -> dict[str, list[bytes]]:
    return {"x509_subject": [f"CN={cn}".encode()], "x509_common_name": [cn.encode()],
            "peer_uri": [u.encode() for u in uris], "x509_subject_alternative_name": [u.encode() for u in uris]}


def test_authorizer_binds_reports_to_the_certificates_rank() -> None:
    auth = RankAuthorizer("t", require=True)
    assert auth.refusal(_ctx("mtc://t/rank/1"), 1) is None
    why = auth.refusal(_ctx("mtc://t/rank/1"), 2)
    assert why is not None and "rank 2" in why and "names rank 1" in why
    why = auth.refusal(_ctx("mtc://t/admin"), 0)
    assert why is not None and "administrator" in why
    why = auth.refusal(_ctx("mtc://other/rank/1"), 1)
    assert why is not None and "job 'other'" in why and "job 't'" in why
    why = auth.refusal(_ctx(cn="mtc-host"), 1)
    assert why is not None and "names no rank" in why and "mtc://t/rank/1" in why and "mtc-host" in why
    why = auth.refusal({}, 1)
    assert why is not None and "no client certificate" in why
    why = auth.refusal(_ctx("mtc://t/rank/x"), 1)
    assert why is not None and "not an mtc identity" in why


def test_lenient_authorizer_accepts_only_identityless_certificates_for_any_rank() -> None:
    auth = RankAuthorizer("t", require=False)
    assert auth.refusal(_ctx(cn="mtc-host"), 5) is None  # one certificate for the whole job
    assert auth.refusal(_ctx("mtc://t/rank/1"), 2) is not None  # a named rank is still bound
    assert auth.refusal(_ctx("mtc://t/admin"), 2) is not None
    assert auth.refusal(_ctx("mtc://t/rank/x"), 2) is not None


def test_admin_actions_need_the_admin_identity_only_when_identities_are_required() -> None:
    strict, lenient = RankAuthorizer("t", require=True), RankAuthorizer("t", require=False)
    assert strict.admin_refusal(_ctx("mtc://t/admin"), "Pin") is None
    for ctx in (_ctx("mtc://t/rank/0"), _ctx("mtc://u/admin"), _ctx(cn="mtc-host"), {}, _ctx("mtc://t/x")):
        why = strict.admin_refusal(ctx, "Pin")
        assert why is not None and why.startswith("Pin refused: it needs the job's admin certificate (mtc://t/admin)")
        assert lenient.admin_refusal(ctx, "Pin") is None


def test_own_certificate_decides_auto_mode_and_is_checked(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path)
    r1, plain, admin = ca.issue_rank("t", 1), ca.issue("plain"), ca.issue_admin("t")
    mutual = lambda p: TlsOptions(p.cert, p.key, ca.ca_file)  # noqa: E731
    assert identity_from_cert_file(r1.cert) == PeerIdentity("t", 1)
    assert identity_from_cert_file(plain.cert) is None
    # No TLS, or TLS without a CA (no client certificates): nothing to check, as before.
    assert rank_authorizer(None, "t") is None
    assert rank_authorizer(TlsOptions(r1.cert, r1.key), "t", rank=1) is None
    with pytest.raises(ValueError, match="needs mutual TLS"):
        rank_authorizer(TlsOptions(r1.cert, r1.key), "t", RankIdentityMode.REQUIRE, rank=1)
    # auto: strict when the job issues per-rank certificates (ours names a rank), lenient otherwise.
    assert rank_authorizer(mutual(r1), "t", "auto", rank=1) == RankAuthorizer("t", require=True)
    assert rank_authorizer(mutual(plain), "t", "auto", rank=1) == RankAuthorizer("t", require=False)
    assert rank_authorizer(mutual(plain), "t", "require", rank=1) == RankAuthorizer("t", require=True)
    # A replicator started with a certificate for another rank or job, or an admin one, refuses to start.
    with pytest.raises(ValueError, match="names mtc://t/rank/1 but this replicator is rank 0"):
        rank_authorizer(mutual(r1), "t", rank=0)
    with pytest.raises(ValueError, match="job 't'; this replicator serves job 'u'"):
        rank_authorizer(mutual(r1), "u", rank=1)
    with pytest.raises(ValueError, match="administrator"):
        rank_authorizer(mutual(admin), "t", rank=0)
    with pytest.raises(ValueError):
        RankIdentityMode("sometimes")


def _docs_recipe() -> str:
    text = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text()
    after = text.split("<!-- openssl-recipe", 1)[1]
    return after.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_documented_openssl_recipe_issues_working_rank_certificates(tmp_path: Path) -> None:
    subprocess.run(["bash", "-euo", "pipefail", "-c", _docs_recipe()], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    tls = {n: TlsOptions(tmp_path / f"{n}.crt", tmp_path / f"{n}.key", tmp_path / "ca.crt")
           for n in ("rank-0", "rank-1", "admin")}
    assert identity_from_cert_file(tmp_path / "rank-1.crt") == PeerIdentity("t", 1)
    assert identity_from_cert_file(tmp_path / "admin.crt") == PeerIdentity("t", None)
    # A real mutual-TLS coordinator serving with rank 0's certificate (auto mode: identities required).
    coord = Coordinator(JobTopology(2, 1, 1), "t", authorizer=rank_authorizer(tls["rank-0"], "t", rank=0))
    server, port = rpc.create_server("127.0.0.1:0", [(cpb_grpc.add_CoordinatorServicer_to_server, coord)],
                                     tls=tls["rank-0"])
    server.start()
    try:
        def beat(who: str, rank: int) -> grpc.StatusCode:
            with rpc.make_channel(f"localhost:{port}", tls=tls[who]) as ch:
                try:
                    cpb_grpc.CoordinatorStub(ch).Heartbeat(
                        cpb.HeartbeatRequest(job="t", rank=rank, incarnation=1, full_report=True), timeout=10)
                except grpc.RpcError as e:
                    return e.code()
            return grpc.StatusCode.OK

        assert beat("rank-1", 1) == grpc.StatusCode.OK
        assert beat("rank-1", 0) == grpc.StatusCode.PERMISSION_DENIED
        assert beat("admin", 0) == grpc.StatusCode.PERMISSION_DENIED
        assert sorted(coord.state.registered) == [1]
    finally:
        server.stop(0)
