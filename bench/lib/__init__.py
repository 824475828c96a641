"""Helpers of the benchmarks (and of the tests that check them): nothing here is a benchmark to run."""
