"""Orbax mode: the full allocation's addresses, so that a host Orbax renumbers keeps its daemon.

Orbax numbers the hosts of each job incarnation ``0..nodes-1`` slice-major (on Pathways: the *active*
workers), so losing any slice but the last renumbers the survivors. Our flags therefore describe the
**allocation**, not Orbax's current numbering: ``--peers`` / ``--peer-address-template`` /
``--coordinator-candidates`` are keyed by *allocation index* (slice-major place in the full allocation,
stable for the job's life; equal to Orbax's rank until the first elastic event). Per handshake:

* this host's allocation index (:func:`find_self`) gives its address (``--advertise`` default);
* the coordinator candidates are the first host of every allocation slice (:func:`candidates`); the first
  live one serves, so after a slice is lost the first surviving slice's first host takes over, whatever
  rank Orbax gave it;
* every other address (copies, restores) comes from the registrations at the coordinator, keyed by the
  current rank: nothing else needs the old -> new rank mapping.
"""

from __future__ import annotations

import socket

from replicator.options import ReplicatorOptions

# A template has no size: this host's index in it is looked for among the first this many.
MAX_TEMPLATE_SEARCH = 1 << 16


def _split(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _names_this_host(address: str, hostname: str, port: str) -> bool:
    """``address`` is this host by name: ``<hostname>[.<domain>]:<listen port>`` (a Pod's DNS name)."""
    host, p = _split(address)
    return bool(hostname) and p == port and (host == hostname or host.split(".")[0] == hostname.split(".")[0])


def find_self(opts: ReplicatorOptions, listen: str, hosts_per_slice: int) -> int | None:
    """This host's allocation index, or None when the address book does not say.

    ``--allocation-index`` if given; else the entry of ``--peers`` (or the template) equal to
    ``--advertise``, else to ``listen``, else naming this host (host name, listen port). An ambiguous
    answer (two entries) is None.
    """
    if opts.allocation_index is not None:
        return opts.allocation_index
    wanted = [a for a in (opts.advertise, listen) if a]
    hostname, port = socket.gethostname(), _split(listen)[1]

    def address(i: int) -> str:
        return opts.peer_address_template.format(job=opts.job, rank=i, slice=i // hosts_per_slice,
                                                 host=i % hosts_per_slice)

    if opts.peers:
        book = sorted(opts.peers.items())
    elif opts.peer_address_template:
        book = [(i, address(i)) for i in range(MAX_TEMPLATE_SEARCH)]
    else:
        return None
    for match in [lambda a, w=w: a == w for w in wanted] + [lambda a: _names_this_host(a, hostname, port)]:
        found = [i for i, a in book if match(a)]
        if len(found) == 1:
            return found[0]
        if found:
            return None
    return None


def candidates(opts: ReplicatorOptions, me: int, slices: int, hosts_per_slice: int) -> str:
    """``--coordinator-candidates`` for this incarnation: each allocation slice's first host, by allocation index.

    With ``--peers`` the allocation is the map; with a template (no size) the slices up to this host's
    own and at least ``slices``: every host's list is a prefix of the same sequence and holds every slice
    up to its own, so all hosts agree on the first live candidate (a surviving one is never below a lost
    one that only some hosts list). "" when the flags give no addresses.
    """
    if opts.peers:
        firsts = sorted(r for r in opts.peers if r % hosts_per_slice == 0)
    elif opts.peer_address_template:
        firsts = [s * hosts_per_slice for s in range(max(slices, me // hosts_per_slice + 1))]
    else:
        return ""
    return ",".join(f"{r}={opts.peer_address(r)}" for r in firsts)

