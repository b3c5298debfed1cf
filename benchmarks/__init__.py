"""Benchmarks: `python -m benchmarks` runs every `bench_*.py` module and writes results/."""
