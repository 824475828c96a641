"""Benchmarks: each bench/NAME.py runs as `python -m bench.NAME` and writes its results under
bench/results/NAME/; their shared helpers (and those the tests import) are in bench/lib/."""
