"""A TCP proxy between SGLang's router and a decode server that, when armed, resets the next
``/generate`` requests instead of passing them on: the router's request to decode never arrives,
while its twin reaches prefill. That is the "decode half never arrives" fault: prefill's room
is claimed by no decode and must fail by kvfsm's unclaimed bound (``KVFSM_UNCLAIMED_S``), not
by the Bootstrapping deadline.

Everything else (health checks, ``/workers``, ``/abort_request``) passes through. It runs its
own event loop in a daemon thread, so the campaign arms it from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

__all__ = ["DecodeHalfDropper"]

_REQUEST = b"POST /generate"


class DecodeHalfDropper:
    def __init__(
        self,
        listen_port: int,
        target_port: int,
        host: str = "127.0.0.1",
        target_host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.target_host = target_host
        self.listen_port = listen_port
        self.target_port = target_port
        self._armed = 0
        self._lock = threading.Lock()
        #: Requests reset so far.
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-dropper", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.listen_port}"

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the decode dropper did not start")

    def arm(self, requests: int) -> None:
        """Reset the next ``requests`` ``/generate`` requests."""
        with self._lock:
            self._armed += requests

    def disarm(self) -> int:
        """Stop dropping; how many armed drops were left unused."""
        with self._lock:
            left, self._armed = self._armed, 0
        return left

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        elif not self._loop.is_closed() and self._thread.ident is None:
            self._loop.close()  # never started: its thread would have closed it

    def _take(self) -> bool:
        with self._lock:
            if self._armed <= 0:
                return False
            self._armed -= 1
            self.dropped += 1
            return True

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, self.host, self.listen_port, reuse_address=True)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _reset(writer)
            return
        back = asyncio.ensure_future(_pipe(up_reader, writer))
        try:
            while data := await reader.read(65536):
                # A keep-alive connection carries request after request: each new one starts
                # a read (the router writes a request's head in one go).
                if _REQUEST in data and self._take():
                    _reset(writer)
                    _reset(up_writer)
                    return
                up_writer.write(data)
                await up_writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            back.cancel()
            with contextlib.suppress(OSError):
                up_writer.close()
            with contextlib.suppress(OSError):
                writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (linger 0), as a peer that crashed or a middlebox that dropped it."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
