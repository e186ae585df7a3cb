"""gRPC plumbing shared by every replicator service: server/channel factories, timeouts, error mapping.

``create_server`` builds (but does not start) a server with token auth, optional TLS, bounded message
sizes and the standard ``grpc.health.v1`` health service; ``make_channel`` is its client twin. Every
caller passes ``timeout=`` on every call, using the ``*_TIMEOUT_SECONDS`` constants below as defaults.
Servicer methods wrap domain errors with ``@map_errors`` (or call ``abort_for``) so that each becomes
a clear gRPC status instead of UNKNOWN.
"""

from __future__ import annotations

import errno
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from replicator.net.security import BearerTokenClientInterceptor, TlsOptions, TokenAuthInterceptor
from sidecar.checksums import ChecksumError
from sidecar.layout import ManifestError

log = logging.getLogger(__name__)

# Small control RPCs (list, manifest, ticket): a healthy peer answers in milliseconds.
RPC_TIMEOUT_SECONDS = 10.0
# Health probe.
HEALTH_TIMEOUT_SECONDS = 2.0
# A whole bulk transfer of one step (overridable per fetch): 64 GiB at 200 MiB/s throttled fits.
TRANSFER_TIMEOUT_SECONDS = 600.0
# Grace period given to in-flight RPCs by ``stop_server``.
SHUTDOWN_GRACE_SECONDS = 5.0
# THE default bound on a gRPC message, either end (`--max-message-bytes`): manifests of very large steps
# (thousands of shards with block crc32cs) and 1 MiB data chunks fit.
MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_MAX_WORKERS = 8

AddFn = Callable[[Any, grpc.Server], None]


# gRPC's reconnect backoff after a failed connection (its defaults: 1 s at first, growing to 120 s): a peer
# or coordinator that comes back (a restart, a replaced host, every daemon of an Orbax handshake restarting
# together) is reached again within 0.1 s at first and 5 s at most, not minutes later. A channel reconnects
# only while calls want it, so an idle channel to a dead host costs nothing. Not ``min_reconnect_backoff_ms``:
# gRPC uses it as the connect timeout too (20 s), and at 0.1 s connections on a loaded host timed out.
# A re-created Pod keeps its name (a JobSet's headless-Service hostname) under a new IP: a channel whose
# connection failed re-resolves the name, but gRPC's DNS resolver waits 30 s between resolutions by default,
# so after a JobSet restart two new replicators dialled their peers' old IPs for 30 s, each isolated as a
# coordinator of one (found on the real control plane, tests/cluster: hot-swap 40 s instead of 15 s). 1 s.
DNS_MIN_SECONDS_BETWEEN_RESOLUTIONS = 1.0
RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.dns_min_time_between_resolutions_ms", int(DNS_MIN_SECONDS_BETWEEN_RESOLUTIONS * 1000)),
]


# gRPC keepalive: a connection whose peer stopped answering (a partition, a host gone without a FIN) is closed
# within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS while calls are waiting on it, instead of hanging on TCP
# retransmission for tens of seconds after the link is back; the next call dials afresh (RECONNECT_OPTIONS).
# Clients ping only while calls are active (an idle channel costs nothing); servers accept pings that often
# and ping their clients too, so a stream to a vanished client does not hold a worker thread.
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 3000
CHANNEL_KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a call that waits for an answer
]
SERVER_KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),  # never answer a client's pings with GOAWAY
    ("grpc.keepalive_permit_without_calls", 1),
]


