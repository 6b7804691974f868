"""Serving and kernel benchmarks (run from the repository root: python -m bench.sweep ...)."""
