"""Hostile peers against a prefill rank in its own OS process (law 7): real sockets on
loopback, real NIXL, a real decode rank that must keep moving rooms meanwhile.

* descriptors: a flood of idle connections past the process's ``RLIMIT_NOFILE`` (``accept()``
  meets EMFILE and backs off), and a flood past the unauthenticated cap (the oldest are shed);
* memory before authentication: connections that announce a huge Hello, or a Hello just under
  ``hello_max_bytes``, and never finish it;
* held page lists are a per-peer quota: one peer filling it does not refuse another's;
* replay: a recorded decode stream replayed by a stranger on its own connection, and one recorded
  frame replayed inside the real connection;
* a long abort reason is clipped at the source, not refused as a bad frame.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import selectors
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import numpy as np
import pytest

from kvfsm.control import ChannelConfig, ControlPlane
from kvfsm.control._channel import Link as _Link
from kvfsm.control._frames import Frame, RoomMetadata, RoomOutcome
from kvfsm.rooms import ReceiverRoom
from kvfsm.states import TERMINAL, KVPoll
from tests.helpers.control import Decode
from tests.helpers.prefill_process import PrefillProcess
from tests.helpers.waiting import stays_true_sync, wait_until_sync

SECRET = b"a shared secret of 32 bytes....."
PLAIN = ChannelConfig()
SIGNED = ChannelConfig(secret=SECRET)
MIB = 1 << 20
KIB = 1 << 10

#: Reasons a room fails with when the attack reached it: the link, or the way to it, was lost.
ATTACK_REASONS = ("cannot reach", "peer lost", "silent for", "closed", "refused", "shed")


def status(prefill: PrefillProcess, room: int) -> tuple[int, str, bool]:
    result: tuple[int, str, bool] = prefill.ask("status", room)
    return result


def stats(prefill: PrefillProcess) -> dict[str, int]:
    result: dict[str, int] = prefill.ask("stats")
    return result


def ended(receivers: Sequence[ReceiverRoom]) -> Callable[[], bool]:
    return lambda: all(r.poll() in TERMINAL for r in receivers)


def move_rooms(
    prefill: PrefillProcess, decode: Decode, rooms: Sequence[int], batch: int = 16
) -> dict[int, str]:
    """Move every room from prefill to decode, ``batch`` at a time (slot ``i`` of a batch: source
    pages 100+2i, 101+2i and aux row i, destination pages 2i, 2i+1 and aux row i; half the page
    lists arrive before prefill's room exists). Returns the reason of each room that did not end
    in Success with the right bytes."""
    failed: dict[int, str] = {}
    for start in range(0, len(rooms), batch):
        plan: list[tuple[int, ReceiverRoom, list[int], list[int], int]] = []
        for slot, room in enumerate(rooms[start : start + batch]):
            src, dst = [100 + 2 * slot, 101 + 2 * slot], [2 * slot, 2 * slot + 1]
            if room % 2:
                receiver = decode.receive(room, dst, aux_row=slot)
                prefill.ask("send", room, src, 1 + room % 2, slot)
            else:
                prefill.ask("send", room, src, 1 + room % 2, slot)
                receiver = decode.receive(room, dst, aux_row=slot)
            plan.append((room, receiver, src, dst, slot))
        wait_until_sync(ended([receiver for _, receiver, *_ in plan]), timeout=60)
        for room, receiver, src, dst, slot in plan:
            if receiver.poll() is not KVPoll.Success:
                failed[room] = receiver.reason
            elif not decode.landed(src, dst, slot, slot):
                failed[room] = "succeeded, but the bytes differ"
        wait_until_sync(lambda: decode.engine.stats()["live"] == 0, timeout=30)
    return failed


def assert_rooms_moved(failed: dict[int, str], total: int) -> None:
    """At least 99% of ``total`` rooms succeeded, and none failed because of the attack."""
    assert len(failed) <= total // 100, failed
    by_attack = {r: why for r, why in failed.items() if any(s in why for s in ATTACK_REASONS)}
    assert by_attack == {}, by_attack


@contextlib.contextmanager
def own_nofile(at_least: int) -> Iterator[None]:
    """Raise this process's soft descriptor limit to ``at_least`` (at most the hard limit) for the
    duration, then restore it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = at_least if hard == resource.RLIM_INFINITY else min(hard, at_least)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _gone(sock: socket.socket) -> bool:
    """Drain what the far end sent (prefill's Hello); True once it closed the connection."""
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset: closed with our bytes unread
        return True


class Crowd:
    """``n`` connections to ``port`` that send nothing: opened at once and held until closed."""

    def __init__(self, port: int, n: int) -> None:
        self.socks: list[socket.socket] = []
        try:
            for _ in range(n):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.setblocking(False)
                self.socks.append(sock)
        except BaseException:
            self.close()
            raise

    def closed_by_peer(self) -> int:
        return sum(_gone(sock) for sock in self.socks)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks.clear()


class Pressure:
    """``n`` connections that each announce a frame of ``length`` bytes and send up to ``body``
    bytes of it, as much as each socket takes (non-blocking), and never finish it: a thread keeps
    topping them up until :meth:`close`. Counts the connections the far end closed."""

    def __init__(self, port: int, n: int, length: int, body: int) -> None:
        self._prefix = struct.pack(">I", length)
        self._total = len(self._prefix) + body
        self._chunk = b"\xa5" * (64 * KIB)
        self.socks: list[socket.socket] = []
        self._sent: list[int] = []
        self._gone: list[bool] = []
        self._stop = threading.Event()
        #: Set once every connection has pushed as much as its socket takes (or is gone).
        self.saturated = threading.Event()
        #: When the far end had closed every one of them (``time.monotonic()``).
        self.all_closed_at: float | None = None
        try:
            for _ in range(n):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.setblocking(False)
                self.socks.append(sock)
                self._sent.append(0)
                self._gone.append(False)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._push, name="pressure", daemon=True)
        self._thread.start()

    @property
    def sent(self) -> int:
        return sum(self._sent)

    def _next(self, i: int) -> bytes:
        done = self._sent[i]
        if done < len(self._prefix):
            return self._prefix[done:]
        return self._chunk[: self._total - done]

    def _push(self) -> None:
        while not self._stop.is_set():
            blocked = []
            for i, sock in enumerate(self.socks):
                if self._gone[i]:
                    continue
                if _gone(sock):
                    self._gone[i] = True
                    continue
                try:
                    while self._sent[i] < self._total:
                        self._sent[i] += sock.send(self._next(i))
                except BlockingIOError:
                    blocked.append(sock)  # the socket takes no more for now
                except OSError:
                    self._gone[i] = True
            self.saturated.set()  # a whole round: every socket full, finished or gone
            if self.all_closed_at is None and all(self._gone):
                self.all_closed_at = time.monotonic()
            live = [sock for i, sock in enumerate(self.socks) if not self._gone[i]]
            if not live:
                self._stop.wait()
                return
            # Until a socket takes more, or the far end sent something or closed it (the
            # timeout only bounds how late close() is seen).
            select.select(live, blocked, [], 0.05)

    def closed_by_peer(self) -> int:
        return sum(self._gone)

    def close(self) -> None:
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join(10)
        for sock in self.socks:
            sock.close()