def _message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    if not isinstance(max_message_bytes, int) or max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes must be an int >= 1024, got {max_message_bytes!r}")
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def create_server(
    address: str,
    servicers: Sequence[tuple[AddFn, Any]],
    *,
    token: str | None = None,
    tls: TlsOptions | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> tuple[grpc.Server, int]:
    """Build a server bound to ``address`` (``"127.0.0.1:0"`` picks a free port); returns (server, port).

    ``servicers`` are ``(add_XServicer_to_server, servicer)`` pairs. The server is not started: call
    ``server.start()``. With ``token`` every method but the health service needs the bearer token.
    The health service reports SERVING for the whole server ("") and for each registered service.
    """
    interceptors = [TokenAuthInterceptor(token)] if token is not None else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-server"),
        interceptors=interceptors,
        options=[*_message_options(max_message_bytes), *SERVER_KEEPALIVE_OPTIONS, ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=max_workers * 4,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add_fn, servicer in servicers:
        add_fn(servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in _service_names(servicers):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        if tls is not None:
            port = server.add_secure_port(address, tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(errno.EADDRINUSE, f"cannot bind gRPC server to {address}: {e}") from e
    if port == 0:
        raise OSError(errno.EADDRINUSE, f"cannot bind gRPC server to {address}")
    server.health_servicer = health_servicer  # type: ignore[attr-defined]  # for NOT_SERVING on drain
    log.info(
        "gRPC server bound to %s (port %d, tls=%s, auth=%s)", address, port, tls is not None, bool(token)
    )
    return server, port


def _service_names(servicers: Sequence[tuple[AddFn, Any]]) -> list[str]:
    """Full names (``mtc.v1.Peer``) of the registered services, read from the generated modules."""
    names = []
    for add_fn, _ in servicers:
        short = add_fn.__name__.removeprefix("add_").removesuffix("Servicer_to_server")
        module = add_fn.__module__ or ""
        try:
            package = importlib.import_module(module.removesuffix("_grpc")).DESCRIPTOR.package
        except (ImportError, AttributeError):
            package = ""
        names.append(f"{package}.{short}" if package else short)
    return names


def stop_server(server: grpc.Server, grace_seconds: float = SHUTDOWN_GRACE_SECONDS) -> None:
    """Mark the server NOT_SERVING, let in-flight RPCs finish for ``grace_seconds``, then stop."""
    hs = getattr(server, "health_servicer", None)
    if hs is not None:
        hs.enter_graceful_shutdown()
    server.stop(grace_seconds).wait(grace_seconds + 1.0)


def make_channel(
    address: str,
    *,
    token: str | None = None,
    tls: TlsOptions | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to ``address`` ("host:port") adding the bearer token to every call when given;
    ``extra_options``: further gRPC channel arguments (e.g. a connection of its own)."""
    options = _message_options(max_message_bytes) + RECONNECT_OPTIONS + CHANNEL_KEEPALIVE_OPTIONS + list(extra_options)
    if tls is not None:
        channel = grpc.secure_channel(
            address, tls.channel_credentials(), options=options + tls.channel_options()
        )
    else:
        channel = grpc.insecure_channel(address, options=options)
    if token is not None:
        channel = grpc.intercept_channel(channel, BearerTokenClientInterceptor(token))
    return channel


# --------------------------------------------------------------------------- errors → status codes


class Unavailable(RuntimeError):
    """Every source of something was tried and none could serve it now (peers, the bucket, the coordinator):
    a transient condition the caller may retry."""


# Codes of a failed call to another service that a servicer passes on as they are: the request itself was
# bad, or what it names does not exist. Any other upstream failure is transient for our caller.
_PASSED_ON = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def details(exc: BaseException) -> str:
    """The human part of an error: a gRPC error's details, else ``str(exc)``."""
    return exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)


def status_for(exc: BaseException, default: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> grpc.StatusCode:
    """The gRPC status code for a domain error; ``default`` (INTERNAL unless told) for anything else.

    A ``grpc.RpcError`` (a call this servicer made failed) keeps INVALID_ARGUMENT/NOT_FOUND and is
    UNAVAILABLE otherwise; :class:`Unavailable` is UNAVAILABLE.
    """
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        return code if code in _PASSED_ON else grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ChecksumError):  # an OSError subclass: check before the OSError family
        return grpc.StatusCode.DATA_LOSS
    if isinstance(exc, FileNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, FileExistsError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, (ValueError, ManifestError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return default


def abort_for(context: grpc.ServicerContext, exc: BaseException,
              default: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> NoReturn:
    """Abort the current RPC with the status that fits ``exc`` (see :func:`status_for`; never returns)."""
    code = status_for(exc, default)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in RPC", exc_info=exc)
    if isinstance(exc, grpc.RpcError):
        context.abort(code, f"upstream {exc.code().name if hasattr(exc, 'code') else 'RPC'}: {details(exc)}")
    context.abort(code, f"{type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")  # context.abort always raises


F = TypeVar("F", bound=Callable[..., Any])
_DOMAIN_ERRORS = (OSError, ValueError)  # ChecksumError/ManifestError/FileNotFoundError/... are subclasses


def map_errors(method: F) -> F:
    """Decorator for servicer methods (unary or response-streaming): domain errors → ``abort_for``."""
    return _mapping(method, _DOMAIN_ERRORS, grpc.StatusCode.INTERNAL)


def map_errors_as_unavailable(method: F) -> F:
    """:func:`map_errors` for servicers that act by calling other services (peers, the bucket, the
    coordinator): domain errors, ``RuntimeError`` and failed upstream calls map by :func:`status_for`, and
    one it does not name is UNAVAILABLE (transient) rather than INTERNAL. (Not ``Exception``: the
    exception ``context.abort`` raises must pass.)"""
    return _mapping(method, (*_DOMAIN_ERRORS, RuntimeError, grpc.RpcError), grpc.StatusCode.UNAVAILABLE)


def _mapping(method: F, caught: tuple[type[BaseException], ...], default: grpc.StatusCode) -> F:
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except caught as e:
                abort_for(context, e, default)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except caught as e:
            abort_for(context, e, default)

    return wrapper  # type: ignore[return-value]
