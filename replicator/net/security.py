"""Authentication and transport security for every replicator gRPC endpoint: bearer token and (m)TLS.

- A shared token (``--token-file``) is checked by ``TokenAuthInterceptor`` on the server with a
  constant-time compare; ``BearerTokenClientInterceptor`` adds it to every call on the client.
- The standard health service (``grpc.health.v1.Health``) stays open without a token on purpose:
  Kubernetes gRPC probes cannot send metadata, and health answers reveal nothing but SERVING.
- TLS from PEM files (``--tls-cert/--tls-key/--tls-ca``); giving a CA turns on mutual TLS (the server
  demands a client certificate signed by it, the client verifies the server with it).
- Identities under mutual TLS: a certificate names who it is by a URI subject alternative name,
  ``mtc://<job>/rank/<N>`` (a host of the job), ``mtc://<job>/pod/<pod name>`` (a host's per-Pod
  certificate; :class:`PodRankRule` derives its rank from the JobSet Pod name) or ``mtc://<job>/admin``
  (the controller, ``mtc``). :class:`RankAuthorizer` lets a host's certificate report only for its own
  rank (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hmac
import logging
import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "
# Methods reachable without a token (see the module docstring for why).
HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
# Upper bound on a token we agree to compare: protects against giant metadata values.
MAX_TOKEN_BYTES = 4096


def validate_token(token: str) -> str:
    """Return ``token`` if usable as a bearer token, else raise ValueError (never echoing the token)."""
    if not isinstance(token, str) or not token or len(token.encode()) > MAX_TOKEN_BYTES:
        raise ValueError("token must be a non-empty string of at most 4096 bytes")
    if token != token.strip() or any(ord(c) < 0x21 or ord(c) > 0x7E for c in token):
        raise ValueError("token must be printable ASCII without whitespace")
    return token


def read_token_file(path: Path) -> str:
    """Read a token from a file (e.g. a mounted Kubernetes secret), ignoring a trailing newline."""
    return validate_token(Path(path).read_text().strip())


def bearer_matches(metadata: Iterable[tuple[str, Any]] | None, token: str) -> bool:
    """True when ``metadata`` carries ``authorization: Bearer <token>``; constant time in the token."""
    expected = (BEARER_PREFIX + token).encode()
    ok = False
    for key, value in metadata or ():
        if key.lower() != AUTH_METADATA_KEY:
            continue
        got = value.encode() if isinstance(value, str) else bytes(value)
        # compare_digest on every candidate, no early exit on the first mismatch.
        ok |= hmac.compare_digest(got, expected)
    return ok


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Reject every RPC without the right bearer token with UNAUTHENTICATED (health methods excepted)."""

    def __init__(self, token: str, open_methods: frozenset[str] = HEALTH_METHODS):
        self._token = validate_token(token)
        self._open = frozenset(open_methods)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method in self._open or bearer_matches(handler_call_details.invocation_metadata, self._token):
            return continuation(handler_call_details)
        log.warning("rejected unauthenticated call to %s", method)
        handler = continuation(handler_call_details)
        return _deny_handler(handler)


