"""Per-token cost of the sampler's Exp(1) noise on CPU: the position-keyed splitmix64 hash the engine uses
(engine/sampling_noise.py) against a torch.Generator reseeded per row and `exponential_` (the
alternative counter scheme), for 32k and 152k vocabularies and 1 or 5 rows (a decode, or a verification
of 4 proposals). One thread, best of 5 runs of 20 calls.

    python -m bench.kernels.sampling_noise_cpu
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.sampling_noise import exponential_noise, position_key


def _best_ms(fn: Callable[[], object], calls: int = 20, runs: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def main() -> None:
    """Print milliseconds per call for each scheme, vocabulary and row count."""
    torch.set_num_threads(1)
    gen = torch.Generator()
    print("vocab rows  hash_ms  reseeded_generator_ms")
    for vocab in (32_000, 152_000):
        for rows in (1, 5):
            keys = torch.tensor([position_key(7, t) for t in range(rows)])

            def reseeded(rows: int = rows, vocab: int = vocab) -> torch.Tensor:
                q = torch.empty(rows, vocab)
                for r in range(rows):
                    gen.manual_seed(position_key(7, r) & ((1 << 63) - 1))
                    q[r].exponential_(generator=gen)
                return q

            h = _best_ms(lambda keys=keys, vocab=vocab: exponential_noise(keys, vocab))
            print(f"{vocab:6d} {rows:4d} {h:8.3f} {_best_ms(reseeded):8.3f}")


if __name__ == "__main__":
    main()
