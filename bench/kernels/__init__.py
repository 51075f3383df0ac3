"""Kernel microbenchmarks: CPU LoRA (torch path vs native kernel), fused CPU ops, CPU paged attention, the
Triton kernels on a GPU.
"""
