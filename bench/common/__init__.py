"""Shared by the benchmarks: the workload (random Llama, adapters, prompts, timed runs), progress bars,
plots, CPU hogs, settling, the HF PEFT baseline.
"""
