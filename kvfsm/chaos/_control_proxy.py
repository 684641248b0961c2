"""``ControlProxy``: a TCP man-in-the-middle for the control channel that breaks frames on
purpose, as the seeded :class:`~kvfsm.chaos._plan.FaultPlan` says.

A decode rank is pointed at the proxy instead of the prefill rank: :meth:`ProxyThread.resolver`
wraps the decode's resolver so that every prefill address it finds is replaced by a proxy
listener forwarding to it (one listener per upstream address, made on first use). Each accepted
connection gets its own upstream connection and two pumps, ``to_prefill`` and ``to_decode``.

A pump cuts the byte stream into frames by the channel's framing
(:mod:`kvfsm.control._frames` rule 1: ``length:u32 big-endian | body``; the proxy needs
nothing else, so it neither decodes nor checks a frame) and asks the plan, once per frame,
what to do with it (site = the pump's direction): forward, drop, duplicate, hold back behind
the next frame (reorder), delay (the frames behind it wait: a stream keeps its order), forward
part of it and cut the connection (truncate), flip one body byte (corrupt), or cut the
connection before it. A length the proxy cannot frame (over ``max_frame_bytes``) switches that
direction to raw pass-through, so a hostile or broken peer's bytes still reach the real
parser, which is what must refuse them.

A dropped or reordered frame breaks the promise TCP makes (nothing lost or reordered without
the connection failing). With a secret the channel notices: every frame after the Hellos carries
a sequence number under its MAC (protocol v3), so a dropped, duplicated or reordered frame is
refused at the next one and the connection is dropped, which is peer loss for its rooms.
Without a secret nothing can notice, and a room whose settle acknowledgement was dropped may
legitimately never settle: for the campaign's checks, the proxy remembers the rooms named by
frames it dropped or reordered, per direction (:meth:`ControlProxy.disordered`). It reads the
room id from the frame's msgpack payload without checking anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec

from kvfsm.chaos._plan import FaultPlan, FrameFault
from kvfsm.control import MAC_BYTES

__all__ = ["ControlProxy", "ProxyThread"]

_log = logging.getLogger("kvfsm.chaos")
_PREFIX: Final = 4
_READ: Final = 1 << 16
_MAX_FRAME: Final = 16 * 2**20 + 64  # the channel's own limit plus its envelope
_SEQ_BYTES: Final = 8

Address = tuple[str, int]
Resolved = tuple[str, int] | tuple[str, int, int]
Resolver = Callable[[int], Awaitable[Resolved]]


class _CutError(Exception):
    """The plan cut this connection."""


def room_of(frame: bytes) -> int | None:
    """The room a frame (``length | auth | mac | msgpack map``) names, or None: read, not
    checked, so a broken or hostile frame names nothing."""
    body = frame[_PREFIX:]
    if not body:
        return None
    # auth 0: no MAC; 1: a MAC (Hello); 2: a session frame, a MAC and an 8-byte sequence number.
    offset = 1 + {0: 0, 1: MAC_BYTES, 2: MAC_BYTES + _SEQ_BYTES}.get(body[0], 0)
    try:
        payload = msgspec.msgpack.decode(body[offset:])
    except msgspec.DecodeError:
        return None
    room = payload.get("room") if isinstance(payload, dict) else None
    return room if isinstance(room, int) and not isinstance(room, bool) else None


class ControlProxy:
    """Forwards and breaks control frames. Runs on the event loop that calls :meth:`listen`."""

    def __init__(self, plan: FaultPlan, *, host: str = "127.0.0.1") -> None:
        self.plan = plan
        self.host = host
        self.stats: Counter[str] = Counter()
        #: Rooms named by a frame this proxy dropped or reordered, by direction (proxy loop;
        #: read with :meth:`disordered` from other threads).
        self._disordered: dict[str, set[int]] = {"to_prefill": set(), "to_decode": set()}
        self._servers: dict[Address, asyncio.Server] = {}
        self._ports: dict[Address, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def listen(self, upstream: Address) -> int:
        """The proxy port that forwards to ``upstream`` (a listener is made on first use)."""
        port = self._ports.get(upstream)
        if port is not None:
            return port

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._connection(upstream, reader, writer)

        server = await asyncio.start_server(accepted, self.host, 0)
        port = int(server.sockets[0].getsockname()[1])
        self._servers[upstream] = server
        self._ports[upstream] = port
        return port

    def disordered(self, site: str, room: int) -> bool:
        """Whether a frame naming ``room`` going ``site`` was dropped or reordered. Any thread:
        a set membership test is atomic under the GIL, and a late answer only means the frame
        was not disordered yet."""
        return room in self._disordered[site]

    async def aclose(self) -> None:
        for server in self._servers.values():
            server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers.values():
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()
        self._ports.clear()

    async def _connection(
        self, upstream: Address, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        self.stats["connections"] += 1
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:
            self.stats["upstream_refused"] += 1
            client_w.close()
            return
        writers = (client_w, server_w)
        self._writers.update(writers)
        loop = asyncio.get_running_loop()
        pumps = [
            loop.create_task(self._pump("to_prefill", client_r, server_w)),
            loop.create_task(self._pump("to_decode", server_r, client_w)),
        ]
        self._tasks.update(pumps)
        try:
            # Either direction ending (EOF, error, a cut) ends the connection both ways.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for writer in writers:
                writer.close()
                self._writers.discard(writer)

    async def _pump(
        self, site: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Frame the bytes from ``reader`` and forward them, faults applied, to ``writer``."""
        buf = bytearray()
        held: bytes | None = None  # a frame held back for reordering
        raw = False
        hold_s = self.plan.control_rates.hold_max_s
        try:
            while True:
                try:
                    if held is not None:
                        data = await asyncio.wait_for(reader.read(_READ), hold_s)
                    else:
                        data = await reader.read(_READ)
                except TimeoutError:
                    assert held is not None
                    await self._send(writer, held)  # no next frame came: it goes anyway
                    held = None
                    continue
                if not data:
                    return
                if raw:
                    await self._send(writer, data)
                    continue
                buf += data
                while len(buf) >= _PREFIX:
                    size = int.from_bytes(buf[:_PREFIX], "big")
                    if size > _MAX_FRAME:
                        # Not a frame we can cut out: pass the stream through as it is.
                        self.stats["raw_passthrough"] += 1
                        raw = True
                        await self._send(writer, bytes(buf))
                        buf.clear()
                        break
                    if len(buf) < _PREFIX + size:
                        break
                    frame = bytes(buf[: _PREFIX + size])
                    del buf[: _PREFIX + size]
                    held = await self._apply(site, frame, writer, held)
        except _CutError:
            return
        except (ConnectionError, OSError):
            self.stats["connection_errors"] += 1
            return

    async def _apply(
        self, site: str, frame: bytes, writer: asyncio.StreamWriter, held: bytes | None
    ) -> bytes | None:
        """Forward ``frame`` as the plan says; return the frame now held back, if any."""
        fault, param = self.plan.frame_fault(site)
        self.stats[f"{site}:frames"] += 1
        if fault is not FrameFault.NONE:
            self.stats[f"{site}:{fault.value}"] += 1
        rates = self.plan.control_rates
        if fault is FrameFault.CUT:
            raise _CutError
        if fault is FrameFault.TRUNCATE:
            await self._send(writer, frame[: _PREFIX + int(param * (len(frame) - _PREFIX))])
            raise _CutError
        if fault is FrameFault.REORDER and held is None:
            self._disorder(site, frame)
            return frame  # goes out after the next frame
        out: list[bytes] = []
        if fault is FrameFault.DROP:
            self._disorder(site, frame)
        elif fault is FrameFault.DUPLICATE:
            out += [frame, frame]
        elif fault is FrameFault.CORRUPT and len(frame) > _PREFIX:
            body = bytearray(frame)
            at = _PREFIX + int(param * (len(frame) - _PREFIX))
            body[at] ^= 0xFF
            out.append(bytes(body))
        else:
            if fault is FrameFault.DELAY:
                await asyncio.sleep(param * rates.delay_max_s)
            out.append(frame)
        if held is not None:
            out.append(held)  # the frame held back goes after this one
        for piece in out:
            await self._send(writer, piece)
        return None

    def _disorder(self, site: str, frame: bytes) -> None:
        room = room_of(frame)
        if room is not None:
            self._disordered[site].add(room)

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()


class ProxyThread:
    """A :class:`ControlProxy` on its own event loop in a daemon thread, with blocking
    :meth:`start`/:meth:`close` and a resolver wrapper for a decode rank's control plane."""

    def __init__(self, plan: FaultPlan, *, host: str = "127.0.0.1") -> None:
        self.proxy = ControlProxy(plan, host=host)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvfsm-chaos-proxy", daemon=True
        )

    def start(self) -> ProxyThread:
        self._thread.start()
        return self

    def listen(self, upstream: Address, timeout: float = 10.0) -> int:
        """Blocking :meth:`ControlProxy.listen` (from any thread but the proxy's)."""
        future = asyncio.run_coroutine_threadsafe(self.proxy.listen(upstream), self._loop)
        return future.result(timeout)

    def resolver(self, inner: Resolver) -> Resolver:
        """A resolver that asks ``inner`` and answers with the proxy's address for it."""

        async def resolve(peer: int) -> Resolved:
            found = await inner(peer)
            host, port = found[0], found[1]
            listening = asyncio.run_coroutine_threadsafe(
                self.proxy.listen((host, port)), self._loop
            )
            proxy_port = await asyncio.wrap_future(listening)
            if len(found) == 3:
                return (self.proxy.host, proxy_port, found[2])
            return (self.proxy.host, proxy_port)

        return resolve

    def disordered(self, site: str, room: int) -> bool:
        return self.proxy.disordered(site, room)

    def stats(self) -> dict[str, int]:
        async def read() -> dict[str, int]:
            return dict(self.proxy.stats)

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(10)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.aclose(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
