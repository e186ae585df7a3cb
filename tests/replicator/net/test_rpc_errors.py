"""The one error -> gRPC status mapping (replicator/net/rpc.py), used by every servicer."""

from __future__ import annotations

import errno

import grpc
import pytest

from replicator.net import rpc
from sidecar.checksums import ChecksumError
from sidecar.layout import ManifestError


class _UpstreamError(grpc.RpcError):
    """A failed call to another service, as grpc raises it (a fake: a real one needs a failing server)."""

    def __init__(self, code: grpc.StatusCode, details: str = "upstream says no"):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("exc,code", [
    (FileNotFoundError("x"), grpc.StatusCode.NOT_FOUND),
    (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ManifestError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (ChecksumError("f", 1, 2), grpc.StatusCode.DATA_LOSS),
    (OSError(errno.ENOSPC, "full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (rpc.Unavailable("every source failed"), grpc.StatusCode.UNAVAILABLE),
    (_UpstreamError(grpc.StatusCode.NOT_FOUND), grpc.StatusCode.NOT_FOUND),
    (_UpstreamError(grpc.StatusCode.INVALID_ARGUMENT), grpc.StatusCode.INVALID_ARGUMENT),
    (_UpstreamError(grpc.StatusCode.DEADLINE_EXCEEDED), grpc.StatusCode.UNAVAILABLE),
    (_UpstreamError(grpc.StatusCode.INTERNAL), grpc.StatusCode.UNAVAILABLE),
])
def test_status_for(exc: BaseException, code: grpc.StatusCode) -> None:
    assert rpc.status_for(exc) == code


def test_unnamed_errors_take_the_default() -> None:
    assert rpc.status_for(RuntimeError("x")) == grpc.StatusCode.INTERNAL
    assert rpc.status_for(RuntimeError("x"), grpc.StatusCode.UNAVAILABLE) == grpc.StatusCode.UNAVAILABLE
    assert rpc.details(_UpstreamError(grpc.StatusCode.INTERNAL, "why")) == "why"
