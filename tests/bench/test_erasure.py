"""bench.erasure at a tiny size: the keys of its JSON line, every code round-tripped (it raises on a wrong
rebuild); times nothing. (The recovery on real hosts: test_erasure_recovery.py.)"""

from __future__ import annotations

import json

from bench import erasure


def test_one_json_line_with_every_key_per_code() -> None:
    out = erasure.run(mib=0.25, stripe_bytes=4096, codes=[(3, 1), (4, 2), (2, 1)], repeats=1, recovery_mib=0)
    json.dumps(out)
    for key in ("encode_gib_per_s_per_core", "decode_gib_per_s_per_core", "ram_for_redundancy_vs_copy",
                "losses_survived"):
        assert set(out[key]) == {"3+1", "4+2", "2+1"}, key
    assert out["losses_survived"] == {"3+1": 1, "4+2": 2, "2+1": 1}
    # M/K plus the shard's alignment to 64 bytes (0.1% of these 43 KiB hosts; nothing at real sizes)
    assert out["ram_for_redundancy_vs_copy"]["3+1"] <= 0.34
    assert out["ram_for_redundancy_vs_copy"]["4+2"] <= 0.502
    assert all(v > 0 for v in out["encode_gib_per_s_per_core"].values())
