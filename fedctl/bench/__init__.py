"""Benchmark harness of ``fedctl bench``."""
