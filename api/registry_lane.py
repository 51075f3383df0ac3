"""`RegistryLane`: where the server runs blocking registry (database) calls, apart from everything else.

A stalled database must not take the worker threads that tokenization and other requests need. A lane
is a small thread pool of its own; a call waits at most `timeout` seconds for its answer (queueing
included), then the caller gets `RegistryUnavailable` (503) while the stuck thread is left to finish on
its own (its database statement and connect timeouts end it). So a black-holed database costs at most
`threads` threads and `timeout` seconds per lookup, and requests for active adapters — answered from
the in-memory active set — never wait behind it.

    lookups = RegistryLane("lookup", threads=8, timeout=6.0)
    active = await lookups.run(registry.adapters.active_adapter, name)
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lora_registry.errors import RegistryUnavailable

T = TypeVar("T")


class RegistryLane:
    def __init__(self, name: str, threads: int, timeout: float | None) -> None:
        self.name = name
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"loraplex-registry-{name}")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the lane's threads; `RegistryUnavailable` after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise RegistryUnavailable(
                f"the registry database did not answer within {self.timeout:g} s"
            ) from None

    def close(self) -> None:
        """Stop taking work; threads still stuck on the database are not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)
