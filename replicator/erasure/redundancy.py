"""The ``--redundancy`` value of a job: ``copies:N`` (whole copies) or ``ec:K+M`` (erasure-coded parity)."""

from __future__ import annotations

import dataclasses
import re

COPIES = "copies"
EC = "ec"
# Largest K + M accepted: a code group spans K + M hosts, and ISA-L's Reed-Solomon tables (GF(2^8)) allow up
# to 255 fragments, but a group that wide costs a read from K hosts per rebuilt stripe; 32 is plenty.
MAX_FRAGMENTS = 32
_SPEC = re.compile(r"^(?:copies:(?P<n>\d{1,4})|ec:(?P<k>\d{1,3})\+(?P<m>\d{1,3}))$")


@dataclasses.dataclass(frozen=True)
class Redundancy:
    """How a host's step is protected in the peer tier.

    ``copies:N``: N other hosts hold a whole copy (today's behaviour; N = 0 is no peer protection).
    ``ec:K+M``: each code group of hosts is protected by M parity shards per K data shards (see
    :mod:`replicator.erasure`), so any M hosts of a group may be lost together.
    """

    mode: str
    copies: int = 0
    k: int = 0
    m: int = 0

    def __post_init__(self) -> None:
        for name in ("copies", "k", "m"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"redundancy {name} must be an int, got {v!r}")
        if self.mode == COPIES:
            if self.copies < 0 or self.k or self.m:
                raise ValueError(f"copies:N needs N >= 0 and no K, M; got {self!r}")
        elif self.mode == EC:
            if self.copies:
                raise ValueError(f"ec:K+M takes no copies count; got {self!r}")
            if self.k < 1 or self.m < 1:
                raise ValueError(f"ec:K+M needs K >= 1 and M >= 1, got ec:{self.k}+{self.m}")
            if self.k + self.m > MAX_FRAGMENTS:
                raise ValueError(f"ec:K+M needs K + M <= {MAX_FRAGMENTS}, got ec:{self.k}+{self.m}")
        else:
            raise ValueError(f"redundancy mode must be {COPIES!r} or {EC!r}, got {self.mode!r}")

    @classmethod
    def parse(cls, spec: str) -> Redundancy:
        """``copies:N`` or ``ec:K+M`` (decimal, no spaces); a ValueError saying what is accepted if not."""
        m = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
        if m is None:
            raise ValueError(f"redundancy must be 'copies:N' (N >= 0) or 'ec:K+M' (K, M >= 1, K + M <= "
                             f"{MAX_FRAGMENTS}), got {spec!r}")
        if m.group("n") is not None:
            return cls(COPIES, copies=int(m.group("n")))
        return cls(EC, k=int(m.group("k")), m=int(m.group("m")))

    @classmethod
    def copies_of(cls, n: int) -> Redundancy:
        return cls(COPIES, copies=n)

    @classmethod
    def ec(cls, k: int, m: int) -> Redundancy:
        return cls(EC, k=k, m=m)

    @property
    def is_ec(self) -> bool:
        return self.mode == EC

    @property
    def ram_factor(self) -> float:
        """Bytes held on other hosts per byte of a host's own step: N for copies, M / K for ec (plus the
        padding of a group's shorter streams to its longest, see :class:`replicator.erasure.group.GroupGeometry`)."""
        return float(self.copies) if self.mode == COPIES else self.m / self.k

    @property
    def losses_survived(self) -> int:
        """Simultaneous host losses survived: any N for N copies placed on distinct hosts; any M of a code
        group for ec (losses spread over several groups are survived as long as no group loses more than M)."""
        return self.copies if self.mode == COPIES else self.m

    @property
    def min_hosts(self) -> int:
        """Hosts the job needs for this redundancy to be met: N + 1 for copies, K + M for ec."""
        return self.copies + 1 if self.mode == COPIES else self.k + self.m

    def __str__(self) -> str:
        return f"copies:{self.copies}" if self.mode == COPIES else f"ec:{self.k}+{self.m}"
