"""Benchmarks: each module prints one JSON line of measurements (``python -m bench.<name>``)."""
