"""Deterministic faults for one prefill-decode pair: this chunk stalls, that frame is dropped.

kvfsm's chaos campaign draws faults at random rates from a seed (``kvfsm.chaos._plan``); a test
usually wants one fault at one place. :class:`Faults` says which, by position, and drives the
same machinery the campaign uses, so what a test injects is what the campaign injects:

* NIXL faults go through ``kvfsm.chaos._transport_faults`` (a proxy around prefill's NIXL agent,
  installed through ``AgentConfig.interpose``). Positions count the WRITE handles prefill makes,
  in its poster's order, from 0: a room's KV chunks, then (with its last chunk) its aux row.
* Frame faults go through ``kvfsm.chaos._control_proxy`` (a man-in-the-middle on the control
  channel, installed through decode's resolver). Positions count frames per direction, from 0,
  the Hellos included: ``"to_prefill"`` (decode -> prefill) and ``"to_decode"``.

A fault names its position once; everything else passes through untouched, so a test can say
exactly what broke and assert exactly what kvfsm did about it.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from kvfsm.chaos import ControlRates, FaultPlan, FrameFault, TransferFault, TransferRates

__all__ = ["Direction", "Faults"]

#: A direction of the control channel, as the proxy names its pumps.
Direction = Literal["to_prefill", "to_decode"]


@dataclass
class Faults:
    """What to break, by position (build it with the chainable methods)."""

    #: WRITE handle index -> (fault, parameter: a delay in seconds for DELAY).
    transfers: dict[int, tuple[TransferFault, float]] = field(default_factory=dict)
    #: (direction, frame index) -> (fault, parameter).
    frames: dict[tuple[Direction, int], tuple[FrameFault, float]] = field(default_factory=dict)

    def stall_chunk(self, n: int) -> Faults:
        """WRITE ``n`` is posted and then reports "in progress" forever (a wedged handle):
        kvfsm's chunk deadline must fail its room, and its pages must stay fenced."""
        return self._transfer(n, TransferFault.NEVER_COMPLETE)

    def fail_chunk(self, n: int) -> Faults:
        """WRITE ``n`` is posted and completes with an error."""
        return self._transfer(n, TransferFault.COMPLETION_ERROR)

    def fail_post(self, n: int) -> Faults:
        """``transfer()`` of WRITE ``n`` answers ERR without posting."""
        return self._transfer(n, TransferFault.POST_ERROR)

    def delay_chunk(self, n: int, seconds: float) -> Faults:
        """WRITE ``n`` reports its completion ``seconds`` late."""
        return self._transfer(n, TransferFault.DELAY, seconds)

    def drop_frame(self, direction: Direction, n: int) -> Faults:
        """Frame ``n`` of ``direction`` never arrives (the connection stays up)."""
        return self._frame(direction, n, FrameFault.DROP)

    def delay_frame(self, direction: Direction, n: int, seconds: float) -> Faults:
        """Frame ``n`` of ``direction`` (and every frame behind it: a stream keeps its order)
        arrives ``seconds`` late."""
        return self._frame(direction, n, FrameFault.DELAY, seconds)

    def cut_at_frame(self, direction: Direction, n: int) -> Faults:
        """The connection is cut just before frame ``n`` of ``direction``."""
        return self._frame(direction, n, FrameFault.CUT)

    @property
    def wants_proxy(self) -> bool:
        return bool(self.frames)

    @property
    def wants_nixl(self) -> bool:
        return bool(self.transfers)

    def _transfer(self, n: int, fault: TransferFault, param: float = 0.0) -> Faults:
        if n < 0:
            raise ValueError(f"WRITE positions count from 0, not {n}")
        self.transfers[n] = (fault, param)
        return self

    def _frame(self, direction: Direction, n: int, fault: FrameFault, param: float = 0.0) -> Faults:
        if direction not in ("to_prefill", "to_decode"):
            raise ValueError(f"direction must be 'to_prefill' or 'to_decode', not {direction!r}")
        if n < 0:
            raise ValueError(f"frame positions count from 0, not {n}")
        self.frames[(direction, n)] = (fault, param)
        return self

    def plan(self) -> ScriptedPlan:
        return ScriptedPlan(self)


class ScriptedPlan(FaultPlan):
    """A :class:`FaultPlan` that answers from a :class:`Faults` script instead of a seed. The
    proxies ask it once per handle or frame, per site, in order, as they ask the seeded plan."""

    def __init__(self, faults: Faults) -> None:
        # The proxies scale a delay's parameter by delay_max_s: 1 s, so parameters are seconds.
        super().__init__(
            seed=0,
            transfer=TransferRates(delay_max_s=1.0),
            control=ControlRates(delay_max_s=1.0),
        )
        self.script = faults
        self._seen: Counter[str] = Counter()
        self._script_lock = threading.Lock()
        #: What was injected, in order: (site, position, fault name).
        self.injected_at: list[tuple[str, int, str]] = []

    def _next(self, site: str) -> int:
        with self._script_lock:
            index = self._seen[site]
            self._seen[site] += 1
            return index

    def _record(self, site: str, index: int, kind: str) -> None:
        with self._script_lock:
            self.counts[(site, kind)] += 1
            if kind != "none":
                self.injected_at.append((site, index, kind))

    def transfer_fault(self, site: str = "xfer") -> tuple[TransferFault, float]:
        index = self._next(site)
        fault, param = self.script.transfers.get(index, (TransferFault.NONE, 0.0))
        self._record(site, index, fault.value)
        return fault, param

    def frame_fault(self, site: str) -> tuple[FrameFault, float]:
        index = self._next(site)
        direction: Direction = "to_prefill" if site == "to_prefill" else "to_decode"
        fault, param = self.script.frames.get((direction, index), (FrameFault.NONE, 0.0))
        self._record(site, index, fault.value)
        return fault, param
