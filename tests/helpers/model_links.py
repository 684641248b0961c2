"""The model's network: TCP connections between the two processes (cut silently or reset),
each side's end of one (ControlPlane's ``_Link``), and the record of a link given up."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfsm.control._codec import FrameReader
from kvfsm.rooms._actor import RoomKey
from tests.helpers.model_world import Side

if TYPE_CHECKING:
    from tests.helpers.model_processes import Process


class Conn:
    """One TCP connection of the world."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.ends: dict[Side, LinkEnd] = {}
        self.cut_at: float | None = None  # silent partition since
        self.reset_at: float | None = None  # reset since

    @property
    def broken(self) -> bool:
        return self.cut_at is not None or self.reset_at is not None


class LinkEnd:
    """One side's view of a connection (ControlPlane's ``_Link``)."""

    def __init__(self, proc: Process, conn: Conn) -> None:
        self.proc = proc
        self.conn = conn
        self.gen = 0  # the side's link generation, once the Hello exchange is done
        self.open = False
        self.closed = False
        self.peer_id = ""
        now = proc.clock.now
        self.last_seen = now
        self.last_sent = now
        self.hello_sent = now
        self.beats = itertools.count()
        self.reader = FrameReader(proc.codec)


@dataclass(slots=True)
class LinkLoss:
    """A side gave a link up: the rooms its core had claimed on it must fail at once."""

    side: Side
    gen: int
    at: float
    claimed: list[RoomKey]
