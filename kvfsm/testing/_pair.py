"""``KvfsmPair``: a real prefill rank and a real decode rank in this process, over NIXL on
loopback, for the tests of people who embed kvfsm.

What is real: both managers (their NIXL agents with host buffers registered, the room engines,
the control channel over TCP, the data path), and a bootstrap registry on a thread of its own,
through which prefill registers and decode finds it.
What the pair adds for tests:

* buffers filled so that every page of every KV buffer and every aux row is tell-tale
  (:meth:`KvfsmPair.landed` checks a room's bytes);
* :meth:`KvfsmPair.transfer`, one room driven the way SGLang's scheduler drives it, with an
  abort at a chosen point (:class:`AbortAt`);
* faults at chosen positions (:class:`~kvfsm.testing.Faults`): NIXL faults on prefill's agent,
  frame faults on the control channel;
* canaries: pages a test hands back to decode's pool are filled with :data:`CANARY`, and
  :meth:`KvfsmPair.canary_violations` says whether anything wrote into them afterwards (law 4);
* :meth:`KvfsmPair.freeze_prefill`: prefill's event loop held still (no heartbeats, no lease
  renewals, no room progress), as a GIL-holding scheduler or a stopped process would;
* :meth:`KvfsmPair.leaks`: live rooms, held pages and transfers left in flight.

Every wait is bounded; the async helpers poll with ``asyncio.sleep`` so they run inside an
``async def`` test without blocking its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfsm.chaos import ProxyThread, TransportFaults, faulty_agent_config
from kvfsm.control import ChannelConfig, registry_resolver
from kvfsm.manager import DecodeManager, ManagerConfig, PrefillManager
from kvfsm.registry import RegistryThread
from kvfsm.rooms import ReceiverRoom, RoomConfig, SenderRoom
from kvfsm.states import TERMINAL, KVPoll, Role
from kvfsm.testing._faults import Faults, ScriptedPlan
from kvfsm.transport import TransferConfig
from kvfsm.workload.buffers import Shape, make_buffers, make_layout

__all__ = ["CANARY", "AbortAt", "KvfsmPair", "PairOptions", "Transfer"]

#: What a released decode page is filled with: a write after release changes it.
CANARY: Final = 0xA5
_ENGINE: Final = "kvfsm-testing"


class AbortAt(enum.Enum):
    """Where :meth:`KvfsmPair.transfer` aborts the room (the side that aborts, and when)."""

    PREFILL_BEFORE_SEND = "prefill aborts after init, before its first chunk"
    PREFILL_AFTER_FIRST_CHUNK = "prefill aborts after its first chunk"
    DECODE_BEFORE_METADATA = "decode aborts before sending its page list"
    DECODE_AFTER_METADATA = "decode aborts right after sending its page list"


@dataclass(frozen=True)
class PairOptions:
    """The pair's shape and timing. Deadlines are short so a test that waits one out stays
    short; long enough that a loaded CI machine does not hit them by accident."""

    layers: int = 2
    pages: int = 64
    page_bytes: int = 4096  # per K or V buffer
    aux_rows: int = 16
    aux_row_bytes: int = 64
    #: Every non-terminal state's deadline, both roles.
    deadline_s: float = 10.0
    #: A chunk's deadline (``TransferConfig.deadline_base_s``; plus its bytes' share).
    chunk_deadline_s: float = 3.0
    heartbeat_s: float = 0.25
    liveness_factor: float = 6.0
    lease_s: float = 1.0
    #: Shared secret for the registry and the control channel (HMAC on every frame, sequence
    #: numbers: a dropped or replayed frame then drops the connection). None: none.
    secret: bytes | None = None
    faults: Faults | None = None

    def manager_config(self, role: Role, faults: TransportFaults | None) -> ManagerConfig:
        deadlines = {
            r: {
                s: self.deadline_s
                for s in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)
            }
            for r in (Role.SENDER, Role.RECEIVER)
        }
        config = ManagerConfig(
            rooms=RoomConfig(deadlines=deadlines, settle_timeout_s=4 * self.deadline_s),
            transfer=TransferConfig(
                deadline_base_s=self.chunk_deadline_s, quarantine_s=0.5, reconnect_interval_s=0.2
            ),
            channel=ChannelConfig(
                heartbeat_s=self.heartbeat_s,
                liveness_factor=self.liveness_factor,
                lease_s=self.lease_s,
                fence_margin_s=self.lease_s / 2,
            ),
            register_interval_s=0.5,
            register_wait_s=10.0,
            secret=self.secret,
        )
        if role is Role.SENDER and faults is not None:
            config = dataclasses.replace(config, agent=faulty_agent_config(faults))
        return config


@dataclass
class Transfer:
    """How one room ended on both sides."""

    room: int
    prefill: KVPoll
    decode: KVPoll
    prefill_reason: str
    decode_reason: str
    #: Every KV byte of the room's pages and its aux row equal prefill's (Success only).
    landed: bool
    settled: bool = True
    receiver: ReceiverRoom | None = field(default=None, repr=False)
    sender: SenderRoom | None = field(default=None, repr=False)

    @property
    def succeeded(self) -> bool:
        return self.prefill is KVPoll.Success and self.decode is KVPoll.Success


def _buffers(options: PairOptions) -> tuple[list[npt.NDArray[np.uint8]], npt.NDArray[np.uint8]]:
    return make_buffers(
        Shape(
            layers=options.layers,
            num_pages=options.pages,
            page_bytes=options.page_bytes,
            aux_rows=options.aux_rows,
            aux_row_bytes=options.aux_row_bytes,
        )
    )


def _fill(kv: list[npt.NDArray[np.uint8]], aux: npt.NDArray[np.uint8]) -> None:
    """Every (buffer, page, byte) and (row, byte) a different-looking byte, never 0."""
    for b, buf in enumerate(kv):
        pages, width = buf.shape
        grid = np.add.outer(np.arange(pages) * 7 + b * 131, np.arange(width) * 3)
        buf[:] = (grid % 251 + 1).astype(np.uint8)
    rows, width = aux.shape
    aux[:] = (np.add.outer(np.arange(rows) * 11, np.arange(width) * 5) % 251 + 1).astype(np.uint8)


class KvfsmPair:
    """A started prefill/decode pair (see the module docstring). Close it with :meth:`close`
    (the ``kvfsm_pair`` fixture does, and fails the test if anything leaked)."""

    def __init__(self, options: PairOptions | None = None) -> None:
        self.options = options = options if options is not None else PairOptions()
        faults = options.faults
        self.plan: ScriptedPlan | None = faults.plan() if faults is not None else None
        nixl_faults = None
        if self.plan is not None and self.plan.script.wants_nixl:
            nixl_faults = TransportFaults(self.plan)
        self.prefill_kv, self.prefill_aux = _buffers(options)
        self.decode_kv, self.decode_aux = _buffers(options)
        _fill(self.prefill_kv, self.prefill_aux)
        self._released: list[int] = []
        self._rooms = 0
        self._registry = RegistryThread(secret=options.secret, ttl_s=30.0, quiet=True)
        self.proxy: ProxyThread | None = None
        self._prefill: PrefillManager | None = None
        self._decode: DecodeManager | None = None
        try:
            self._prefill = PrefillManager(
                make_layout(self.prefill_kv, self.prefill_aux),
                self._registry.url,
                engine_id=_ENGINE,
                config=options.manager_config(Role.SENDER, nixl_faults),
            )
            resolver: Callable[[int], Awaitable[Any]] | None = None  # the registry's
            if faults is not None and faults.wants_proxy:
                assert self.plan is not None
                self.proxy = ProxyThread(self.plan).start()
                resolver = self.proxy.resolver(self._via_registry)
            self._decode = DecodeManager(
                make_layout(self.decode_kv, self.decode_aux),
                self._registry.url,
                engine_id=_ENGINE,
                resolver=resolver,
                config=options.manager_config(Role.RECEIVER, None),
            )
        except BaseException:
            self.close()
            raise

    async def _via_registry(self, rank: int) -> tuple[str, int]:
        # What decode does without a proxy (its own registry client): the proxy wraps it.
        found = await registry_resolver(self.decode._bootstrap_client(), _ENGINE)(rank)
        return found[0], found[1]

    @property
    def prefill(self) -> PrefillManager:
        """The prefill rank's manager (``RuntimeError`` once the pair is closed)."""
        return self._managers()[0]

    @property
    def decode(self) -> DecodeManager:
        """The decode rank's manager (``RuntimeError`` once the pair is closed)."""
        return self._managers()[1]

    # -- rooms ---------------------------------------------------------------------------------

    def _managers(self) -> tuple[PrefillManager, DecodeManager]:
        if self._prefill is None or self._decode is None:
            raise RuntimeError("the pair is closed")
        return self._prefill, self._decode

    def sender(self, room: int) -> SenderRoom:
        return self._managers()[0].sender(room)

    def receiver(self, room: int) -> ReceiverRoom:
        return self._managers()[1].receiver(room)

    async def transfer(
        self,
        room: int,
        src_pages: list[int],
        dst_pages: list[int],
        *,
        chunks: int = 1,
        src_aux: int = 0,
        dst_aux: int = 0,
        abort_at: AbortAt | None = None,
        limit_s: float = 30.0,
    ) -> Transfer:
        """Move one room the way SGLang's schedulers do (decode: init, wait for
        WaitingForInput, page list; prefill: wait for WaitingForInput, init, ``chunks`` sends),
        aborting at ``abort_at``; wait until both sides ended and settled (``TimeoutError``
        after ``limit_s``: every room ends by its deadlines well before that)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("src_pages and dst_pages must be as long")
        self._rooms += 1
        receiver, sender = self.receiver(room), self.sender(room)
        deadline = time.monotonic() + limit_s
        receiver.init(0)
        await _until(lambda: receiver.poll() is not KVPoll.Bootstrapping, deadline)
        if abort_at is AbortAt.DECODE_BEFORE_METADATA:
            receiver.abort(abort_at.value)
        elif receiver.poll() is KVPoll.WaitingForInput:
            receiver.send_metadata(np.asarray(dst_pages, np.int32), dst_aux)
            if abort_at is AbortAt.DECODE_AFTER_METADATA:
                receiver.abort(abort_at.value)
        await _until(lambda: sender.poll() is not KVPoll.Bootstrapping, deadline)
        if sender.poll() is KVPoll.WaitingForInput:
            sender.init(len(src_pages), src_aux)
            if abort_at is AbortAt.PREFILL_BEFORE_SEND:
                sender.abort(abort_at.value)
            else:
                for i, part in enumerate(_split(src_pages, chunks)):
                    sender.send(np.asarray(part, np.int32))
                    if i == 0 and abort_at is AbortAt.PREFILL_AFTER_FIRST_CHUNK:
                        sender.abort(abort_at.value)
                        break
        await _until(lambda: receiver.poll() in TERMINAL and sender.poll() in TERMINAL, deadline)
        await _until(lambda: receiver.settled and sender.settled, deadline)
        prefill, decode = sender.poll(), receiver.poll()
        landed = decode is KVPoll.Success and self.landed(src_pages, dst_pages, src_aux, dst_aux)
        sender.clear()
        receiver.clear()
        return Transfer(
            room, prefill, decode, sender.reason, receiver.reason, landed, True, receiver, sender
        )

    async def wait_until(self, predicate: Callable[[], bool], limit_s: float = 20.0) -> None:
        """Poll ``predicate`` (every millisecond, yielding to the test's loop) until it holds;
        ``TimeoutError`` after ``limit_s``."""
        await _until(predicate, time.monotonic() + limit_s)

    def landed(
        self, src_pages: list[int], dst_pages: list[int], src_aux: int, dst_aux: int
    ) -> bool:
        """Decode holds prefill's bytes: every KV buffer's ``dst_pages`` equal prefill's
        ``src_pages``, and aux row ``dst_aux`` equals prefill's ``src_aux``."""
        pages_ok = all(
            np.array_equal(dst[dst_pages], src[src_pages])
            for src, dst in zip(self.prefill_kv, self.decode_kv, strict=True)
        )
        return pages_ok and np.array_equal(self.decode_aux[dst_aux], self.prefill_aux[src_aux])

    # -- canaries ------------------------------------------------------------------------------

    def release(self, dst_pages: list[int]) -> None:
        """Hand ``dst_pages`` back to decode's pool, as decode does once a failed room is
        settled: fill them with :data:`CANARY`, and remember them."""
        for buf in self.decode_kv:
            buf[dst_pages] = CANARY
        self._released.extend(dst_pages)

    def canary_violations(self) -> list[str]:
        """Released pages that something wrote into since (law 4), per KV buffer."""
        bad = []
        pages = sorted(set(self._released))
        for i, buf in enumerate(self.decode_kv):
            hit = [p for p in pages if not (buf[p] == CANARY).all()]
            if hit:
                bad.append(f"decode KV buffer {i}: released pages {hit} were written")
        return bad

    # -- a frozen prefill ------------------------------------------------------------------------

    @contextlib.contextmanager
    def freeze_prefill(self) -> Iterator[None]:
        """Hold prefill's event loop still for the ``with`` block: no heartbeats, no lease
        renewals, no room progress (chunks already handed to its poster thread still meet the
        lease check before each post, as after a real freeze). Decode sees a silent peer."""
        engine = self._managers()[0].engine
        assert engine is not None
        release, held = threading.Event(), threading.Event()

        def hold() -> None:
            held.set()
            release.wait(600)

        engine.loop.call_soon_threadsafe(hold)
        held.wait(10)
        try:
            yield
        finally:
            release.set()

    # -- leaks and shutdown ----------------------------------------------------------------------

    def leaks(self, timeout: float = 10.0) -> list[str]:
        """What is left once every room ended: live rooms, held decode pages, transfers in
        flight (waits up to ``timeout`` for rooms still being reaped)."""
        prefill, decode = self._managers()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _engine_stats(prefill)["live"] and not _engine_stats(decode)["live"]:
                break
            time.sleep(0.01)
        found = []
        for side, manager in (("prefill", prefill), ("decode", decode)):
            stats = _engine_stats(manager)
            if stats["live"]:
                found.append(f"{side}: {stats['live']} live rooms")
            if stats["held_pages"]:
                found.append(f"{side}: {stats['held_pages']} destination pages held")
        snapshot = _transport_snapshot(prefill)
        if snapshot.get("in_flight"):
            found.append(f"prefill: {snapshot['in_flight']} transfers in flight")
        return found

    def close(self) -> None:
        for manager in (self._decode, self._prefill):
            if manager is not None:
                manager.close()
        self._decode = self._prefill = None
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        self._registry.close()

    def __enter__(self) -> KvfsmPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(pages: list[int], chunks: int) -> list[list[int]]:
    """``pages`` in at most ``chunks`` consecutive, non-empty parts (one empty part for a room
    with no pages: it still ends the room and carries the aux row). The last part is the one
    that reaches the room's page count, so it is the room's last chunk."""
    if chunks < 1:
        raise ValueError(f"at least one chunk, not {chunks}")
    if not pages:
        return [[]]
    n = min(chunks, len(pages))
    base, extra = divmod(len(pages), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(pages[start : start + size])
        start += size
    return out


async def _until(predicate: Callable[[], bool], deadline: float) -> None:
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the pair's room did not get there in time")
        await asyncio.sleep(0.001)


def _engine_stats(manager: PrefillManager | DecodeManager) -> dict[str, int]:
    engine = manager.engine
    assert engine is not None
    return engine.stats()


def _transport_snapshot(manager: PrefillManager) -> dict[str, Any]:
    engine = manager.engine
    assert engine is not None

    async def read() -> dict[str, Any]:
        snap: dict[str, Any] = manager.transport.snapshot()
        return snap

    result: dict[str, Any] = engine.call(read())
    return result