def _deny(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _deny_stream(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield  # pragma: no cover - makes this a generator for response-streaming methods


def _deny_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    # Unknown methods are denied too, so an unauthenticated caller cannot probe which methods exist.
    req_stream = bool(handler and handler.request_streaming)
    resp_stream = bool(handler and handler.response_streaming)
    if req_stream and resp_stream:
        return grpc.stream_stream_rpc_method_handler(_deny_stream)
    if req_stream:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if resp_stream:
        return grpc.unary_stream_rpc_method_handler(_deny_stream)
    return grpc.unary_unary_rpc_method_handler(_deny)


class BearerTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Add ``authorization: Bearer <token>`` to every call made through the intercepted channel.

    An interceptor rather than call credentials: gRPC only attaches call credentials to TLS channels,
    and the token must also work on plaintext channels inside a trusted network.
    """

    def __init__(self, token: str):
        self._pair = (AUTH_METADATA_KEY, BEARER_PREFIX + validate_token(token))

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0].lower() != AUTH_METADATA_KEY]
        metadata.append(self._pair)
        return _CallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
            compression=details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """PEM files for TLS. ``cert_file``+``key_file``: this endpoint's identity (required on a server,
    used as the client certificate on a channel). ``ca_file``: trust root for the other side; when
    given, the server requires client certificates (mutual TLS). ``server_name_override`` lets a
    client accept a server certificate issued for another name (tests, pod IPs)."""

    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    server_name_override: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        for p in (self.cert_file, self.key_file, self.ca_file):
            if p is not None and not Path(p).is_file():
                raise ValueError(f"TLS file {p} does not exist")

    @classmethod
    def from_args(
        cls, cert: str | Path | None, key: str | Path | None, ca: str | Path | None
    ) -> TlsOptions | None:
        """Options from the ``--tls-cert/--tls-key/--tls-ca`` flags; None when none of them is set."""
        if cert is None and key is None and ca is None:
            return None
        as_path = lambda p: None if p is None else Path(p)  # noqa: E731
        return cls(as_path(cert), as_path(key), as_path(ca))

    @property
    def mutual(self) -> bool:
        return self.ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None or self.key_file is None:
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        key = Path(self.key_file).read_bytes() if self.key_file else None
        cert = Path(self.cert_file).read_bytes() if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.server_name_override:
            return [("grpc.ssl_target_name_override", self.server_name_override)]
        return []


# --------------------------------------------------------------------------- identities under mutual TLS

IDENTITY_SCHEME = "mtc"
# A Kubernetes object name that is a DNS subdomain (RFC 1123, at most 253 characters): what a Pod is named.
_POD_NAME = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?"
# mtc://<job>/rank/<N>, mtc://<job>/pod/<pod name> or mtc://<job>/admin; the job is percent-encoded
# (quote(job, safe="")).
_IDENTITY_RE = re.compile(r"mtc://(?P<job>[^/?#]+)/(?:rank/(?P<rank>0|[1-9][0-9]{0,8})|pod/(?P<pod>"
                          + _POD_NAME + r")|(?P<admin>admin))")
# What follows "<job>-<replicated job>-" in a JobSet Pod's name: the Job index (slice), the completion
# index (host in slice), both decimal without leading zeros, and the 5-character suffix Kubernetes'
# generateName appends (lower-case letters and digits).
_POD_TAIL_RE = re.compile(r"(?P<slice>0|[1-9][0-9]{0,8})-(?P<host>0|[1-9][0-9]{0,8})-[a-z0-9]{5}")
_DNS_LABEL_RE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
# Auth-context keys (grpc core) holding a client certificate's URI SANs: gRPC >= 1.39 lists them under
# peer_uri; every version lists all SANs (DNS, IP, URI) under x509_subject_alternative_name.
_URI_KEYS = ("peer_uri", "x509_subject_alternative_name")


class IdentityError(ValueError):
    """A certificate's mtc:// identity is malformed or ambiguous (names two different identities)."""


@dataclasses.dataclass(frozen=True)
class PeerIdentity:
    """Who a client certificate says it is: host ``rank`` of ``job``, the Pod ``pod`` of ``job`` (a host
    whose rank :class:`PodRankRule` derives from the Pod's name), or an administrator (both None)."""

    job: str
    rank: int | None = None
    pod: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.rank is None and self.pod is None

    @property
    def uri(self) -> str:
        """The URI SAN naming this identity (what a certificate carries)."""
        job = urllib.parse.quote(self.job, safe="")
        if self.pod is not None:
            return f"{IDENTITY_SCHEME}://{job}/pod/{self.pod}"
        return f"{IDENTITY_SCHEME}://{job}/admin" if self.rank is None else f"{IDENTITY_SCHEME}://{job}/rank/{self.rank}"

    def __str__(self) -> str:
        return self.uri


def rank_identity(job: str, rank: int) -> PeerIdentity:
    """The identity a host certificate of ``job``'s ``rank`` carries (``PeerIdentity(job, rank).uri``)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 10**9:
        raise ValueError(f"rank must be an int in 0..999999999, got {rank!r}")
    if not job:
        raise ValueError("job must be non-empty")
    return PeerIdentity(job, rank)


def pod_identity(job: str, pod: str) -> PeerIdentity:
    """The identity of a per-Pod certificate of ``job``'s Pod ``pod`` (``mtc://<job>/pod/<pod>``).

    cert-manager's csi-driver issues it with ``csi.cert-manager.io/uri-sans: mtc://<job>/pod/${POD_NAME}``.
    """
    if not job:
        raise ValueError("job must be non-empty")
    if not isinstance(pod, str) or re.fullmatch(_POD_NAME, pod) is None:
        raise ValueError(f"{pod!r} is not a Pod name (a DNS subdomain: lower-case letters, digits, '-', '.')")
    return PeerIdentity(job, None, pod)


def admin_identity(job: str) -> PeerIdentity:
    """The identity of ``job``'s administrators and controller (``mtc``, ``CheckpointManager``)."""
    if not job:
        raise ValueError("job must be non-empty")
    return PeerIdentity(job, None)


def parse_identity_uri(uri: str) -> PeerIdentity | None:
    """The identity named by a URI SAN; None for a URI of another scheme (e.g. a SPIFFE id).

    Raises :class:`IdentityError` for an ``mtc://`` URI that does not follow the rule (never a guess).
    """
    if not uri.lower().startswith(IDENTITY_SCHEME + "://"):
        return None
    m = _IDENTITY_RE.fullmatch(uri)
    if m is None:
        raise IdentityError(f"{uri!r} is not an mtc identity: expected mtc://<job>/rank/<N>, "
                            "mtc://<job>/pod/<pod name> or mtc://<job>/admin")
    job = urllib.parse.unquote(m["job"])
    if m["pod"]:
        return PeerIdentity(job, None, m["pod"])
    return PeerIdentity(job, None if m["admin"] else int(m["rank"]))


def _texts(values: Iterable[Any] | None) -> list[str]:
    out = []
    for v in values or ():
        out.append(v.decode("utf-8", "replace") if isinstance(v, bytes | bytearray) else str(v))
    return out


def identity_from_uris(uris: Iterable[str]) -> PeerIdentity | None:
    """The one mtc identity among a certificate's URI SANs; None when it has none.

    Raises :class:`IdentityError` when one is malformed or two name different identities.
    """
    found = {i for u in uris if (i := parse_identity_uri(u)) is not None}
    if len(found) > 1:
        raise IdentityError("the certificate names several identities: " + ", ".join(sorted(map(str, found))))
    return next(iter(found), None)


def identity_from_auth_context(auth_context: Mapping[str, Iterable[Any]] | None) -> PeerIdentity | None:
    """The mtc identity of a call's client certificate, from gRPC's ``context.auth_context()``.

    None when the call has no client certificate or its certificate names no mtc identity.
    """
    ctx = auth_context or {}
    raw = tuple(v for key in _URI_KEYS for v in ctx.get(key) or ())
    return _identity_of(raw)


@functools.lru_cache(maxsize=65536)
def _identity_of(raw: tuple[Any, ...]) -> PeerIdentity | None:
    # Memoised: every heartbeat of a host presents the same certificate (about one entry per host and
    # certificate rotation; 65,536 covers 10,000 hosts without thrashing the LRU).
    return identity_from_uris(_texts(raw))


def describe_certificate(auth_context: Mapping[str, Iterable[Any]] | None) -> str:
    """A short description of a call's client certificate for error messages (its subject, or "no client certificate")."""
    ctx = auth_context or {}
    subject = _texts(ctx.get("x509_subject")) or _texts(ctx.get("x509_common_name"))
    if subject:
        return f"certificate {subject[0]!r}"
    return "no client certificate"


def identity_from_cert_file(path: Path) -> PeerIdentity | None:
    """The mtc identity in a PEM certificate file's URI SANs (the first certificate of a chain)."""
    from cryptography import x509  # a core dependency (pyproject); imported only under mutual TLS

    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return identity_from_uris(san.get_values_for_type(x509.UniformResourceIdentifier))


DEFAULT_REPLICATED_JOB = "workers"


@dataclasses.dataclass(frozen=True)
class PodRankRule:
    """The rank a per-Pod identity ``mtc://<job>/pod/<pod name>`` stands for (docs/security.md).

    JobSet names the Pods of replicated job ``R`` of JobSet ``J`` ``J-R-<job index>-<completion index>-<x>``
    (the Job ``J-R-<job index>``, then Kubernetes' Indexed-Job ``generateName`` ``-<index>-`` and five random
    characters). Our hosts are the Pods of one replicated job (``workers``) with one Job per slice, so:
    the Pod name must be exactly ``<job>-<replicated_job>-<s>-<h>-<x>`` with ``<job>`` this job, ``<s>`` and
    ``<h>`` decimal without leading zeros, ``h < hosts_per_slice`` and ``<x>`` five lower-case letters or
    digits; its rank is ``s * hosts_per_slice + h``. Anything else is refused (:class:`IdentityError`),
    never guessed. The parse is unambiguous: job and replicated job are fixed here, and the tail has a fixed
    shape without further dashes.
    """

    job: str
    replicated_job: str = DEFAULT_REPLICATED_JOB
    hosts_per_slice: int = 1

    def __post_init__(self) -> None:
        if not self.job:
            raise ValueError("job must be non-empty")
        if _DNS_LABEL_RE.fullmatch(self.replicated_job) is None:
            raise ValueError(f"replicated job {self.replicated_job!r} is not a DNS label (lower-case letters, "
                             "digits, '-')")
        if not isinstance(self.hosts_per_slice, int) or isinstance(self.hosts_per_slice, bool) \
                or self.hosts_per_slice < 1:
            raise ValueError(f"hosts per slice must be an int >= 1, got {self.hosts_per_slice!r}")

    @property
    def pattern(self) -> str:
        """The Pod names this rule accepts, for messages."""
        return f"{self.job}-{self.replicated_job}-<slice>-<host>-<5 letters/digits>"

    def place(self, pod: str) -> tuple[int, int]:
        """``(slice, host in slice)`` of Pod ``pod``; IdentityError when the name does not follow the rule."""
        return _pod_place(self, pod)

    def rank_of(self, pod: str) -> int:
        """The rank Pod ``pod`` is: ``slice * hosts_per_slice + host``; IdentityError when it names none."""
        s, h = self.place(pod)
        return s * self.hosts_per_slice + h


@functools.lru_cache(maxsize=65536)
def _pod_place(rule: PodRankRule, pod: str) -> tuple[int, int]:
    # Memoised like _identity_of: a host presents the same certificate on every heartbeat (refusals raise
    # and are not cached).
    prefix = f"{rule.job}-{rule.replicated_job}-"
    m = _POD_TAIL_RE.fullmatch(pod[len(prefix):]) if pod.startswith(prefix) else None
    if m is None:
        raise IdentityError(f"Pod {pod!r} is not a host of job {rule.job!r}: a host's Pod is named {rule.pattern} "
                            f"(replicated job {rule.replicated_job!r}, indices without leading zeros)")
    s, h = int(m["slice"]), int(m["host"])
    if h >= rule.hosts_per_slice:
        raise IdentityError(f"Pod {pod!r} is host {h} of slice {s}, but a slice has {rule.hosts_per_slice} "
                            f"host(s) (0..{rule.hosts_per_slice - 1})")
    return s, h


class RankIdentityMode(enum.StrEnum):
    """``--tls-rank-identity``: what the coordinator does with a report whose certificate names no rank."""

    # Refuse it when this replicator's own certificate names a rank (the job issues per-rank
    # certificates), accept it otherwise (one certificate for the whole job).
    AUTO = "auto"
    # Always refuse it.
    REQUIRE = "require"


@dataclasses.dataclass(frozen=True)
class RankAuthorizer:
    """Under mutual TLS: may the caller of a rank-scoped RPC (a heartbeat) act for the rank it claims?

    A certificate naming ``mtc://<job>/rank/<N>`` may act only for rank N of that job; one naming
    ``mtc://<job>/pod/<pod>`` only for the rank ``pods`` derives from the Pod's name (refused when
    ``pods`` is None or the name follows no rule); an admin certificate (``mtc://<job>/admin``) never;
    one naming no identity only when ``require`` is False.
    """

    job: str
    require: bool = True
    pods: PodRankRule | None = None

    def __post_init__(self) -> None:
        if self.pods is not None and self.pods.job != self.job:
            raise ValueError(f"the Pod rule is for job {self.pods.job!r}, this authorizer for {self.job!r}")

    def refusal(self, auth_context: Mapping[str, Iterable[Any]] | None, rank: int) -> str | None:
        """Why a report claiming ``rank`` is refused (PERMISSION_DENIED), or None when it is allowed."""
        try:
            ident = identity_from_auth_context(auth_context)
        except IdentityError as e:
            return f"report for rank {rank} refused: {describe_certificate(auth_context)}: {e}"
        if ident is None:
            if not self.require:
                return None
            return (f"report for rank {rank} refused: {describe_certificate(auth_context)} names no rank; "
                    f"under mutual TLS a host's certificate must carry the URI SAN "
                    f"{rank_identity(self.job, rank).uri} or its Pod's mtc://{self.job}/pod/<pod name> "
                    "(docs/security.md)")
        if ident.job != self.job:
            return (f"report for rank {rank} refused: the certificate names {ident.uri}, a member of job "
                    f"{ident.job!r}, but this coordinator serves job {self.job!r}")
        if ident.is_admin:
            return (f"report for rank {rank} refused: the certificate {ident.uri} is an administrator's; it "
                    "may call status and admin RPCs but not report as a rank")
        if ident.pod is not None:
            return self._pod_refusal(ident.uri, ident.pod, rank)
        if ident.rank != rank:
            return (f"report for rank {rank} refused: the certificate names rank {ident.rank} ({ident.uri}); "
                    f"rank {ident.rank}'s certificate may report only for rank {ident.rank}")
        return None

    def _pod_refusal(self, uri: str, pod: str, rank: int) -> str | None:
        if self.pods is None:
            return (f"report for rank {rank} refused: the certificate {uri} names a Pod, and this "
                    "coordinator has no rule mapping Pods to ranks")
        try:
            s, h = self.pods.place(pod)
        except IdentityError as e:
            return f"report for rank {rank} refused: the certificate {uri} names no rank: {e}"
        derived = s * self.pods.hosts_per_slice + h
        if derived != rank:
            return (f"report for rank {rank} refused: the certificate {uri} is host {h} of slice {s}, "
                    f"i.e. rank {derived} ({s} x {self.pods.hosts_per_slice} hosts per slice + {h}); it may "
                    f"report only for rank {derived}")
        return None

    def admin_refusal(self, auth_context: Mapping[str, Iterable[Any]] | None, action: str) -> str | None:
        """Why an administrative action (pin, restore, backup, bad-copy report) is refused, or None.

        With identities required only the job's admin certificate may; otherwise (one certificate for the
        whole job) any certificate of the CA may, as before.
        """
        if not self.require:
            return None
        try:
            ident = identity_from_auth_context(auth_context)
        except IdentityError as e:
            ident, detail = None, f"{describe_certificate(auth_context)}: {e}"
        else:
            detail = ident.uri if ident is not None else f"{describe_certificate(auth_context)} names no identity"
        if ident is not None and ident.is_admin and ident.job == self.job:
            return None
        return (f"{action} refused: it needs the job's admin certificate ({admin_identity(self.job).uri}), "
                f"the caller presented {detail}")


class AdminGate:
    """Wraps a servicer so that its methods in ``actions`` need the admin identity (:meth:`RankAuthorizer.admin_refusal`)."""

    def __init__(self, inner: Any, authorizer: RankAuthorizer, actions: Iterable[str]):
        self._inner = inner
        self._authorizer = authorizer
        self._actions = frozenset(actions)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if name not in self._actions:
            return fn

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            why = self._authorizer.admin_refusal(context.auth_context(), name)
            if why is not None:
                log.warning("%s (peer %s)", why, context.peer())
                context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return fn(request, context)

        return call


def rank_authorizer(
    tls: TlsOptions | None, job: str, mode: RankIdentityMode | str = RankIdentityMode.AUTO,
    rank: int | None = None, pods: PodRankRule | None = None,
) -> RankAuthorizer | None:
    """The coordinator's :class:`RankAuthorizer` for a replicator's TLS options; None without mutual TLS.

    ``pods``: how per-Pod identities map to ranks (None: they are refused). Also checks this replicator's own
    certificate: one that names another job, another rank than ``rank`` (directly or through its Pod name),
    a Pod name following no rule, or an administrator raises ValueError (the host would be refused on every
    report).
    """
    mode = RankIdentityMode(mode)
    if tls is None or not tls.mutual:
        if mode is RankIdentityMode.REQUIRE:
            raise ValueError("--tls-rank-identity require needs mutual TLS (--tls-ca with --tls-cert/--tls-key)")
        return None
    own = identity_from_cert_file(tls.cert_file) if tls.cert_file is not None else None
    if own is not None:
        where = f"--tls-cert {tls.cert_file} names {own.uri}"
        if own.job != job:
            raise ValueError(f"{where}, a member of job {own.job!r}; this replicator serves job {job!r}")
        if own.is_admin:
            raise ValueError(f"{where}, an administrator's certificate; a replicator needs its rank's")
        if own.pod is not None:
            if pods is None:
                raise ValueError(f"{where}, a Pod identity, but no rule maps Pods to ranks here")
            try:
                s, h = pods.place(own.pod)
            except IdentityError as e:
                raise ValueError(f"{where}: {e}") from None
            derived = s * pods.hosts_per_slice + h
            if rank is not None and derived != rank:
                raise ValueError(f"{where}, host {h} of slice {s}, i.e. rank {derived} ({s} x "
                                 f"{pods.hosts_per_slice} hosts per slice + {h}), but this replicator is rank {rank}")
        elif rank is not None and own.rank != rank:
            raise ValueError(f"{where} but this replicator is rank {rank}")
    require = mode is RankIdentityMode.REQUIRE or own is not None
    return RankAuthorizer(job, require=require, pods=pods)
