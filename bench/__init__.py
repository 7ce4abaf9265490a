"""Benchmarks: each measures Tidal against a peer in the same run and prints ratios."""
