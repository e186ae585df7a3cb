"""Test kit: the coordinator and its admin layer served over (mutual) TLS on 127.0.0.1, and what the
identity tests ask of it: a heartbeat as some rank, and a comparable picture of what a heartbeat could change."""

from __future__ import annotations

import grpc

from mtc_rpc import admin_pb2_grpc, tier_pb2
from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.admin import ADMIN_ACTIONS, AdminServicer
from replicator.coordinator.client import CoordinatorClient
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.net import rpc
from replicator.net.security import AdminGate, RankAuthorizer, TlsOptions
from tests.kits.certs import CertAuthority, CertPair


class ServedCoordinator:
    """``Coordinator`` + ``AdminServicer`` (behind :class:`AdminGate` when there is an authorizer) on a
    loopback port, presenting ``server_cert``; ``mutual``: clients must present a certificate of ``ca``."""

    def __init__(self, ca: CertAuthority, topology: JobTopology, authorizer: RankAuthorizer | None,
                 server_cert: CertPair, *, mutual: bool = True):
        self.ca = ca
        self.coord = Coordinator(topology, "t", authorizer=authorizer)
        self.admin = AdminServicer(self.coord)
        tls = TlsOptions(server_cert.cert, server_cert.key, ca.ca_file if mutual else None)
        self.server, port = rpc.create_server(
            "127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, self.admin.wrap(self.coord)),
                            (admin_pb2_grpc.add_AdminServicer_to_server,
                             AdminGate(self.admin, authorizer, ADMIN_ACTIONS) if authorizer else self.admin)],
            tls=tls)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channels: list[grpc.Channel] = []

    def stubs(self, pair: CertPair | None) -> tuple[pb_grpc.CoordinatorStub, admin_pb2_grpc.AdminStub]:
        """Stubs presenting ``pair`` (None: no client certificate)."""
        tls = pair.tls(self.ca.ca_file) if pair else TlsOptions(ca_file=self.ca.ca_file)
        ch = rpc.make_channel(self.address, tls=tls)
        self.channels.append(ch)
        return pb_grpc.CoordinatorStub(ch), admin_pb2_grpc.AdminStub(ch)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.server.stop(0)


def beat(stub: pb_grpc.CoordinatorStub, rank: int, step: int = 5, address: str = "") -> pb.HeartbeatResponse:
    """A full report as ``rank``: registered at ``address``, holding its own data of ``step``."""
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1000 + rank,
                              address=address or f"127.0.0.1:{7000 + rank}", newest_saved_step=step,
                              full_report=True, inventory_digest=f"d{rank}",
                              holdings=[pb.Holding(owner_rank=rank, step=step, content_hash=f"h{rank}", size=10,
                                                   tier=tier_pb2.TIER_LOCAL)])
    resp = stub.Heartbeat(req, timeout=10)
    if resp.acked_digest != req.inventory_digest and resp.epoch != req.known_epoch:
        req.known_epoch = resp.epoch  # as the daemon does: it reports again under the epoch it just accepted
        resp = stub.Heartbeat(req, timeout=10)
    return resp


def picture(coord: Coordinator, nodes: int) -> tuple:
    """Everything a heartbeat could change, as comparable values."""
    st = coord.state
    return (dict(st.registered), st.reported_count, coord.host_addresses(), dict(coord._digest),
            {r: sorted((h.owner_rank, h.step, h.content_hash) for h in st.holdings_of(r)) for r in range(nodes)},
            st.known_steps(), coord.max_epoch_seen, coord.preemption_noticed)


def host_rows(client: CoordinatorClient) -> dict[int, tuple]:
    """What a forged report could change, per rank (from the status RPC): address, incarnation, reported,
    steps, pieces."""
    return {h.rank: (h.address, h.incarnation, h.inventory_reported, list(h.steps), h.pieces)
            for h in client.status(hosts=True).hosts}
