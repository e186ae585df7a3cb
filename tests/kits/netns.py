"""A network namespace of the test's own: its loopback, its firewall rules, processes started inside it.

Faults are made there and nowhere else (the host's network is left as it was found): ``drop_port`` adds an
iptables rule that silently drops TCP packets to a port (a partition: no RST, no FIN, the sender retransmits),
``heal`` removes every rule. Needs root and ``ip``/``iptables``; :func:`available` says whether this machine
has them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence

COMMAND_TIMEOUT_SECONDS = 10.0


def available() -> str:
    """"" when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [c for c in ("ip", "iptables") if shutil.which(c) is None]
    return f"missing {', '.join(missing)}" if missing else ""


class NetNamespace:
    """``with NetNamespace() as ns``: a fresh namespace with loopback up, deleted on exit."""

    def __init__(self, prefix: str = "mtc-test") -> None:
        self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def __enter__(self) -> NetNamespace:
        _run(["ip", "netns", "add", self.name])
        try:
            self.run(["ip", "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], timeout=COMMAND_TIMEOUT_SECONDS, check=False,
                       capture_output=True)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (for ``subprocess.Popen``)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str]) -> str:
        return _run(self.command(argv))

    def drop_port(self, port: int) -> None:
        """Every TCP packet to ``port`` is dropped silently, in both directions of its connections."""
        self.run(["iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"])
        self.run(["iptables", "-A", "INPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"])

    def heal(self) -> None:
        self.run(["iptables", "-F", "INPUT"])


def _run(argv: Sequence[str]) -> str:
    res = subprocess.run(list(argv), timeout=COMMAND_TIMEOUT_SECONDS, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout
