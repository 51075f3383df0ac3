"""A running loraplex server: online Poisson serving (TTFT/TPOT), the API process's accounting and rate-
limit cost.
"""
