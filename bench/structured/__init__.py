"""Structured output on CPU: the per-token grammar mask cost of llguidance, xgrammar, outlines-core."""
