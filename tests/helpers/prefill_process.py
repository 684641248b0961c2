"""A prefill rank in its own OS process, for control-plane tests: an engine with a NixlTransport
and a listening ControlPlane, driven by a scripted scheduler that the parent commands over a pipe.

Its transport is fenced (``Leases``): every chunk is posted only under a valid lease of the decode
link that sent the pages. ``slow_post_s`` delays every ``make_prepped_xfer`` on the poster thread
(a queue of chunks then waits there, as under load), for the freeze tests. ``nofile`` (an absolute
soft ``RLIMIT_NOFILE``) or ``nofile_headroom`` (that many descriptors above those open) lowers the
process's descriptor limit once NIXL, the engine and the listener are up, so that a flood of
connections really meets EMFILE in ``accept()``.

Commands: ``("send", room, src_pages, chunks, src_aux)``: create a sender room for ``room`` and,
once decode's metadata has made it WaitingForInput, init it and send its pages in ``chunks``
chunks; ``("abort", room)``; ``("status", room)`` -> (status int, reason, settled);
``("fds",)`` -> (descriptors open, soft limit, hard limit; -1 open while none is left to count
them); ``("trim", collect=False)`` -> whether ``malloc_trim(0)`` gave memory back (after
``gc.collect()`` if asked); ``("quit",)``. The sources are deterministic: page p of buffer b holds
bytes derived from (b, p), so the parent can check what landed without asking.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfsm._child import ChildProcess
from kvfsm.control import ChannelConfig, ControlPlane, PrefillControl
from kvfsm.manager import router_for
from kvfsm.rooms import RoomEngine, SenderRoom
from kvfsm.states import KVPoll
from kvfsm.transport import Agent, AgentConfig, Leases, NixlTransport
from kvfsm.workload.buffers import Shape, make_buffers, make_layout

SHAPE = Shape(layers=2, num_pages=256, page_bytes=2048, aux_rows=32, aux_row_bytes=128)


def fill_sources(kv: list[npt.NDArray[np.uint8]], aux: npt.NDArray[np.uint8]) -> None:
    for b, buf in enumerate(kv):
        pages = np.arange(buf.shape[0], dtype=np.uint32)[:, None]
        cols = np.arange(buf.shape[1], dtype=np.uint32)[None, :]
        buf[:] = ((pages * 7 + cols * 13 + b * 101) & 0xFF).astype(np.uint8)
    rows = np.arange(aux.shape[0], dtype=np.uint32)[:, None]
    aux[:] = ((rows * 31 + np.arange(aux.shape[1], dtype=np.uint32)[None, :]) & 0xFF).astype(
        np.uint8
    )


def _drive(
    engine: RoomEngine,
    rooms: dict[int, tuple[SenderRoom, list[int], int, int, bool]],
    lock: threading.Lock,
    stop: threading.Event,
) -> None:
    """The scheduler: init and send each room once decode's pages arrived."""
    while not stop.is_set():
        with lock:
            for room, (sender, src, chunks, src_aux, sent) in list(rooms.items()):
                if not sent and sender.poll() is KVPoll.WaitingForInput:
                    sender.init(len(src), src_aux)
                    cuts = np.array_split(np.asarray(src, np.int32), max(1, chunks))
                    for part in cuts:
                        sender.send(part)
                    rooms[room] = (sender, src, chunks, src_aux, True)
        stop.wait(0.0005)  # the scheduler's polling period; a stop ends it at once


def _register(control: ControlPlane, url: str) -> Any:
    """Start keeping this rank registered (on the engine loop); returns the task."""
    import asyncio

    from kvfsm.control._discovery import Registration
    from kvfsm.registry import BootstrapClient

    async def start() -> Any:
        client = BootstrapClient(url)
        registration = Registration(client, control, engine="test", interval_s=0.5)
        await registration.register_once()

        async def keep() -> None:
            try:
                await registration.run()
            finally:
                await client.close()

        return asyncio.get_running_loop().create_task(keep())

    return start()


class _SlowPosts:
    """The raw NIXL agent, with a pause before every transfer is made (poster thread)."""

    def __init__(self, nixl: Any, delay_s: float) -> None:
        self._nixl = nixl
        self._delay_s = delay_s

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay_s)  # real time on purpose: a slow post is what it emulates
        return self._nixl.make_prepped_xfer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nixl, name)


def _open_fds() -> int:
    """Descriptors open here; -1 when listing them needs one more than the limit allows."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _malloc_trim() -> bool:
    """``malloc_trim(0)``: glibc keeps freed memory in its arenas (reused, but still resident);
    False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _limit_fds(nofile: int | None, headroom: int | None) -> None:
    """Lower the soft descriptor limit to ``nofile``, or to the descriptors open plus
    ``headroom`` (never raise it, never touch the hard one)."""
    if nofile is None and headroom is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nofile if nofile is not None else _open_fds() + (headroom or 0)
    if soft == resource.RLIM_INFINITY or want < soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _serve(
    conn: Connection,
    config: ChannelConfig,
    bootstrap_url: str | None,
    slow_post_s: float,
    nofile: tuple[int | None, int | None],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kv, aux = make_buffers(SHAPE)
    fill_sources(kv, aux)
    agent_config = AgentConfig()
    if slow_post_s:
        agent_config = AgentConfig(interpose=lambda nixl: _SlowPosts(nixl, slow_post_s))
    agent = Agent(f"prefill-{os.getpid()}", make_layout(kv, aux), agent_config)
    transport = NixlTransport(agent, leases=Leases(margin_s=config.fence_margin_s))
    control = PrefillControl(0, agent, transport=transport, config=config)
    engine = RoomEngine(router_for(control)).start()
    engine.call(control.started())
    registration = None
    if bootstrap_url is not None:
        registration = engine.call(_register(control, bootstrap_url))
    _limit_fds(*nofile)  # after NIXL, the engine and the listener are up
    conn.send(control.port)
    rooms: dict[int, tuple[SenderRoom, list[int], int, int, bool]] = {}
    lock, stop = threading.Lock(), threading.Event()
    driver = threading.Thread(target=_drive, args=(engine, rooms, lock, stop), daemon=True)
    driver.start()
    parent = os.getppid()
    try:
        while True:
            if not conn.poll(0.05):
                if os.getppid() != parent:
                    break
                continue
            request: Any = conn.recv()
            op = request[0]
            if op == "quit":
                break
            if op == "send":
                _, room, src, chunks, src_aux = request
                with lock:
                    rooms[room] = (engine.sender(room), list(src), chunks, src_aux, False)
                conn.send(True)
            elif op == "hold":  # a room that receives decode's pages but is never sent
                with lock:
                    rooms[request[1]] = (engine.sender(request[1]), [], 0, 0, True)
                conn.send(True)
            elif op == "abort":
                with lock:
                    rooms[request[1]][0].abort("prefill aborted it")
                conn.send(True)
            elif op == "status":
                sender = rooms[request[1]][0]
                conn.send((int(sender.poll()), sender.reason, sender.settled))
            elif op == "stats":
                conn.send(dict(control.stats))
            elif op == "transport":
                conn.send(transport.snapshot())
            elif op == "trim":  # give freed heap memory back to the OS (glibc), as RSS
                if len(request) > 1 and request[1]:
                    gc.collect()
                conn.send(_malloc_trim())
            elif op == "fds":
                conn.send((_open_fds(), *resource.getrlimit(resource.RLIMIT_NOFILE)))
            elif op == "entries":
                conn.send(engine.call(_entries(control)))
    except (EOFError, OSError):
        pass
    finally:
        stop.set()
        if registration is not None:
            engine.loop.call_soon_threadsafe(registration.cancel)
        engine.close()
        transport.close()
        agent.close()


async def _entries(control: ControlPlane) -> dict[str, int]:
    return control.entries()


class PrefillProcess(ChildProcess):
    def __init__(
        self,
        config: ChannelConfig,
        bootstrap_url: str | None = None,
        slow_post_s: float = 0.0,
        *,
        nofile: int | None = None,
        nofile_headroom: int | None = None,
    ) -> None:
        super().__init__(
            _serve,
            config,
            bootstrap_url,
            slow_post_s,
            (nofile, nofile_headroom),
            what="prefill",
        )
        self.port: int = self.greeting
