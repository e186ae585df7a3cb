"""Orbax drop-in: the multi-tier file contract, Orbax mode of the daemon and the store that ingests Orbax steps."""
