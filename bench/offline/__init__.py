"""The engine in-process (no server): mixed-adapter throughput, adapter scaling and LRU thrash, cold
adapter loads, speculative decoding, GGUF parity.
"""
