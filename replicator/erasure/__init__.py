"""Erasure-coded redundancy for the peer tier (issue #35): the foundation and the host side (the coordinator's part is separate).

The choice: **a code group spans hosts, and each host's data stays where it is.** Splitting one host's step K
ways and storing the K + M fragments on other hosts would cost (K + M) / K of a copy (the data fragments
must leave the host, or its loss takes all K of them). Instead K + M or more hosts of different failure
domains form a code group and are coded in rotations (RAID-6 style, :mod:`.group`): each host's step, read as
one byte stream (:mod:`.stream`), is cut into K shards that are data fragments of K different rotations, and
each host holds the M parity shards of M rotations. Parity held is M/K of a copy (3+1: 1/3, 4+2: 1/2, plus the
padding of shorter steps to the group's longest), and any M hosts of a group may be lost together.

Modules: :mod:`.redundancy` (the ``copies:N | ec:K+M`` value), :mod:`.codec` (one stripe through pyeclib /
ISA-L), :mod:`.group` (layout, manifest, streaming encoder and decoder), :mod:`.placement` (which hosts form
which group, other slices first), :mod:`.stream` (a step directory as a byte stream and back), :mod:`.wire` (a
code group as the coordinator names it). The host side: :mod:`.holder` (this host's parity on its RAM disk),
:mod:`.remote` (byte ranges of other hosts' data and parity over the peer tier), :mod:`.host` (a ParityTask's
encoding, a rebuild of this host's data), :mod:`.duty` (what the heartbeat reports and does of it).
"""

from replicator.erasure.codec import DEFAULT_BACKEND, NotEnoughFragmentsError, StripeCodec
from replicator.erasure.group import (
    DEFAULT_STRIPE_BYTES,
    GroupDecoder,
    GroupEncoder,
    GroupLayout,
    GroupManifest,
    ParityStripe,
)
from replicator.erasure.placement import code_groups, group_of, max_fragments_in_a_slice
from replicator.erasure.redundancy import Redundancy
from replicator.erasure.stream import StepStream, unpack_stream

__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_STRIPE_BYTES",
    "GroupDecoder",
    "GroupEncoder",
    "GroupLayout",
    "GroupManifest",
    "NotEnoughFragmentsError",
    "ParityStripe",
    "Redundancy",
    "StepStream",
    "StripeCodec",
    "code_groups",
    "group_of",
    "max_fragments_in_a_slice",
    "unpack_stream",
]
