"""loraplex vs vLLM's CPU build on the identical workload: offline (`peer`) and online against both OpenAI
servers (`serve-peer`).
"""
