"""Authentication and transport security for every replicator gRPC endpoint: bearer token and (m)TLS.

- A shared token (``--token-file``) is checked by ``TokenAuthInterceptor`` on the server with a
  constant-time compare; ``BearerTokenClientInterceptor`` adds it to every call on the client.
- The standard health service (``grpc.health.v1.Health``) stays open without a token on purpose:
  Kubernetes gRPC probes cannot send metadata, and health answers reveal nothing but SERVING.
- TLS from PEM files (``--tls-cert/--tls-key/--tls-ca``); giving a CA turns on mutual TLS (the server
  demands a client certificate signed by it, the client verifies the server with it).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from collections.abc import Callable, Iterable
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
