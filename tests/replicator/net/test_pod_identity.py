"""Per-Pod identities ``mtc://<job>/pod/<pod name>``: the rank rule, and mutual TLS on a real gRPC server.

The rule (docs/security.md): a host's Pod is ``<job>-<replicated job>-<slice>-<host>-<5 letters/digits>``,
``host < hosts_per_slice``, indices without leading zeros; its rank is ``slice * hosts_per_slice + host``.
Anything else is refused with a reason, never guessed. The coordinator (with its admin layer) is served on
127.0.0.1 with certificates made here by ``cryptography``: a Pod's certificate may report only as the
rank its name derives.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc_rpc import admin_pb2
from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.topology import JobTopology
from replicator.net.security import (
    IdentityError,
    PeerIdentity,
    PodRankRule,
    RankAuthorizer,
    identity_from_auth_context,
    identity_from_cert_file,
    parse_identity_uri,
    pod_identity,
    rank_authorizer,
)
from replicator.options import ConfigError, ReplicatorOptions
from tests.kits.certs import CertAuthority, jobset_pod_name
from tests.kits.tls_coordinator import ServedCoordinator, beat, picture

SLICES, HOSTS = 2, 2
NODES = SLICES * HOSTS
RULE = PodRankRule("t", "workers", HOSTS)


# --------------------------------------------------------------------------- the naming rule


def test_pod_identities_parse() -> None:
    assert pod_identity("t", "t-workers-1-0-x7k2q").uri == "mtc://t/pod/t-workers-1-0-x7k2q"
    ident = parse_identity_uri("mtc://t/pod/t-workers-1-0-x7k2q")
    assert ident == PeerIdentity("t", None, "t-workers-1-0-x7k2q")
    assert not ident.is_admin and ident.rank is None
    assert parse_identity_uri("mtc://t/admin").is_admin
    # A certificate naming both its rank and its Pod names two identities: refused, not reconciled.
    with pytest.raises(IdentityError, match="several identities"):
        identity_from_auth_context({"peer_uri": [b"mtc://t/rank/2", b"mtc://t/pod/t-workers-1-0-x7k2q"]})


@pytest.mark.parametrize("bad", [
    "mtc://t/pod/", "mtc://t/pod/T-workers-0-0-abcde", "mtc://t/pod/t-workers-0-0-abcde-", "mtc://t/pod/-t",
    "mtc://t/pod/a/b", "mtc://t/pod/a_b", "mtc://t/pod/a?x=1", "mtc://t/pods/t-workers-0-0-abcde",
    "mtc://t/pod/" + "a" * 254,
])
def test_malformed_pod_identities_are_errors(bad: str) -> None:
    with pytest.raises(IdentityError, match="not an mtc identity"):
        parse_identity_uri(bad)


def test_the_rank_rule() -> None:
    assert RULE.place("t-workers-0-0-x7k2q") == (0, 0)
    assert RULE.rank_of("t-workers-0-1-x7k2q") == 1
    assert RULE.rank_of("t-workers-1-0-x7k2q") == 2
    assert RULE.rank_of("t-workers-1-1-bcd42") == 3
    # Job names with dashes and digits: the prefix is fixed, so the tail is read unambiguously.
    assert PodRankRule("mtc-train-2", "workers", 4).rank_of("mtc-train-2-workers-3-2-abcde") == 14
    assert PodRankRule("a", "w-1", 3).rank_of("a-w-1-2-0-zzzzz") == 6


@pytest.mark.parametrize("pod,why", [
    ("t-workers-0-2-x7k2q", "a slice has 2 host(s)"),  # would otherwise be read as rank 2 = slice 1's host 0
    ("t-workers-00-1-x7k2q", "not a host"),
    ("t-workers-0-01-x7k2q", "not a host"),
    ("t-head-0-0-x7k2q", "not a host"),  # the Pathways head
    ("u-workers-0-0-x7k2q", "not a host"),  # another JobSet
    ("tt-workers-0-0-x7k2q", "not a host"),
    ("t-workers-0-0", "not a host"),  # the hostname, not the Pod name
    ("t-workers-0-0-x7k2", "not a host"),
    ("t-workers-0-0-x7k2qq", "not a host"),
    ("t-workers-0-0-X7K2Q", "not a host"),
    ("t-workers-0-0-0-x7k2q", "not a host"),
    ("t-workers-x-0-0-x7k2q", "not a host"),
    ("t-workers--1-0-x7k2q", "not a host"),
    ("t-workers-0-0-x7k2q.t", "not a host"),
])
def test_pod_names_outside_the_rule_are_refused(pod: str, why: str) -> None:
    with pytest.raises(IdentityError, match=re.escape(why)):
        RULE.rank_of(pod)


def test_a_rule_needs_a_replicated_job_name_and_hosts() -> None:
    for bad in ({"replicated_job": "Workers"}, {"replicated_job": ""}, {"hosts_per_slice": 0},
                {"hosts_per_slice": True}):
        with pytest.raises(ValueError):
            PodRankRule("t", **bad)
    with pytest.raises(ValueError, match="job"):
        RankAuthorizer("t", pods=PodRankRule("u"))


_label = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?\Z")
_suffix = st.text(alphabet="bcdfghjklmnpqrstvwxz2456789", min_size=5, max_size=5)


@given(job=_label, rj=_label, hosts=st.integers(1, 64), s=st.integers(0, 10**4), h=st.integers(0, 63),
       suffix=_suffix)
def test_every_jobset_pod_name_derives_its_rank(job: str, rj: str, hosts: int, s: int, h: int, suffix: str) -> None:
    rule = PodRankRule(job, rj, hosts)
    pod = jobset_pod_name(job, s, h, rj, suffix)
    if h < hosts:
        assert rule.place(pod) == (s, h)
        assert divmod(rule.rank_of(pod), hosts) == (s, h)  # one Pod per rank, one rank per Pod
    else:
        with pytest.raises(IdentityError, match="host"):
            rule.rank_of(pod)


@given(pod=st.one_of(st.text(max_size=40), st.from_regex(r"\At-workers-[0-9a-z-]{1,20}\Z")))
def test_an_accepted_name_is_exactly_the_rule_never_a_guess(pod: str) -> None:
    try:
        s, h = RULE.place(pod)
    except IdentityError:
        return
    assert h < HOSTS
    assert pod == jobset_pod_name("t", s, h, "workers", pod[-5:])
    assert re.fullmatch(r"[a-z0-9]{5}", pod[-5:])


def _ctx(*uris: str) -> dict[str, list[bytes]]:
    return {"peer_uri": [u.encode() for u in uris], "x509_subject": [b"CN=x"]}


def test_the_authorizer_binds_a_pod_to_its_derived_rank() -> None:
    auth = RankAuthorizer("t", require=True, pods=RULE)
    pod = "mtc://t/pod/t-workers-1-0-x7k2q"
    assert auth.refusal(_ctx(pod), 2) is None
    why = auth.refusal(_ctx(pod), 3)
    assert why == ("report for rank 3 refused: the certificate mtc://t/pod/t-workers-1-0-x7k2q is host 0 of slice 1, "
                   "i.e. rank 2 (1 x 2 hosts per slice + 0); it may report only for rank 2")
    assert "job 'u'" in auth.refusal(_ctx("mtc://u/pod/u-workers-1-0-x7k2q"), 2)
    assert "not a host of job 't'" in auth.refusal(_ctx("mtc://t/pod/t-head-0-0-x7k2q"), 0)
    # A coordinator with no Pod rule refuses Pod identities rather than guessing a rank.
    assert "no rule mapping Pods" in RankAuthorizer("t", require=False).refusal(_ctx(pod), 2)
    # A Pod is never an administrator.
    assert "needs the job's admin certificate" in auth.admin_refusal(_ctx(pod), "Pin")


def test_the_replicators_own_pod_certificate_is_checked(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path / "ca")
    mine = ca.issue_pod("t", "t-workers-1-1-x7k2q")
    assert identity_from_cert_file(mine.cert) == PeerIdentity("t", None, "t-workers-1-1-x7k2q")
    tls = mine.tls(ca.ca_file)
    assert rank_authorizer(tls, "t", "auto", rank=3, pods=RULE) == RankAuthorizer("t", True, RULE)
    assert rank_authorizer(tls, "t", "require", rank=3, pods=RULE) == RankAuthorizer("t", True, RULE)
    with pytest.raises(ValueError, match=r"host 1 of slice 1, i\.e\. rank 3 .* but this replicator is rank 2"):
        rank_authorizer(tls, "t", rank=2, pods=RULE)
    with pytest.raises(ValueError, match="a slice has 1 host"):
        rank_authorizer(tls, "t", rank=3, pods=PodRankRule("t", "workers", 1))
    with pytest.raises(ValueError, match="not a host of job"):
        rank_authorizer(tls, "t", rank=3, pods=PodRankRule("t", "trainers", 2))
    with pytest.raises(ValueError, match="no rule maps Pods"):
        rank_authorizer(tls, "t", rank=3)
    with pytest.raises(ValueError, match="job 't'"):
        rank_authorizer(tls, "u", rank=3, pods=PodRankRule("u", "workers", 2))


def test_replicator_options_give_the_rule(tmp_path: Path) -> None:
    opts = ReplicatorOptions(local_dir=tmp_path, rank=0, nodes=4, data_parallelism=2).validate()
    assert opts.pod_rank_rule("t", 4, 2) == PodRankRule("t", "workers", 2)
    opts = ReplicatorOptions(local_dir=tmp_path, rank=0, nodes=4, tls_pod_replicated_job="hosts",
                             tls_pod_hosts_per_slice=4).validate()
    assert opts.pod_rank_rule("t", 4, 2) == PodRankRule("t", "hosts", 4)
    with pytest.raises(ConfigError, match="replicated job"):
        ReplicatorOptions(local_dir=tmp_path, rank=0, nodes=4, tls_pod_replicated_job="Hosts").validate()
    with pytest.raises(ConfigError, match=">= 0"):
        ReplicatorOptions(local_dir=tmp_path, rank=0, nodes=4, tls_pod_hosts_per_slice=-1).validate()


# --------------------------------------------------------------------------- mutual TLS, real gRPC server


def served_coordinator(tmp: Path) -> ServedCoordinator:
    """The coordinator and its admin layer on 127.0.0.1, requiring identities, with the Pod rule for 2 x 2."""
    ca = CertAuthority(tmp / "ca")
    return ServedCoordinator(ca, JobTopology(NODES, SLICES, 1), RankAuthorizer("t", require=True, pods=RULE),
                             ca.issue_pod("t", jobset_pod_name("t", 0, 0)))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedCoordinator]:
    s = served_coordinator(tmp_path)
    yield s
    s.close()


def test_each_pod_reports_as_its_derived_rank(served: ServedCoordinator) -> None:
    for s in range(SLICES):
        for h in range(HOSTS):
            coord_stub, _ = served.stubs(served.ca.issue_pod("t", jobset_pod_name("t", s, h)))
            assert beat(coord_stub, s * HOSTS + h).epoch == served.coord.epoch
    assert served.coord.state.reported_count == NODES
    assert served.coord.state.globally_complete_steps() == [5]


def test_a_pod_reporting_as_another_rank_is_denied_and_changes_nothing(served: ServedCoordinator) -> None:
    pods = {r: served.stubs(served.ca.issue_pod("t", jobset_pod_name("t", *divmod(r, HOSTS))))[0]
            for r in range(NODES)}
    for r in range(NODES):
        beat(pods[r], r)
    before = picture(served.coord, NODES)
    # Slice 1's host 0 (rank 2) claims every other rank, e.g. rank 3 (its neighbour) or rank 0 (slice 0's).
    for claimed in (0, 1, 3):
        with pytest.raises(grpc.RpcError) as e:
            beat(pods[2], claimed, step=9, address="10.9.9.9:1")
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.value.details() == (
            f"report for rank {claimed} refused: the certificate mtc://t/pod/{jobset_pod_name('t', 1, 0)} is host 0 "
            "of slice 1, i.e. rank 2 (1 x 2 hosts per slice + 0); it may report only for rank 2")
    assert picture(served.coord, NODES) == before
    beat(pods[3], 3)  # the real rank 3 still reports


@pytest.mark.parametrize("uri,why", [
    ("mtc://u/pod/u-workers-0-1-x7k2q", "a member of job 'u', but this coordinator serves job 't'"),
    ("mtc://t/pod/u-workers-0-1-x7k2q", "Pod 'u-workers-0-1-x7k2q' is not a host of job 't'"),
    ("mtc://t/pod/t-head-0-0-x7k2q", "Pod 't-head-0-0-x7k2q' is not a host of job 't'"),
    ("mtc://t/pod/t-workers-0-01-x7k2q", "is not a host of job 't'"),
    ("mtc://t/pod/t-workers-0-3-x7k2q", "is host 3 of slice 0, but a slice has 2 host(s)"),
    ("mtc://t/pod/t-workers-0-1", "is not a host of job 't'"),
])
def test_pod_certificates_that_name_no_rank_of_this_job_are_denied(served: ServedCoordinator, uri: str, why: str) -> None:
    coord_stub, admin_stub = served.stubs(served.ca.issue("stray", [uri]))
    with pytest.raises(grpc.RpcError) as e:
        beat(coord_stub, 1)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert e.value.details().startswith("report for rank 1 refused: ") and why in e.value.details()
    assert served.coord.state.registered == {}
    # Any certificate of the CA still reads status: past the certificate check, the coordinator answers that
    # it waits for the hosts' reports (issue #33), not PERMISSION_DENIED.
    with pytest.raises(grpc.RpcError) as e:
        coord_stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "rebuilding its view" in e.value.details()


def test_a_pod_certificate_is_not_an_admin_one(served: ServedCoordinator) -> None:
    coord_stub, admin_stub = served.stubs(served.ca.issue_pod("t", jobset_pod_name("t", 0, 1)))
    beat(coord_stub, 1)
    with pytest.raises(grpc.RpcError) as e:
        admin_stub.Pin(admin_pb2.PinRequest(step=5), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the job's admin certificate (mtc://t/admin)" in e.value.details()
    _, admin = served.stubs(served.ca.issue_admin("t"))
    assert list(admin.Pin(admin_pb2.PinRequest(step=5), timeout=10).pinned_steps) == [5]


def test_the_daemon_binds_pod_identities_with_its_shape(tmp_path: Path) -> None:
    """The replicator daemon's coordinator gets the Pod rule from its options; in Orbax mode, where the daemon's
    data-parallelism is Orbax's (1 when peer-ranks are not slice-major), --tls-pod-hosts-per-slice says the shape."""
    from replicator.daemon import Replicator

    ca = CertAuthority(tmp_path / "ca")
    pair = ca.issue_pod("t", jobset_pod_name("t", 1, 0))  # slice 1, host 0: rank 2 with 2 hosts per slice
    tls = {"tls_cert": str(pair.cert), "tls_key": str(pair.key), "tls_ca": str(ca.ca_file),
           "tls_rank_identity": "require"}
    opts = ReplicatorOptions(local_dir=tmp_path / "ram", rank=2, nodes=4, data_parallelism=2, job="t",
                             coordinator_candidates="2=127.0.0.1:1", **tls).validate()
    daemon = Replicator(opts, rank=2, nodes=4, job="t", data_parallelism=2)
    auth = daemon.coordinator.authorizer
    assert auth == RankAuthorizer("t", True, PodRankRule("t", "workers", 2))
    assert auth.refusal(_ctx(f"mtc://t/pod/{jobset_pod_name('t', 1, 1)}"), 3) is None
    with pytest.raises(ConfigError, match="but this replicator is rank 2"):
        Replicator(opts, rank=2, nodes=4, job="t", data_parallelism=1)  # 4 hosts per slice: the Pod is rank 4
    Replicator(dataclasses.replace(opts, tls_pod_hosts_per_slice=2), rank=2, nodes=4, job="t", data_parallelism=1)
