"""The replicator daemon's options: one documented dataclass, from flags, environment or a YAML file."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from replicator.coordinator.fence import MAX_CANDIDATES
from replicator.erasure.placement import code_groups, max_fragments_in_a_slice
from replicator.erasure.redundancy import Redundancy
from replicator.net.address import host_of, split_host_port
from replicator.net.rpc import MAX_MESSAGE_BYTES
from replicator.net.security import read_token_file
from sidecar.layout import check_job_name
from sidecar.parse import parse_int

if TYPE_CHECKING:
    from replicator.erasure.group import GroupLayout
    from replicator.net.security import PodRankRule

ENV_PREFIX = "MTC_"
DEFAULT_REPLICAS = 1

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The daemon's configuration is unusable; the message is the one-line reason printed at exit."""


_NO_DEFAULT: Any = None


def _opt(help: str, default: Any = _NO_DEFAULT, *, factory: Any = None,
         choices: tuple[str, ...] | None = None) -> Any:
    """A field of :class:`ReplicatorOptions` with its one description (and choices) next to it."""
    meta = {"help": help, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class ReplicatorOptions:
    """Everything `mtc-replicator` is configured with: flag ``--x-y`` = env ``MTC_X_Y`` = YAML key ``x-y``.

    Each field carries its one description (the flag's help), and its choices where it has any; the
    field's type decides how a flag, environment or YAML value is parsed.
    """

    local_dir: Path = _opt("this host's RAM-disk directory (required)", None)  # type: ignore[assignment]
    listen: str = _opt('HOST:PORT to serve gRPC on; port 0 picks one (default 0.0.0.0:7070)', "0.0.0.0:7070")
    data_port: int = _opt("TCP port of the bulk data path (0 = any free port, the default; unused with TLS)", 0)
    advertise: str = _opt('HOST:PORT other hosts use to reach this one (default: the listen address)', "")
    job: str = _opt('job name (default mtc)', "mtc")
    rank: int | None = _opt("this host's rank (omit with --nodes for Orbax mode)", None)
    nodes: int | None = _opt('number of hosts', None)
    peers: dict[int, str] = _opt(
        'static peer map RANK=HOST:PORT,RANK=HOST:PORT,... (Orbax mode: the whole allocation, by allocation index)',
        factory=dict)
    peer_address_template: str = _opt(
        'peer address template with {job}, {rank}, {slice}, {host} (index in slice), e.g. '
        '{job}-workers-{slice}-{host}.{job}:7070',
        "")
    coordinator: str = _opt("HOST:PORT of the coordinator (default: the coordinator rank's peer address)", "")
    coordinator_rank: int = _opt('rank whose replicator serves the coordinator (default 0)', 0)
    data_parallelism: int = _opt('number of slices holding data-parallel replicas (default 1)', 1)
    replicas: int = _opt("extra verified copies of each rank's step (default 1); the same as --redundancy copies:N",
                         DEFAULT_REPLICAS)
    redundancy: str = _opt(
        "how each host's step is protected in the peer tier: copies:N (N other hosts hold a whole copy) or "
        "ec:K+M (erasure coding: every code group of K+M or more hosts holds M parity shards per K data shards, "
        "M/K of a copy in RAM; survives any M lost hosts per group; needs at least K+M hosts; not with Orbax "
        "mode). Default: copies:<--replicas>, today's behaviour (docs/peer.md, 'Erasure coding')",
        "")
    ec_rebuild: str = _opt(
        "with --redundancy ec:K+M, how a host rebuilds its own lost data from its code group: spread (the default: "
        "each other parity holder decodes a share) or pipelined (along chains of the other members, each link "
        "carrying about one fragment per stripe; spread if a chain fails). Either decodes here when fewer than "
        "two other holders answer (docs/peer.md, 'Erasure coding')",
        "spread", choices=("spread", "pipelined"))
    keep_local: int = _opt(
        'committed steps kept per host (default 2; the newest complete step is always kept)',
        2)
    backup_url: str = _opt(
        'bucket URL: file:///path, gs://bucket/prefix or any fsspec URL (default: no backup)',
        "")
    backup_interval_minutes: float = _opt(
        'back up the newest complete step every N minutes (default 30 when --backup-url is set '
        'and no interval is given)',
        0.0)
    backup_interval_steps: int = _opt('back up every N steps (instead of minutes)', 0)
    backup_keep: int = _opt('committed backups kept (default 3)', 3)
    restore_from_backup: int | None = _opt('force restoring this backed-up step', None)
    token_file: str = _opt('file with the shared bearer token; RPCs without it are rejected', "")
    tls_cert: str = _opt(
        "TLS certificate (PEM), as server and as client; under mutual TLS its URI SAN mtc://JOB/rank/N "
        "names this host's rank (docs/security.md)", "")
    tls_key: str = _opt('TLS private key (PEM)', "")
    tls_ca: str = _opt(
        "CA bundle (PEM): enables mutual TLS (every caller presents a certificate it signed; reports are "
        "bound to the rank a certificate names)", "")
    tls_rank_identity: str = _opt(
        "mutual TLS: a certificate naming mtc://JOB/rank/N may report only for rank N (one naming its Pod, "
        "mtc://JOB/pod/POD, only for the rank of --tls-pod-replicated-job's rule), an admin one "
        "(mtc://JOB/admin) never; one naming no rank is refused when this is 'require', or with 'auto' "
        "(default) when this replicator's own certificate names a rank; then admin actions (pin, restore, "
        "backup now, bad-copy reports) need the admin certificate too (docs/security.md)",
        "auto", choices=("auto", "require"))
    tls_pod_replicated_job: str = _opt(
        "mutual TLS with per-Pod certificates (URI SAN mtc://JOB/pod/POD, e.g. cert-manager's csi-driver): the "
        "JobSet replicated job whose Pods are the hosts; Pod JOB-<this>-S-H-xxxxx is rank S * hosts per slice "
        "+ H, any other Pod name is refused (default workers; docs/security.md)",
        "workers")
    tls_pod_hosts_per_slice: int = _opt(
        "hosts per slice in that rule (default 0 = --nodes / --data-parallelism; give it in Orbax mode, where "
        "those are Orbax's)",
        0)
    insecure: bool = _opt(
        'allow listening beyond loopback without --token-file or TLS (refused otherwise; docs/security.md)',
        False)
    heartbeat_seconds: float = _opt('report to the coordinator every N seconds (default 2)', 2.0)
    rpc_timeout_seconds: float = _opt('deadline of each control RPC (default 10)', 10.0)
    transfer_timeout_seconds: float = _opt('deadline of one step copy (default 600)', 600.0)
    bucket_timeout_seconds: float = _opt(
        'gs:// bucket: how long one request may wait for the service before it is retried (default 120)', 120.0)
    max_bytes_per_second: int = _opt('throttle for replication and backup, 0 = none', 0)
    transfer_threads: int = _opt('parallel transfers (default 2)', 2)
    max_message_bytes: int = _opt('bound on gRPC message size (default 64 MiB)', MAX_MESSAGE_BYTES)
    jax_coordinator: str = _opt('HOST:PORT written to jax-init-info.txt in Orbax mode (outside GKE)', "")
    nice: int = _opt(
        "raise the daemon's niceness by N so that copies and uploads yield the CPU to training "
        '(default 10; 0 = unchanged)',
        10)
    bulk_priority: str = _opt(
        "CPU priority of the threads moving bulk bytes: idle (SCHED_IDLE, default), low (nice 19) or normal",
        "idle", choices=("idle", "low", "normal"))
    jax_process_id: int | None = _opt(
        "this host's JAX process id for jax-init-info.txt (with --jax-coordinator)",
        None)
    handshake_timeout_seconds: float = _opt(
        "Orbax mode: bound on one handshake's restore planning (default 600)",
        600.0)
    coordinator_candidates: str = _opt(
        "ordered RANK=HOST:PORT,... of the hosts that may serve the coordinator; the first live one serves "
        "(default: each slice's first host when --peers or --peer-address-template give addresses, else "
        "--coordinator-rank; Orbax mode: labelled by allocation index); see docs/coordinator.md",
        "")
    allocation_index: int | None = _opt(
        "Orbax mode: this host's place in the full allocation (slice-major, stable for the job's life), which "
        "--peers, --peer-address-template and --coordinator-candidates are keyed by; Orbax's rank may change "
        "at an elastic event, this does not (default: the --peers/template entry equal to --advertise or "
        "--listen, or naming this host; see docs/orbax.md)",
        None)
    host_lost_seconds: float = _opt(
        "declare a host lost after N seconds without a report (default 0 = four heartbeat intervals, "
        "at least 10 s)",
        0.0)
    max_heartbeats_per_second: float = _opt(
        "the coordinator stretches the heartbeat interval to nodes / N seconds (default 200)",
        200.0)
    metrics_port: int | None = _opt(
        "serve Prometheus metrics at http://HOST:PORT/metrics, HOST as in --listen; 0 picks a free port "
        "(printed as METRICS HOST:PORT); unset = no endpoint",
        None)
    preemption_grace_seconds: float = _opt(
        "on SIGTERM (a preemption notice), keep running up to N seconds to back the newest complete step up "
        "to the bucket before exiting (default 25, below Kubernetes' 30 s terminationGracePeriodSeconds; "
        "0 = exit at once)",
        25.0)
    sigterm_flush: str = _opt(
        "always: every SIGTERM flushes (as above) unless `mtc preempt` recorded a restart; after-hook: only a "
        "SIGTERM that a preStop hook or a notice came before (`mtc manifests --restart in-place`: the kubelet "
        "restarts containers in place without hooks, and the Pod keeps its RAM disk)",
        "always", choices=("always", "after-hook"))

    @property
    def orbax_mode(self) -> bool:
        return self.rank is None and self.nodes is None

    @property
    def effective_redundancy(self) -> Redundancy:
        """The job's redundancy (:func:`resolve_redundancy`); the daemon hands it to the coordinator."""
        return resolve_redundancy(self.redundancy, self.replicas)

    def check_exposure(self) -> ReplicatorOptions:
        """Refuse (ConfigError) to serve beyond loopback with neither a token nor TLS, unless ``insecure``.

        Anyone who can reach an unauthenticated replicator can read every checkpoint it holds, forge
        reports and make the coordinator delete copies (docs/security.md).
        """
        host = host_of(self.listen)
        if self.insecure or self.token_file or self.tls_cert or _is_loopback(host):
            return self
        raise ConfigError(
            f"refusing to listen on {self.listen} without --token-file or --tls-cert/--tls-key: any host "
            "that reaches it could read every checkpoint and delete copies. Give a token (or TLS), listen "
            "on 127.0.0.1, or pass --insecure to accept that (see docs/security.md)"
        )

    def pod_rank_rule(self, job: str, nodes: int, data_parallelism: int) -> PodRankRule:
        """How per-Pod identities name ranks (``--tls-pod-replicated-job``, ``--tls-pod-hosts-per-slice``)."""
        from replicator.net.security import PodRankRule

        hosts = self.tls_pod_hosts_per_slice or max(1, nodes // max(1, data_parallelism))
        return PodRankRule(job, self.tls_pod_replicated_job, hosts)

    def token(self) -> str | None:
        if not self.token_file:
            return None

        try:
            return read_token_file(Path(self.token_file))
        except OSError as e:
            raise ConfigError(f"cannot read --token-file {self.token_file}: {e.strerror}") from e
        except ValueError as e:
            raise ConfigError(f"--token-file {self.token_file}: {e}") from e

    def peer_address(self, rank: int) -> str:
        if rank in self.peers:
            return self.peers[rank]
        if self.peer_address_template:
            per_slice = (self.nodes or 1) // max(1, self.data_parallelism) or 1
            return self.peer_address_template.format(job=self.job, rank=rank, slice=rank // per_slice,
                                                     host=rank % per_slice)
        return ""

    def coordinator_address(self) -> str:
        if not self.coordinator and self.coordinator_candidates:
            return next(iter(parse_peers(self.coordinator_candidates).values()), "")
        return self.coordinator or self.peer_address(self.coordinator_rank)

    def coordinator_candidate_list(self) -> list[tuple[int, str]]:
        """Ordered ``(rank, HOST:PORT)`` of the coordinator candidates (see ``coordinator_candidates``)."""
        if self.coordinator_candidates:
            return list(parse_peers(self.coordinator_candidates).items())
        if not self.coordinator and self.nodes and (self.peers or self.peer_address_template):
            per_slice = self.nodes // max(1, self.data_parallelism)
            ranks = [s * per_slice for s in range(max(1, self.data_parallelism))]
            out = [(r, self.peer_address(r)) for r in ranks]
            if all(a for _, a in out):
                return out
        return [(self.coordinator_rank, self.coordinator_address())]

    def validate(self) -> ReplicatorOptions:
        try:
            check_job_name(self.job, "--job")
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
        self._check_redundancy()
        if self.allocation_index is not None and self.allocation_index < 0:
            raise ConfigError(f"--allocation-index must be >= 0, got {self.allocation_index}")
        if self.coordinator_candidates:
            cands = parse_peers(self.coordinator_candidates)
            # Labelled by allocation index (Orbax mode) they may lie beyond the current node count.
            if self.nodes is not None and self.allocation_index is None and any(
                    not 0 <= r < self.nodes for r in cands):
                raise ConfigError(f"--coordinator-candidates ranks must be within 0..{self.nodes - 1}")
            if len(cands) > MAX_CANDIDATES:  # an epoch's low bits name its candidate
                raise ConfigError(f"--coordinator-candidates lists {len(cands)}; at most {MAX_CANDIDATES}")
        if self.host_lost_seconds < 0:
            raise ConfigError("--host-lost-seconds must be >= 0")
        for name in ("heartbeat_seconds", "rpc_timeout_seconds", "transfer_timeout_seconds",
                     "handshake_timeout_seconds", "max_heartbeats_per_second", "bucket_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            v = getattr(self, name)
            if v and not Path(v).is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {v}: no such file")
        if self.tls_rank_identity == "require" and not (self.tls_ca and self.tls_cert):
            raise ConfigError("--tls-rank-identity require needs mutual TLS: --tls-cert, --tls-key and --tls-ca")
        if self.tls_pod_hosts_per_slice < 0:
            raise ConfigError(f"--tls-pod-hosts-per-slice must be >= 0, got {self.tls_pod_hosts_per_slice}")
        if not re.fullmatch(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?", self.tls_pod_replicated_job):
            raise ConfigError(f"--tls-pod-replicated-job {self.tls_pod_replicated_job!r} is not a replicated job "
                              "name (a DNS label: lower-case letters, digits, '-')")
        _host_port(self.listen, "--listen")
        if not 0 <= self.data_port <= 65535:
            raise ConfigError(f"--data-port must be 0..65535, got {self.data_port}")
        if self.data_port and self.data_port == _host_port(self.listen, "--listen")[1]:
            raise ConfigError(f"--data-port {self.data_port} is the gRPC --listen port: give another")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        self.token()
        return self

    def _check_redundancy(self) -> None:
        """``--redundancy`` (see :func:`resolve_redundancy`); ec: not in Orbax mode, and a code group layout
        this job's hosts can form (:func:`job_code_groups`)."""
        red = self.effective_redundancy
        if not red.is_ec:
            return
        if self.orbax_mode:  # the node count may change between incarnations, and with it every code group
            raise ConfigError(f"--redundancy {red} is not supported in Orbax mode (elastic: the node count may "
                              "change between incarnations); use copies:N")
        if self.nodes is not None:
            job_code_groups(red, self.nodes, self.data_parallelism, warn=True)


def resolve_redundancy(redundancy: str, replicas: int) -> Redundancy:
    """The job's redundancy: ``redundancy`` (``copies:N`` | ``ec:K+M``), or ``copies:<replicas>`` when it is
    empty. ConfigError when malformed, or when a non-default ``replicas`` says otherwise."""
    if not redundancy:
        return Redundancy.copies_of(replicas)
    try:
        red = Redundancy.parse(redundancy)
    except ValueError as e:
        raise ConfigError(f"--redundancy: {e}") from None
    if replicas != DEFAULT_REPLICAS and red != Redundancy.copies_of(replicas):
        raise ConfigError(f"--replicas {replicas} (= copies:{replicas}) and --redundancy {red} disagree: give "
                          "one of them")
    return red


def job_code_groups(red: Redundancy, nodes: int, slices: int, *, warn: bool = False) -> tuple[GroupLayout, ...]:
    """The code groups of an ec job of ``nodes`` hosts in ``slices`` slices (ConfigError when it has fewer
    than K+M hosts); ``warn``: log a warning when a whole slice lost is not survived."""
    if nodes < red.min_hosts:
        raise ConfigError(f"--redundancy {red} needs at least {red.min_hosts} hosts (K+M); the job has "
                          f"{nodes}: use a smaller K+M or copies:N")
    try:
        groups = code_groups(slices, nodes // slices, red.k, red.m)
    except ValueError as e:
        raise ConfigError(f"--redundancy {red}: {e}") from None
    worst = max(max_fragments_in_a_slice(g, nodes // slices) for g in groups)
    if warn and slices > 1 and worst > red.m:
        log.warning("--redundancy %s over %d slices of %d hosts: a code group has %d fragments of one rotation "
                    "in one slice, more than M=%d, so a whole slice lost is NOT survived (any %d lost hosts per "
                    "group are); more slices or a larger M would be", red, slices, nodes // slices, worst,
                    red.m, red.m)
    return groups


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _host_port(value: str, what: str) -> tuple[str, int]:
    try:
        return split_host_port(value)
    except ValueError:
        raise ConfigError(f"{what} must be HOST:PORT, got {value!r}") from None


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_TYPES = typing.get_type_hints(ReplicatorOptions)


def _convert(name: str, raw: Any) -> Any:
    """Parse one option by its field's type; errors name the flag (``--rank: expected an integer, ...``)."""
    if raw is None:
        return None
    flag = _flag(name)
    typ = _TYPES[name]
    base = next((a for a in typing.get_args(typ) if a is not type(None)), typ)  # X | None -> X
    if base is Path:
        return Path(raw)
    if base is bool:
        if isinstance(raw, bool):
            return raw
        word = str(raw).strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{flag}: expected true or false, got {raw!r}")
    if name == "peers":
        return raw if isinstance(raw, dict) else parse_peers(str(raw))
    if base is int:
        try:
            return parse_int(raw, flag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if base is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{flag}: expected a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag}: expected a number, got {raw!r}") from None
    value = str(raw)
    choices = _FIELDS[name].metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{flag}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per option (``--local-dir`` for ``local_dir``); unset flags fall back to env and YAML."""
    p.add_argument("--config", help="YAML file with any of the options (keys spelled like the flags)")
    for name in _FIELDS:
        meta = _FIELDS[name].metadata
        if _TYPES[name] is bool:  # a switch: ``--insecure``
            p.add_argument(_flag(name), dest=name, default=None, action="store_const", const=True,
                           help=meta["help"])
            continue
        p.add_argument(_flag(name), dest=name, default=None, help=meta["help"], choices=meta["choices"])


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
    kwargs = {k: _convert(k, v) for k, v in merged.items()}
    opts = ReplicatorOptions(**kwargs).validate()
    red = opts.effective_redundancy
    if not red.is_ec and opts.replicas != red.copies:  # --redundancy copies:N alone: --replicas is N too
        opts = dataclasses.replace(opts, replicas=red.copies)
    return opts
