"""Test kit: a throwaway CA issuing per-rank, admin and other certificates for mutual-TLS tests.

Every certificate is usable as server and client (no extended key usage) for ``localhost`` and
``127.0.0.1``; identities are URI SANs as in docs/security.md (``mtc://<job>/rank/<N>``,
``mtc://<job>/pod/<pod name>``, ``mtc://<job>/admin``). Operators do the same with openssl (the recipe in
docs/security.md); per-Pod certificates are what cert-manager's csi-driver issues in a cluster.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controller_client.demo.cluster import LocalCluster
from replicator.net.security import TlsOptions, admin_identity, pod_identity, rank_identity


@dataclasses.dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path

    def tls(self, ca: Path) -> TlsOptions:
        """Client/server TLS options presenting this certificate and trusting ``ca`` (mutual TLS)."""
        return TlsOptions(self.cert, self.key, ca)

    def args(self, ca: Path) -> list[str]:
        """The replicator's flags for this certificate."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(ca)]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class CertAuthority:
    """A CA in directory ``d`` (``ca.pem``); :meth:`issue` writes ``<name>.pem`` and ``<name>.key``."""

    def __init__(self, d: Path, name: str = "mtc-test-ca"):
        self.dir = Path(d)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self._key, hashes.SHA256()))
        self.ca_file = self.dir / "ca.pem"
        self.ca_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, uris: Sequence[str] = (), cn: str | None = None) -> CertPair:
        """A certificate with subject CN ``cn`` (default ``name``), SANs localhost, 127.0.0.1 and ``uris``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        cert = (x509.CertificateBuilder().subject_name(_name(cn or name)).issuer_name(_name(self.name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .sign(self._key, hashes.SHA256()))
        pair = CertPair(self.dir / f"{name}.pem", self.dir / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair

    def issue_rank(self, job: str, rank: int) -> CertPair:
        """Host ``rank``'s certificate: URI SAN ``mtc://<job>/rank/<rank>``."""
        return self.issue(f"{job}-rank-{rank}", [rank_identity(job, rank).uri])

    def issue_pod(self, job: str, pod: str) -> CertPair:
        """A per-Pod certificate: URI SAN ``mtc://<job>/pod/<pod>`` (as the csi-driver templates ``${POD_NAME}``)."""
        return self.issue(f"pod-{pod}", [pod_identity(job, pod).uri])

    def issue_admin(self, job: str) -> CertPair:
        """The controller's / operator's certificate: URI SAN ``mtc://<job>/admin``."""
        return self.issue(f"{job}-admin", [admin_identity(job).uri])


class RankCertCluster(LocalCluster):
    """A :class:`LocalCluster` whose rank r runs with rank r's certificate (mutual TLS, job ``t``)."""

    def __init__(self, base: Path, nodes: int, data_parallelism: int, ca: CertAuthority, **kw):
        super().__init__(base, nodes, data_parallelism, **kw)
        self.ca = ca
        self.certs = {r: ca.issue_rank("t", r) for r in range(nodes)}

    def _args(self, rank: int, listen: str) -> list[str]:
        return super()._args(rank, listen) + self.certs[rank].args(self.ca.ca_file)


def jobset_pod_name(job: str, slice_index: int, host: int, replicated_job: str = "workers",
                    suffix: str = "x7k2q") -> str:
    """The name JobSet + the Indexed Job controller give Pod ``host`` of slice ``slice_index``."""
    return f"{job}-{replicated_job}-{slice_index}-{host}-{suffix}"


class PodCertCluster(LocalCluster):
    """A :class:`LocalCluster` (job ``t``) whose rank r = s * hosts_per_slice + h runs with the per-Pod
    certificate of JobSet Pod ``t-workers-<s>-<h>-<suffix>`` and ``--tls-rank-identity require``."""

    def __init__(self, base: Path, nodes: int, data_parallelism: int, ca: CertAuthority, **kw):
        super().__init__(base, nodes, data_parallelism, **kw)
        self.ca = ca
        self.hosts_per_slice = nodes // data_parallelism
        self.pods = {r: jobset_pod_name("t", *divmod(r, self.hosts_per_slice)) for r in range(nodes)}
        self.certs = {r: ca.issue_pod("t", pod) for r, pod in self.pods.items()}

    def _args(self, rank: int, listen: str) -> list[str]:
        return (super()._args(rank, listen) + self.certs[rank].args(self.ca.ca_file)
                + ["--tls-rank-identity", "require"])
