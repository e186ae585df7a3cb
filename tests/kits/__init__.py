"""Reusable test kits: local clusters of real replicator processes, storage fixtures, JAX worker launchers."""
