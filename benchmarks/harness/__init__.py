"""Pieces of the serving A/B harness (`python -m benchmarks.serving_regression`)."""
