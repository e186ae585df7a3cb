"""``HOST:PORT`` addresses, one parser for all: an IPv6 host in brackets (``[::1]:8476``), a port 0-65535."""

from __future__ import annotations


def split_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``, the host without brackets; ValueError naming ``address`` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def host_of(address: str) -> str:
    """The host of ``HOST:PORT`` (or of a bare host), without brackets; empty for ``:PORT``."""
    return address.rpartition(":")[0].strip("[]") if ":" in address else address


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
