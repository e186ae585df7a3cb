"""Print the `peers:` map of deploy/common/configmap.yaml for a JobSet of N slices x M hosts.

JobSet (spec.network.enableDNSHostnames) gives worker Pod (slice s, host h) the DNS name
``<jobset>-<replicatedJob>-<s>-<h>.<subdomain>`` (subdomain defaults to the JobSet name) and the
replicator's rank is ``s * M + h`` (slice-major, as Pathways and Orbax number hosts). ``mtc replicator
--peer-address-template`` only knows ``{job}`` and ``{rank}``, which cannot express ``s`` and ``h`` once
there is more than one slice, so the deployment lists every rank's address explicitly:

    python deploy/peers.py --jobset mtc-train --slices 2 --hosts-per-slice 2
"""

from __future__ import annotations

import argparse
import re
import sys

# RFC 1123 label: what a JobSet name, replicated-job name and subdomain must be.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def pod_hostname(jobset: str, replicated_job: str, job_index: int, pod_index: int) -> str:
    """JobSet's hostname for the Pod ``pod_index`` of child Job ``job_index``."""
    return f"{jobset}-{replicated_job}-{job_index}-{pod_index}"


def peer_addresses(
    jobset: str,
    slices: int,
    hosts_per_slice: int,
    *,
    replicated_job: str = "workers",
    subdomain: str | None = None,
    port: int = 7070,
) -> dict[int, str]:
    """Rank -> ``HOST:PORT`` for every worker; rank = slice * hosts_per_slice + host."""
    for what, name in (("jobset", jobset), ("replicated job", replicated_job), ("subdomain", subdomain or jobset)):
        if not _DNS_LABEL.match(name) or len(name) > 63:
            raise ValueError(f"{what} name {name!r} is not a DNS label (lower-case letters, digits, '-')")
    if slices < 1 or hosts_per_slice < 1:
        raise ValueError(f"need at least one slice and one host per slice, got {slices} x {hosts_per_slice}")
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    sub = subdomain or jobset
    out: dict[int, str] = {}
    for s in range(slices):
        for h in range(hosts_per_slice):
            host = pod_hostname(jobset, replicated_job, s, h)
            if len(host) > 63:
                raise ValueError(f"Pod hostname {host!r} is longer than 63 characters: shorten the JobSet name")
            out[s * hosts_per_slice + h] = f"{host}.{sub}:{port}"
    return out


def render_yaml(peers: dict[int, str], indent: int = 4) -> str:
    """The ``peers:`` block as it appears inside the ConfigMap's config.yaml."""
    pad = " " * indent
    lines = [f"{pad}peers:"] + [f"{pad}  {rank}: {addr}" for rank, addr in sorted(peers.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobset", required=True, help="JobSet metadata.name")
    p.add_argument("--slices", type=int, required=True, help="replicas of the workers replicated job")
    p.add_argument("--hosts-per-slice", type=int, required=True, help="completions of each worker Job")
    p.add_argument("--replicated-job", default="workers")
    p.add_argument("--subdomain", help="spec.network.subdomain (default: the JobSet name)")
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--indent", type=int, default=4, help="spaces before 'peers:' (4 = inside the ConfigMap)")
    args = p.parse_args(argv)
    try:
        peers = peer_addresses(args.jobset, args.slices, args.hosts_per_slice,
                               replicated_job=args.replicated_job, subdomain=args.subdomain, port=args.port)
    except ValueError as e:
        print(f"peers.py: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render_yaml(peers, args.indent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