class RssSampler:
    """The peak of a process's resident set: ``/proc/<pid>/status`` sampled every 2 ms, and its
    ``VmHWM`` (reset when sampling starts, through ``clear_refs``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def field(self, name: str) -> int:
        with open(f"/proc/{self.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
        raise KeyError(name)

    def rss_kib(self) -> int:
        return self.field("VmRSS")

    def steady(self, within_kib: int = 1024) -> Callable[[], bool]:
        """A predicate for ``wait_until_sync``: true once two reads in a row (its interval
        apart) differ by at most ``within_kib``: the process has settled, for a level to read."""
        last: list[int] = []

        def check() -> bool:
            now = self.rss_kib()
            before = last[0] if last else None
            last[:] = [now]
            return before is not None and abs(now - before) <= within_kib

        return check

    def start(self) -> None:
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.peak_kib = self.rss_kib()
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.peak_kib = max(self.peak_kib, self.rss_kib())
            if self._stop.wait(0.002):  # the sampling period; stop() ends it at once
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        self.peak_kib = max(self.peak_kib, self.field("VmHWM"))
        return self.peak_kib


def frame_tag(frame: bytes) -> str | None:
    """The frame type of one wire frame (its payload is signed, not encrypted)."""
    body = frame[4:]
    start = {0: 1, 1: 33, 2: 41}.get(body[0]) if body else None
    if start is None:
        return None
    try:
        value = msgspec.msgpack.decode(body[start:])
    except msgspec.DecodeError:
        return None
    tag = value.get("t") if isinstance(value, dict) else None
    return tag if isinstance(tag, str) else None


class RecordingProxy:
    """A TCP proxy on loopback in front of ``upstream``: every connection to :attr:`port` is
    forwarded there, and its decode -> prefill stream is cut into frames, forwarded frame by frame
    and recorded (``sessions``: one list of wire frames per connection). :meth:`duplicate_next`
    sends the next frame of a type twice: a recorded frame replayed inside the connection."""

    def __init__(self, upstream: int) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.sessions: list[list[bytes]] = []
        self.duplicated: list[bytes] = []
        self._duplicate: str | None = None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy", daemon=True)
        self._thread.start()

    def duplicate_next(self, tag: str) -> None:
        self._duplicate = tag

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(0.05):
                    if key.data is None:
                        self._accept()
                    else:
                        key.data()
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", self._upstream), timeout=10)
        except OSError:
            client.close()
            return
        frames: list[bytes] = []
        self.sessions.append(frames)
        pending = bytearray()

        def close() -> None:
            for sock in (client, upstream):
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
                sock.close()

        def up() -> None:  # decode -> prefill, frame by frame
            try:
                data = client.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                close()
                return
            pending.extend(data)
            while len(pending) >= 4:
                size = struct.unpack_from(">I", pending)[0]
                if len(pending) < 4 + size:
                    break
                frame = bytes(pending[: 4 + size])
                del pending[: 4 + size]
                frames.append(frame)
                copies = 1
                if self._duplicate is not None and frame_tag(frame) == self._duplicate:
                    self._duplicate = None
                    self.duplicated.append(frame)
                    copies = 2
                try:
                    upstream.sendall(frame * copies)
                except OSError:
                    close()
                    return

        def down() -> None:  # prefill -> decode, as it comes
            try:
                data = upstream.recv(1 << 16)
                if data:
                    client.sendall(data)
            except OSError:
                data = b""
            if not data:
                close()

        self._selector.register(client, selectors.EVENT_READ, up)
        self._selector.register(upstream, selectors.EVENT_READ, down)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def read_until_closed(sock: socket.socket, timeout: float) -> bool:
    """Read whatever comes until the far end closes the connection (True) or ``timeout``."""
    sock.settimeout(0.1)
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            if not sock.recv(1 << 16):
                return True
        except TimeoutError:
            continue
        except OSError:  # reset: closed with our bytes unread
            return True
    return False


# -- 1. file descriptors -----------------------------------------------------------------------


def test_accept_out_of_descriptors_backs_off_and_serves_again() -> None:
    """The listener's process runs out of descriptors (the unauthenticated caps, in all and per
    host, raised above its limit, so that nothing else protects it): ``accept()`` fails with
    EMFILE while a stranger holds more idle connections than the limit allows. Once they are
    gone, decode is served."""
    config = ChannelConfig(max_unauthenticated=100_000, max_unauthenticated_per_host=100_000)
    prefill = PrefillProcess(config, nofile_headroom=150)
    decode: Decode | None = None
    try:
        open_fds, soft, _ = prefill.ask("fds")
        crowd = Crowd(prefill.port, soft - open_fds + 100)
        try:
            wait_until_sync(lambda: stats(prefill)["accept_errors"] > 0, timeout=30)
        finally:
            crowd.close()
        decode = Decode({"port": prefill.port})
        failed = move_rooms(prefill, decode, range(1, 33))
        assert failed == {}, failed
        assert stats(prefill)["accept_errors"] > 0
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


def test_idle_connections_past_the_cap_shed_the_oldest_and_decode_gets_in() -> None:
    """1,100 idle connections at a 1,024-descriptor limit, with the default cap (64): the oldest
    are shed, so the process never runs out of descriptors, and a decode rank that connects while
    they are held moves its rooms."""
    config = ChannelConfig()
    assert config.max_unauthenticated == 64
    prefill = PrefillProcess(config, nofile=1024)
    decode: Decode | None = None
    try:
        with own_nofile(4096):
            crowd = Crowd(prefill.port, 1100)
            try:
                wait_until_sync(lambda: stats(prefill)["unauthenticated_shed"] > 0, timeout=30)
                decode = Decode({"port": prefill.port})  # connects while they are held
                failed = move_rooms(prefill, decode, range(1, 101))
                assert_rooms_moved(failed, 100)
                counters = stats(prefill)
                assert counters["unauthenticated_shed"] > 0, counters
                assert counters["accept_errors"] == 0, counters
                assert crowd.closed_by_peer() > 0  # the shed ones, closed by prefill
            finally:
                crowd.close()
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


# -- 2. memory before authentication -----------------------------------------------------------

#: What the documented bound leaves out: each connection's partial Hello sits in a bytearray that
#: grows by 1/8 over what it holds (64 x 1 MiB / 8 = 8 MiB), the 64 KiB chunks read and not yet
#: consumed (4 MiB for 64 connections), the allocator's fragmentation from those growing buffers,
#: and the legitimate decode's rooms moving meanwhile: 24 MiB in all. Measured with 200
#: connections of 800 KiB: 60 to 75 MiB over the level before the attack.
RSS_SLACK = 24 * MIB
#: How far above its level before the attack prefill's RSS may be once the attack is over and
#: glibc was asked to give back what was freed (``malloc_trim``: freed heap memory stays resident,
#: for reuse, until then). Measured: 0 to 4 MiB.
RSS_AFTER_SLACK = 16 * MIB

#: Why the 16 MiB case fails now (measured over five runs of this test; see the parameter).
#: Found by the 16 MiB case below, and fixed: prefill accepts on the raw socket and reads an
#: unauthenticated connection only as far as the handshake asks (``_RawConnection``), and raises
#: fresh errors instead of the one its reader keeps. What it was:
READ_AHEAD = (
    "pre-authentication memory is not bounded by hello_max_bytes. (1) anyio's asyncio "
    "SocketStream reads a connection as soon as its transport exists (connect_accepted_socket) "
    "and pauses only after a receive() that had to wait, and uvloop reads up to 32 x 256 KiB per "
    "socket per readiness callback: before the handshake reads the 4-byte length prefix and "
    "refuses it, the connection's bytes are queued in StreamProtocol.read_queue, where "
    "hello_max_bytes does not reach (up to a whole 16 MiB body from one connection). Peak RSS "
    "+245 to +365 MiB against 64 MiB + 24 MiB slack. (2) A refused connection's buffers are kept "
    "by a reference cycle (FrameReader._failed -> FrameError.__traceback__ -> the _handshake "
    "frame -> reader, stream) until the cyclic GC runs: +145 to +300 MiB after malloc_trim, "
    "+3 MiB after gc.collect() and malloc_trim"
)


# Judged against a short heartbeat silence and 10 s waits: under two loaded xdist workers a
# starved loop misses them (seen on a clean-clone run), so it runs alone, bounds unchanged.
@pytest.mark.alone
@pytest.mark.parametrize(
    ("n", "length", "body"),
    [
        pytest.param(100, 16 * MIB, 16 * MIB, id="16MiB-prefix"),
        pytest.param(200, 900 * KIB, 800 * KIB, id="under-hello-limit"),
    ],
)
def test_unfinished_hellos_cost_prefill_at_most_the_documented_bound(
    n: int, length: int, body: int, record_property: Callable[[str, object], None]
) -> None:
    """``n`` connections announce a Hello of ``length`` bytes, push as much of it as their
    sockets take and never finish it. They arrive while prefill is busy elsewhere (stopped
    until every connection has pushed what its socket takes), so that they all wait in its
    accept queue with their bytes, as behind any stall.
    Prefill's resident memory stays within ``max_unauthenticated * hello_max_bytes`` (plus the
    slack above) and comes back; prefill closes the connections (at the length prefix when it
    is over ``hello_max_bytes``, by the cap and then the handshake timeout otherwise); a decode
    rank with the secret moves its rooms meanwhile."""
    config = SIGNED
    bound = config.max_unauthenticated * config.hello_max_bytes
    prefill = PrefillProcess(config)
    decode = Decode({"port": prefill.port}, SIGNED)
    try:
        assert move_rooms(prefill, decode, range(1, 17)) == {}  # warm: the link and NIXL are up
        prefill.ask("trim")
        sampler = RssSampler(prefill.pid)
        wait_until_sync(sampler.steady(), timeout=10, interval=0.1, message="a steady RSS")
        before = sampler.rss_kib() * KIB
        sampler.start()
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            pressure = Pressure(prefill.port, n, length, body)
            assert pressure.saturated.wait(10), "the connections never filled their sockets"
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        resumed = time.monotonic()
        try:
            failed = move_rooms(prefill, decode, range(100, 200))
            if length > config.hello_max_bytes:
                # Refused at the length prefix: every one closed, not left to the timeout.
                wait_until_sync(lambda: pressure.all_closed_at is not None, timeout=30)
                assert pressure.all_closed_at is not None
                assert pressure.all_closed_at - resumed < config.connect_timeout_s
            else:
                wait_until_sync(
                    lambda: pressure.closed_by_peer() >= n - config.max_unauthenticated, timeout=30
                )
                # The rest (those the cap kept) by the handshake timeout.
                wait_until_sync(
                    lambda: pressure.all_closed_at is not None,
                    timeout=config.connect_timeout_s + 10,
                )
            sent = pressure.sent
        finally:
            pressure.close()
        peak = sampler.stop() * KIB
        wait_until_sync(sampler.steady(), timeout=10, interval=0.1, message="a steady RSS")
        resident = sampler.rss_kib() * KIB
        prefill.ask("trim")
        after = sampler.rss_kib() * KIB
        figures = {
            "before_mib": round(before / MIB, 1),
            "peak_mib": round(peak / MIB, 1),
            "after_mib": round(resident / MIB, 1),
            "after_trim_mib": round(after / MIB, 1),
            "allowed_peak_mib": round((before + bound + RSS_SLACK) / MIB, 1),
            "attack_sent_mib": round(sent / MIB, 1),
        }
        record_property("rss", figures)
        print(f"prefill RSS {figures}")
        assert_rooms_moved(failed, 100)
        counters = stats(prefill)
        assert counters["links_lost"] == 0, counters
        if length <= config.hello_max_bytes:
            assert counters["unauthenticated_shed"] >= n - config.max_unauthenticated, counters
        assert peak - before <= bound + RSS_SLACK, figures
        assert after <= before + RSS_AFTER_SLACK, figures
    finally:
        decode.close()
        prefill.close()


# -- 3. held page lists are a per-peer quota ---------------------------------------------------


async def _record_outcomes(control: ControlPlane, into: list[RoomOutcome]) -> None:
    """Keep every RoomOutcome this decode control plane receives (on its loop)."""
    original = control._on_frame

    def on_frame(link: _Link, frame: Frame) -> None:
        if isinstance(frame, RoomOutcome):
            into.append(frame)
        original(link, frame)

    control._on_frame = on_frame  # type: ignore[method-assign]


async def _flood_page_lists(control: ControlPlane, rooms: Sequence[int]) -> None:
    """A hostile but authenticated decode: page lists for rooms prefill does not have, and that
    no receiver room of this decode stands behind, straight onto its link."""
    link = await control._link_to(0)
    pages = np.asarray([0, 1], np.int32).tobytes()
    for room in rooms:
        control._send(link, RoomMetadata(room, 1, pages, 0))


def test_held_page_lists_are_capped_per_peer_not_for_everyone() -> None:
    """One decode peer sends page lists for 200 rooms prefill does not have (pending_max 64):
    64 are held, the rest refused with the quota as the reason. Another decode's page lists that
    arrive before their prefill rooms are still held, and its rooms succeed."""
    config = ChannelConfig(pending_max=64)
    prefill = PrefillProcess(config)
    flooder = Decode({"port": prefill.port}, config)
    legit = Decode({"port": prefill.port}, config)
    try:
        outcomes: list[RoomOutcome] = []
        flooder.engine.call(_record_outcomes(flooder.control, outcomes))
        flood = range(1000, 1200)
        flooder.engine.call(_flood_page_lists(flooder.control, flood))
        surplus = len(flood) - config.pending_max
        wait_until_sync(lambda: len(outcomes) >= surplus, timeout=20)
        stays_true_sync(
            lambda: len(outcomes) == surplus, duration=0.2, message="no outcome past the quota"
        )
        assert {o.room for o in outcomes} == set(flood[config.pending_max :])
        assert all(o.status == KVPoll.Failed for o in outcomes)
        reasons = {o.reason for o in outcomes}
        quota = f"quota of {config.pending_max}"
        assert all(quota in reason for reason in reasons), reasons
        assert prefill.ask("entries")["held"] == config.pending_max
        # The other decode: its page lists come before prefill's rooms, and are held.
        rooms = list(range(1, 21))
        receivers = [legit.receive(room, [i], aux_row=i) for i, room in enumerate(rooms)]
        wait_until_sync(
            lambda: prefill.ask("entries")["held"] == config.pending_max + len(rooms), timeout=20
        )
        # A room's claim goes out (and is held) as soon as it is bound, before its page list:
        # the count above can be reached while the last page lists are still on their way.
        wait_until_sync(lambda: all(r.poll() is KVPoll.Transferring for r in receivers), timeout=10)
        for i, room in enumerate(rooms):
            prefill.ask("send", room, [100 + i], 1, i)
        wait_until_sync(ended(receivers), timeout=30)
        assert {r.room: r.reason for r in receivers if r.poll() is not KVPoll.Success} == {}
        assert all(legit.landed([100 + i], [i], i, i) for i in range(len(rooms)))
        assert prefill.ask("entries")["held"] == config.pending_max  # the flooder's, still
    finally:
        legit.close()
        flooder.close()
        prefill.close()


# -- 4. replay -----------------------------------------------------------------------------------


@pytest.mark.parametrize("replayed", ["everything", "the Hello", "the Hello and room frames"])
def test_a_recorded_stream_replayed_by_a_stranger_touches_no_link(replayed: str) -> None:
    """A proxy records a real decode's stream to prefill (Hello, key confirmation, claims, page
    lists, lease grants). A stranger replays it on its own connection: prefill refuses that
    connection and the real link, its held page lists and its rooms are untouched."""
    config = ChannelConfig(secret=SECRET, connect_timeout_s=2.0)
    prefill = PrefillProcess(config)
    proxy = RecordingProxy(prefill.port)
    decode = Decode({"port": proxy.port}, SIGNED)
    try:
        assert move_rooms(prefill, decode, range(1, 5)) == {}
        live = [decode.receive(10 + i, [10 + i], aux_row=i) for i in range(4)]  # held there
        wait_until_sync(lambda: prefill.ask("entries")["held"] == len(live), timeout=10)
        # A claim is held as soon as its room is bound, before its page list goes out.
        wait_until_sync(lambda: all(r.poll() is KVPoll.Transferring for r in live), timeout=10)
        frames = list(proxy.sessions[0])
        assert [frame_tag(f) for f in frames[:2]] == ["Hello", "Heartbeat"]
        assert "RoomMetadata" in {frame_tag(f) for f in frames}
        data = {
            "everything": b"".join(frames),
            "the Hello": frames[0],
            "the Hello and room frames": frames[0] + b"".join(frames[2:]),
        }[replayed]
        before = stats(prefill)
        with socket.create_connection(("127.0.0.1", prefill.port), timeout=10) as stranger:
            stranger.sendall(data)
            assert read_until_closed(stranger, config.connect_timeout_s + 10), "not refused"
        wait_until_sync(
            lambda: stats(prefill)["handshakes_failed"] > before["handshakes_failed"], timeout=10
        )
        after = stats(prefill)
        assert after["links_lost"] == before["links_lost"], after
        assert after["links_opened"] == before["links_opened"], after
        assert after["handshakes_refused"] == before["handshakes_refused"], after  # no NIXL load
        assert len(proxy.sessions) == 1  # the real decode never had to reconnect
        assert {r.room: r.reason for r in live if r.poll() is not KVPoll.Transferring} == {}
        assert prefill.ask("entries")["held"] == len(live)
        for i, receiver in enumerate(live):
            prefill.ask("send", receiver.room, [50 + i], 1, i)
        wait_until_sync(ended(live), timeout=20)
        assert {r.room: r.reason for r in live if r.poll() is not KVPoll.Success} == {}
        assert all(decode.landed([50 + i], [10 + i], i, i) for i in range(len(live)))
    finally:
        decode.close()
        proxy.close()
        prefill.close()


def test_a_frame_replayed_inside_the_connection_drops_it_out_of_sequence() -> None:
    """The proxy sends one of decode's page lists twice on the real connection: prefill drops
    that connection (out of sequence); rooms bound to it fail as peer lost, and decode
    reconnects for the next rooms."""
    prefill = PrefillProcess(SIGNED)
    proxy = RecordingProxy(prefill.port)
    decode = Decode({"port": proxy.port}, SIGNED)
    try:
        assert move_rooms(prefill, decode, range(1, 5)) == {}
        prefill.ask("hold", 20)  # bound to the link once claimed: it shows the link's end
        bound = decode.receive(20, [20], aux_row=0)
        wait_until_sync(lambda: status(prefill, 20)[0] == KVPoll.WaitingForInput, timeout=10)
        before = stats(prefill)
        proxy.duplicate_next("RoomMetadata")
        victim = decode.receive(21, [21], aux_row=1)  # its page list goes out twice
        wait_until_sync(lambda: status(prefill, 20)[0] == KVPoll.Failed, timeout=10)
        assert len(proxy.duplicated) == 1
        reason = status(prefill, 20)[1]
        assert "peer lost" in reason, reason
        assert "out of sequence" in reason, reason
        wait_until_sync(
            lambda: bound.poll() is KVPoll.Failed and victim.poll() is KVPoll.Failed, timeout=10
        )
        assert "peer lost" in bound.reason, bound.reason
        assert "peer lost" in victim.reason, victim.reason
        assert stats(prefill)["links_lost"] == before["links_lost"] + 1
        wait_until_sync(lambda: decode.engine.stats()["live"] == 0, timeout=20)
        assert move_rooms(prefill, decode, range(30, 34)) == {}  # over a new connection
        assert len(proxy.sessions) == 2
        assert stats(prefill)["links_opened"] == before["links_opened"] + 1
    finally:
        decode.close()
        proxy.close()
        prefill.close()


# -- 5. a long abort reason ----------------------------------------------------------------------


@pytest.mark.parametrize("when", ["bound", "before prefill's room"])
def test_a_long_abort_reason_is_clipped_not_refused(when: str) -> None:
    """A decode room aborted with a 5,000-character reason: prefill's room fails as aborted by
    its peer, with the reason clipped at the source, not as a bad frame."""
    prefill = PrefillProcess(PLAIN)
    decode = Decode({"port": prefill.port}, PLAIN)
    try:
        long = "the client went away; " * 228  # 5,016 characters
        assert len(long) > 5000
        if when == "bound":
            prefill.ask("hold", 7)
            receiver = decode.receive(7, [7], aux_row=0)
            wait_until_sync(lambda: status(prefill, 7)[0] == KVPoll.WaitingForInput, timeout=10)
            receiver.abort(long)
        else:
            receiver = decode.receive(7, [7], aux_row=0)
            wait_until_sync(lambda: prefill.ask("entries")["held"] == 1, timeout=10)
            receiver.abort(long)
            wait_until_sync(
                lambda: receiver.settled, timeout=10
            )  # acknowledged: nothing was written
            prefill.ask("hold", 7)
        wait_until_sync(lambda: status(prefill, 7)[0] == KVPoll.Failed, timeout=10)
        reason = status(prefill, 7)[1]
        assert "aborted (peer)" in reason, reason
        assert "the client went away" in reason, reason
        assert reason.endswith("[truncated]"), reason[-80:]
        assert "bad frame" not in reason, reason
        assert stats(prefill)["frames_rejected"] == 0
        wait_until_sync(lambda: receiver.settled, timeout=10)
    finally:
        decode.close()
        prefill.close()
