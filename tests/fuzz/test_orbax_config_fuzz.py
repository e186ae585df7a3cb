"""Property tests of the Orbax handshake file parser: any replicator.yaml gives a config or a ValueError.

``replicator.yaml`` is written by another program (Orbax) into a directory anyone on the host may write: a
malformed file must be reported (the daemon then tells Orbax the handshake failed), never crash the daemon.
"""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.orbax import contract as oc

SETTINGS = settings(max_examples=150, deadline=None)
VALID = {"job-name": "j", "framework": "orbax", "assume-data-parallelism": 2, "node-rank": 1, "nodes": 4,
         "peer-ranks": [3], "backup-interval-minutes": 30}

scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10),
                   st.sampled_from(["1e3", "on", "0x10", "-0", "1_000", ".inf", "~", "[]", "{}", "orbax"]))
value = st.recursive(scalar, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                    st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                     max_leaves=8)


def _parse(text: str) -> None:
    try:
        cfg = oc.ReplicatorConfig.from_yaml(text)
    except ValueError:
        return
    assert 0 <= cfg.node_rank < cfg.nodes and cfg.framework == "orbax"
    assert oc.ReplicatorConfig.from_dict(cfg.to_dict()) == cfg  # what is accepted round-trips


def test_the_valid_file_parses() -> None:
    assert oc.ReplicatorConfig.from_yaml(yaml.safe_dump(VALID)).node_rank == 1


@SETTINGS
@given(st.text(max_size=300))
def test_random_text(text: str) -> None:
    _parse(text)


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(VALID) + ["backup-interval-steps", "extra"]), value, max_size=9))
def test_random_mappings(d: dict) -> None:
    _parse(yaml.safe_dump(d))


@SETTINGS
@given(st.sampled_from(sorted(VALID) + ["backup-interval-steps"]), value, st.booleans())
def test_one_key_mutated_or_removed(key: str, new, remove: bool) -> None:
    d = dict(VALID)
    if remove:
        d.pop(key, None)
    else:
        d[key] = new
    _parse(yaml.safe_dump(d))
