"""The SGLang adapter tests' manager configuration: short deadlines, short silences."""

from __future__ import annotations

import dataclasses

from kvfsm.control import ChannelConfig
from kvfsm.manager import ManagerConfig
from kvfsm.rooms import RoomConfig
from kvfsm.states import KVPoll, Role
from kvfsm.transport import TransferConfig

#: Deadlines short enough that a scenario that waits one out stays short, long enough that a
#: loaded 2-vCPU machine does not hit them by accident.
DEADLINES = {
    role: {KVPoll.Bootstrapping: 10.0, KVPoll.WaitingForInput: 10.0, KVPoll.Transferring: 10.0}
    for role in (Role.SENDER, Role.RECEIVER)
}
CONFIG = ManagerConfig(
    rooms=RoomConfig(deadlines=DEADLINES, settle_timeout_s=20.0),
    transfer=TransferConfig(deadline_base_s=3.0, quarantine_s=0.5, reconnect_interval_s=0.2),
    # Silence 3 s, registry requests 6 s: the replays run up to six managers' loop threads
    # in one process, beside the registry's, and under two test workers on a loaded 2-vCPU CI
    # machine such a process stood still for 1.5 to 2.5 s while its managers started (NIXL
    # agents are made holding the GIL), so a healthy link was declared lost (silence 1.5 s) or
    # the registry unreachable (2 s). No test here waits for a silence: a stage or peer that
    # goes away closes its link. A lost prefill can write for at most silence + chunk
    # deadline (3 s + bytes) + quarantine (0.5 s): decode keeps the pages of its rooms that long.
    channel=ChannelConfig(heartbeat_s=0.25, liveness_factor=12.0),
    register_interval_s=0.5,
    register_wait_s=10.0,
    registry_timeout_s=6.0,
)

#: For a pair that is refused (at the handshake, or by decode before it asks prefill anything):
#: decode's requests fail at once, and prefill's rooms, which no decode will ever ask for, can
#: only end by their Bootstrapping deadline. Nothing else in such a scenario can meet that
#: deadline by accident, so it is short: the test waits for it, and only for it.
REFUSED_PAIR = dataclasses.replace(
    CONFIG,
    rooms=dataclasses.replace(
        CONFIG.rooms,
        deadlines={
            **DEADLINES,
            Role.SENDER: {**DEADLINES[Role.SENDER], KVPoll.Bootstrapping: 2.0},
        },
    ),
)
