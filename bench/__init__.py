"""Benchmarks (not tests), grouped by what they measure; `loraplex bench --help` lists the commands.

common/ (shared helpers), offline/ (the engine in-process), kernels/, gpu/, serving/ (a running server),
peer/ (vs vLLM CPU), cluster/ (Ray Serve routing), structured/ (grammar masks). Results and the commands
that made them: docs/benchmarks.md.
"""
