"""A framed byte channel over a loopback TCP socket between rank 0 and one worker process.

Each message is an 8-byte little-endian length and that many bytes. Workers are started as fresh
interpreters (`python -m engine.distributed.worker`, so nothing of the caller's `__main__` is re-imported)
and connect back to rank 0's listening socket; a closed socket on either side is an `EOFError`.
"""

from __future__ import annotations

import select
import socket
import struct

_LEN = struct.Struct("<Q")


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    @classmethod
    def connect(cls, port: int) -> Channel:
        return cls(socket.create_connection(("127.0.0.1", port)))

    def send_bytes(self, data: bytes) -> None:
        """Send one message (OSError when the peer is gone)."""
        self.sock.sendall(_LEN.pack(len(data)) + data)

    def recv_bytes(self) -> bytes:
        """The next message (blocks); EOFError when the peer closed the socket."""
        (n,) = _LEN.unpack(self._exact(_LEN.size))
        return self._exact(n)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the peer closed the channel")
            buf += chunk
        return bytes(buf)

    def poll(self, timeout: float) -> bool:
        """Whether a message (or the peer's close) is waiting, within `timeout` seconds."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def close(self) -> None:
        self.sock.close()
