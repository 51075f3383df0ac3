"""A loopback TCP proxy that tests put in front of PostgreSQL or Redis to break the link on purpose.

    with FaultProxy("127.0.0.1", 5432) as proxy:      # listens on 127.0.0.1:<proxy.port>
        proxy.refuse()      # close the listener (new connections: ECONNREFUSED) and cut every connection
        proxy.blackhole()   # keep accepting, but forward no byte either way (connections stall)
        proxy.cut()         # close every open connection once (the listener stays)
        proxy.restore()     # forward again (listening again after refuse(); held bytes flow on)

The proxy runs an asyncio loop in a daemon thread; each mode change is applied on that loop and has
taken effect when the call returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any

PASS, BLACKHOLE, REFUSE = "pass", "blackhole", "refuse"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = _free_port()
        self.mode = PASS
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # ---- control (from any thread) ---------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._setup())
        return self

    def refuse(self) -> None:
        self._call(self._set(REFUSE))

    def blackhole(self) -> None:
        self._call(self._set(BLACKHOLE))

    def restore(self) -> None:
        self._call(self._set(PASS))

    def cut(self) -> None:
        self._call(self._cut_all())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # ---- on the proxy's loop ---------------------------------------------------------------------

    async def _setup(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        await self._listen()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _set(self, mode: str) -> None:
        assert self._flowing is not None
        previous, self.mode = self.mode, mode
        if mode == REFUSE:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
                self._server = None
            await self._cut_all()
        elif previous == REFUSE:
            await self._listen()
        if mode == BLACKHOLE:
            self._flowing.clear()
        else:
            self._flowing.set()

    async def _cut_all(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut_all()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(writer)
        assert self._flowing is not None
        try:
            await self._flowing.wait()  # a black-holed proxy accepts, then says nothing
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        pumps = [self._pump(reader, up_writer), self._pump(up_reader, writer)]
        await asyncio.gather(*pumps, return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        while True:
            data = await reader.read(65536)
            if not data:
                break
            await self._flowing.wait()  # held (not dropped) while black-holed
            if writer.transport.is_closing():
                break
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.transport.abort()
