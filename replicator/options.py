"""The replicator daemon's options: one documented dataclass, from flags, environment or a YAML file."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "MTC_"


class ConfigError(ValueError):
    """The daemon's configuration is unusable; the message is the one-line reason printed at exit."""


@dataclasses.dataclass(frozen=True)
class ReplicatorOptions:
    """Everything `mtc replicator` is configured with (flag ``--x-y`` = env ``MTC_X_Y`` = YAML key ``x-y``).

    Attributes:
      local_dir: this host's RAM-disk directory (steps, peer copies, the control socket).
      listen: ``HOST:PORT`` of the gRPC server (Peer, Coordinator on the coordinator host, health).
        Port 0 picks a free port; the daemon prints the address it listens on.
      advertise: ``HOST:PORT`` other hosts use to reach this one (default: the listen address).
      job: job name (recorded in manifests and bucket paths).
      rank, nodes: this host's rank and the number of hosts. Both unset = Orbax mode (from replicator.yaml).
      peers: static map rank -> HOST:PORT (``0=h0:7070,1=h1:7070``), or
      peer_address_template: e.g. ``{job}-workers-{slice}-{host}.{job}:7070`` (Kubernetes DNS); fields
        ``{job}``, ``{rank}``, ``{slice}`` and ``{host}`` (index in the slice).
      coordinator: ``HOST:PORT`` of the coordinator (default: rank 0's peer address). The host whose rank
        is ``coordinator_rank`` serves the coordinator.
      data_parallelism: number of slices holding data-parallel replicas.
      replicas: extra verified copies of each rank's step beyond itself (default 1).
      keep_local: committed steps kept per host (the newest complete step is always kept).
      backup_url: bucket URL (``file://``, ``gs://``, any fsspec URL); empty = no backup tier.
      backup_interval_minutes / backup_interval_steps: backup schedule (one of them).
      backup_keep: committed backups kept (default 3).
      restore_from_backup: force restoring this backed-up step.
      token_file: file holding the shared bearer token; every RPC without it is rejected.
      tls_cert, tls_key, tls_ca: TLS (mutual when a CA is given).
      insecure: allow listening beyond loopback with neither a token nor TLS (refused otherwise; see
        docs/security.md).
      heartbeat_seconds: how often a host reports to the coordinator (and at once after a change).
      rpc_timeout_seconds: deadline of each control RPC.
      transfer_timeout_seconds: deadline of one step copy.
      max_bytes_per_second: replication/backup throttle (0 = none); transfer_threads: parallel transfers.
      max_message_bytes: bound on gRPC messages.
      jax_coordinator: ``HOST:PORT`` written into ``jax-init-info.txt`` (Orbax mode outside GKE), with
      jax_process_id: this host's JAX process id for that file (required with ``jax_coordinator``).
      handshake_timeout_seconds: Orbax mode: how long one handshake may wait for every host to report and
        hold its data of the step to restore (keep it below Orbax's ``jax_initialization_timeout_seconds``).
      nice: niceness added to the daemon so that copies and uploads yield the CPU to training.
      bulk_priority: scheduling of the threads that copy and upload bulk bytes: ``idle`` (SCHED_IDLE,
        default), ``low`` (niceness 19) or ``normal``.
    """

    local_dir: Path
    listen: str = "0.0.0.0:7070"
    advertise: str = ""
    job: str = "mtc"
    rank: int | None = None
    nodes: int | None = None
    peers: dict[int, str] = dataclasses.field(default_factory=dict)
    peer_address_template: str = ""
    coordinator: str = ""
    coordinator_rank: int = 0
    data_parallelism: int = 1
    replicas: int = 1
    keep_local: int = 2
    backup_url: str = ""
    backup_interval_minutes: float = 0.0
    backup_interval_steps: int = 0
    backup_keep: int = 3
    restore_from_backup: int | None = None
    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    insecure: bool = False
    heartbeat_seconds: float = 2.0
    rpc_timeout_seconds: float = 10.0
    transfer_timeout_seconds: float = 600.0
    max_bytes_per_second: int = 0
    transfer_threads: int = 2
    max_message_bytes: int = 8 << 20
    jax_coordinator: str = ""
    nice: int = 10
    bulk_priority: str = "idle"
    jax_process_id: int | None = None
    handshake_timeout_seconds: float = 600.0

    @property
    def orbax_mode(self) -> bool:
        return self.rank is None and self.nodes is None

    def token(self) -> str | None:
        if not self.token_file:
            return None
        try:
            tok = Path(self.token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --token-file {self.token_file}: {e.strerror}") from e
        if not tok:
            raise ConfigError(f"--token-file {self.token_file} is empty")
        return tok

    def check_exposure(self) -> ReplicatorOptions:
        """Refuse (ConfigError) to serve beyond loopback with neither a token nor TLS, unless ``insecure``.

        Anyone who can reach an unauthenticated replicator can read every checkpoint it holds, forge
        reports and make the coordinator delete copies (docs/security.md).
        """
        host = self.listen.rpartition(":")[0].strip("[]")
        if self.insecure or self.token_file or self.tls_cert or _is_loopback(host):
            return self
        raise ConfigError(
            f"refusing to listen on {self.listen} without --token-file or --tls-cert/--tls-key: any host "
            "that reaches it could read every checkpoint and delete copies. Give a token (or TLS), listen "
            "on 127.0.0.1, or pass --insecure to accept that (see docs/security.md)"
        )

    def peer_address(self, rank: int) -> str:
        if rank in self.peers:
            return self.peers[rank]
        if self.peer_address_template:
            per_slice = (self.nodes or 1) // max(1, self.data_parallelism) or 1
            return self.peer_address_template.format(job=self.job, rank=rank, slice=rank // per_slice,
                                                     host=rank % per_slice)
        return ""

    def coordinator_address(self) -> str:
        return self.coordinator or self.peer_address(self.coordinator_rank)

    def validate(self) -> ReplicatorOptions:
        if (self.rank is None) != (self.nodes is None):
            raise ConfigError("--rank and --nodes go together (neither = Orbax mode, from replicator.yaml)")
        if self.nodes is not None:
            if self.nodes < 1:
                raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
            if not 0 <= self.rank < self.nodes:
                raise ConfigError(f"--rank {self.rank} is outside 0..{self.nodes - 1}")
            if self.data_parallelism < 1 or self.nodes % self.data_parallelism:
                raise ConfigError(f"--nodes {self.nodes} is not a multiple of --data-parallelism "
                                  f"{self.data_parallelism}")
            if not self.coordinator_address() and self.rank != self.coordinator_rank:
                raise ConfigError("no coordinator address: give --coordinator, --peers or --peer-address-template")
        if self.orbax_mode and not self.coordinator_address():
            raise ConfigError("Orbax mode needs the coordinator's address: give --coordinator, --peers or "
                              "--peer-address-template")
        if bool(self.jax_coordinator) != (self.jax_process_id is not None):
            raise ConfigError("--jax-coordinator and --jax-process-id go together")
        if self.jax_coordinator:
            _host_port(self.jax_coordinator, "--jax-coordinator")
            if self.jax_process_id < 0:
                raise ConfigError(f"--jax-process-id must be >= 0, got {self.jax_process_id}")
        if self.backup_interval_minutes and self.backup_interval_steps:
            raise ConfigError("give one of --backup-interval-minutes and --backup-interval-steps, not both")
        if self.backup_interval_minutes < 0 or self.backup_interval_steps < 0:
            raise ConfigError("backup intervals must be >= 0")
        if self.keep_local < 1 or self.backup_keep < 1 or self.replicas < 0:
            raise ConfigError("--keep-local and --backup-keep must be >= 1, --replicas >= 0")
        for name in ("heartbeat_seconds", "rpc_timeout_seconds", "transfer_timeout_seconds",
                     "handshake_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.bulk_priority not in ("idle", "low", "normal"):
            raise ConfigError(f"--bulk-priority must be idle, low or normal, got {self.bulk_priority!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            v = getattr(self, name)
            if v and not Path(v).is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {v}: no such file")
        _host_port(self.listen, "--listen")
        self.token()
        return self


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _host_port(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} must be HOST:PORT, got {value!r}")
    return host, int(port)


def parse_peers(value: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        rank, sep, addr = item.partition("=")
        if not sep or not rank.strip().isdigit():
            raise ConfigError(f"--peers entries are RANK=HOST:PORT, got {item!r}")
        _host_port(addr.strip(), "--peers address")
        out[int(rank)] = addr.strip()
    return out


_FIELDS = {f.name: f for f in dataclasses.fields(ReplicatorOptions)}


def _convert(name: str, raw: Any) -> Any:
    if raw is None:
        return None
    if name == "local_dir":
        return Path(raw)
    if name == "peers":
        return raw if isinstance(raw, dict) else parse_peers(str(raw))
    default = _FIELDS[name].default
    if name in ("rank", "nodes", "restore_from_backup", "jax_process_id"):
        return int(raw)
    if isinstance(default, bool):
        return str(raw).lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return str(raw)


_HELP = {
    "local_dir": "this host's RAM-disk directory (required)",
    "listen": "HOST:PORT to serve gRPC on; port 0 picks one (default 0.0.0.0:7070)",
    "advertise": "HOST:PORT other hosts use to reach this one (default: the listen address)",
    "job": "job name (default mtc)",
    "rank": "this host's rank (omit with --nodes for Orbax mode)",
    "nodes": "number of hosts",
    "peers": "static peer map RANK=HOST:PORT,RANK=HOST:PORT,...",
    "peer_address_template": "peer address template with {job}, {rank}, {slice}, {host} (index in slice), "
                             "e.g. {job}-workers-{slice}-{host}.{job}:7070",
    "coordinator": "HOST:PORT of the coordinator (default: the coordinator rank's peer address)",
    "coordinator_rank": "rank whose replicator serves the coordinator (default 0)",
    "data_parallelism": "number of slices holding data-parallel replicas (default 1)",
    "replicas": "extra verified copies of each rank's step (default 1)",
    "keep_local": "committed steps kept per host (default 2; the newest complete step is always kept)",
    "backup_url": "bucket URL: file:///path, gs://bucket/prefix or any fsspec URL (default: no backup)",
    "backup_interval_minutes": "back up the newest complete step every N minutes (default 30 when "
                               "--backup-url is set and no interval is given)",
    "backup_interval_steps": "back up every N steps (instead of minutes)",
    "backup_keep": "committed backups kept (default 3)",
    "restore_from_backup": "force restoring this backed-up step",
    "token_file": "file with the shared bearer token; RPCs without it are rejected",
    "tls_cert": "TLS certificate (PEM)",
    "tls_key": "TLS private key (PEM)",
    "tls_ca": "CA bundle (PEM): enables mutual TLS",
    "insecure": "allow listening beyond loopback without --token-file or TLS (refused otherwise)",
    "heartbeat_seconds": "report to the coordinator every N seconds (default 2)",
    "rpc_timeout_seconds": "deadline of each control RPC (default 10)",
    "transfer_timeout_seconds": "deadline of one step copy (default 600)",
    "max_bytes_per_second": "throttle for replication and backup, 0 = none",
    "transfer_threads": "parallel transfers (default 2)",
    "max_message_bytes": "bound on gRPC message size (default 8 MiB)",
    "bulk_priority": "CPU priority of the threads moving bulk bytes: idle (SCHED_IDLE, default), low (nice 19) "
                     "or normal",
    "nice": "raise the daemon's niceness by N so that copies and uploads yield the CPU to training "
            "(default 10; 0 = unchanged)",
    "jax_coordinator": "HOST:PORT written to jax-init-info.txt in Orbax mode (outside GKE)",
    "jax_process_id": "this host's JAX process id for jax-init-info.txt (with --jax-coordinator)",
    "handshake_timeout_seconds": "Orbax mode: bound on one handshake's restore planning (default 600)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per option (``--local-dir`` for ``local_dir``); unset flags fall back to env and YAML."""
    p.add_argument("--config", help="YAML file with any of the options (keys spelled like the flags)")
    for name in _FIELDS:
        if isinstance(_FIELDS[name].default, bool):  # a switch: ``--insecure``
            p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, action="store_const",
                           const="true", help=_HELP.get(name))
            continue
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=_HELP.get(name))


def from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> ReplicatorOptions:
    """Merge YAML file < environment (MTC_*) < flags, convert and validate."""
    environ = dict(os.environ if environ is None else environ)
    merged: dict[str, Any] = {}
    if getattr(ns, "config", None):
        try:
            data = yaml.safe_load(Path(ns.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read --config {ns.config}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"--config {ns.config} must hold a mapping")
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in _FIELDS:
                raise ConfigError(f"unknown option {k!r} in {ns.config}")
            merged[key] = v
    for key in _FIELDS:
        env = environ.get(ENV_PREFIX + key.upper())
        if env is not None:
            merged[key] = env
        flag = getattr(ns, key, None)
        if flag is not None:
            merged[key] = flag
    if "local_dir" not in merged:
        raise ConfigError("--local-dir is required")
    try:
        kwargs = {k: _convert(k, v) for k, v in merged.items()}
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"bad option value: {e}") from e
    return ReplicatorOptions(**kwargs).validate().check_exposure()
