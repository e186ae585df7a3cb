"""The RAM-disk tier: this host's committed steps, peer copies and replica attestations."""
