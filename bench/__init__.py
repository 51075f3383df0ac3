"""Benchmarks (not tests): offline throughput, adapter scaling, cold loads, online serving."""
