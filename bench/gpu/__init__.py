"""The engine on a CUDA GPU: end-to-end parity and throughput, the newer features on the demo model,
decode-step profiles; `check.sh` runs them all.
"""
