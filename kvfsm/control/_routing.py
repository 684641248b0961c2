"""The control plane's per-room routing, sans-IO: frames and room commands in, actions out.

:class:`PrefillRouting` and :class:`DecodeRouting` hold every rule about which room a control frame
belongs to and what the other side must be told. They read no clock (every call that needs time
is passed ``now``), touch no socket and deliver nothing: they return :class:`Send` and
:class:`Deliver` actions, and :class:`GrantLease` / :class:`RevokeLease` for the write fence. The
``ControlPlane`` executes them. Links are named by an int the plane assigns (its link
generation), which is also the **fence** id of the writes made under that link's lease.

This module states the rules and exports the routing API; the code is split by what it does:
the actions, configuration and counters both cores share (``_routing_common``), prefill's core
(``_prefill_routing``), decode's (``_decode_routing``), and the lifecycle of a room's binding to
a link on either side, states and edges as data (``_binding``). A binding changes state only
along an edge of its side's table; the rules below say when each edge is taken.

Rules
-----

Identity (law 5).
    A room on the wire is ``(room, generation)``, the generation being the decode room's. Decode
    routes a frame straight to ``RoomKey(room, generation)``; prefill routes it through the
    binding ``(link, room, generation)``. A reused room id is a new pair: it never touches its
    predecessor, and its predecessor's acknowledgements still reach it.

Claims (law 3).
    Decode sends ``RoomClaim`` as soon as a receiver is bound to its link, before pages are
    reserved. Prefill binds the claim to its live, unbound sender room of that id, or *holds* it
    until such a room appears (bounded per link, and by a TTL after which decode is answered
    Failed + Settled). A sender bound to a link fails with ``PeerLost`` the moment that link is
    lost, whatever its state: only a room no decode ever claimed waits out its Bootstrapping
    deadline. ``RoomMetadata`` without a claim is a claim plus metadata.

Destinations.
    A claim alone does not move a sender: only decode's ``RoomMetadata`` (its page list, sent
    at ``send_metadata``) becomes the sender's ``DestinationReceived``, the event that makes it
    WaitingForInput. It carries the frame's ``prefix`` (prompt tokens decode holds already),
    so prefill's scheduler, which reads the prefix at its first WaitingForInput to size
    ``init``, always finds it there. A page list held with its claim keeps its prefix.

Duplicates.
    A claim for a room whose live sender is already bound to another decode room, or for which
    another link's claim is held, is refused (Failed + Settled: nothing was written), and the
    first is untouched; except a newer generation on the same link after decode aborted the
    bound one (an id reused at once), which is held for the next sender of that id.

Ends (law 4).
    A sender's outcome goes to its bound decode room. Success unbinds (every write landed). A
    failure of a sender that never got decode's pages is also settled (nothing was posted). A
    failed sender that had the pages stays bound until the room reports ``ReportSettled``, which
    becomes ``RoomSettled``. A sender that fails before any decode claimed it leaves a
    *tombstone* that answers the claim when it comes (TTL-bounded), unless it was failed by an
    early abort (below), whose decode room already knows.

Legs.
    When decode's attention TP is larger than prefill's, a prefill rank writes each room into
    several decode ranks, each over its own link (and with state sharded over attention TP and
    KV heads replicated on both sides, a prefill rank may write a room's KV into one decode
    rank and its state shard into another: ``_fingerprint.link_slot``): its request is one
    sender room per decode rank, its *legs*, spawned as the first leg learns how many there
    are. The handshake says which leg a link's decode rank is (``link_opened(leg=, legs=)``,
    from both fingerprints), so a sender is named by ``(room, leg)`` wherever a room id alone
    would name it (claims, holds, tombstones, early aborts), and ``DestinationReceived.legs``
    tells the first leg the count. With equal TP, or several prefill ranks per decode rank and
    no such state, every link is leg 0 of 1.

Early aborts.
    A ``RoomAbort`` for a room prefill has not bound is acknowledged at once (``RoomSettled``:
    nothing was written). A live sender of that id that no decode room is bound to fails at
    once (its decode room is over: the abort is all that will come); with no such sender the
    abort is remembered, and the next sender of that id fails at once, unless a newer claim for
    the id from the same decode arrived since, which supersedes it (another decode's claim or
    abort of the id leaves the mark as it is: ids collide, the first stands).

Errors.
    An ``Error`` frame that names a room fails exactly that room (its generation, when given).

Links.
    When a link is lost, its bound rooms get ``PeerLost``. Decode's exposed rooms settle once no
    write can still land: the last lease decode granted on that link, plus ``lease_s``, plus
    ``fence_margin_s`` (a write checked against its lease just before it was posted), *and*
    only after decode's own agent has been progressed without a gap for ``fence_margin_s``
    (``tick(now, steady_s)``). A decode frozen past that bound has not taken the bytes its
    socket and prefill's agent hold for it: they land once it is progressed again, so its
    clock alone proves nothing; the steady stretch after it resumes is when they land.
    Prefill revokes the link's fence at once and keeps bindings whose sender may still write as
    *orphans*. After decode reconnects to the same prefill incarnation it sends ``Reconcile``
    with the rooms still waiting; prefill re-attaches the orphans to the new link (their
    ``RoomSettled`` goes out when they settle) and answers the unknown ones ``RoomSettled`` at
    once, so nothing waits on a message that died with a link. Decode's claimed rooms that the
    loss failed before they were exposed may never have reached prefill (a claim sent into a
    link prefill had already closed): decode sends a ``RoomAbort`` for each right after the
    ``Reconcile``, so a sender waiting for that claim fails then, not at its Bootstrapping
    deadline. Until that reconnect, decode *owes* the incarnation (``owes``): the control
    plane reconnects for it, not only when a new room needs the link.

Leases (law 4).
    Prefill sends ``LeaseRequest(seq)`` every ``lease_s / 4``, remembering when it sent each;
    decode answers ``LeaseGrant(seq, lease_ms)`` and remembers when it granted. Prefill's fence
    for the link is valid until its *send* time of the granted request plus the lease: a grant
    delayed by a freeze grants nothing. The decode side of a lost link knows no write it
    allowed starts after its last grant plus the lease. Each end counts a link lost while its
    lease was still live (``leases_fenced``): decode by its last grant, prefill by the latest
    end it was granted; there the fence, not the lease's own end, is what stops the writes.

Cleanup.
    Every per-room entry (binding, held claim, orphan) is dropped when its room is reaped, and
    every mark (tombstone, early abort, held claim) has a TTL: nothing grows with the number of
    rooms ever served.

Quotas (law 7).
    What a peer's frames can make prefill keep is counted against its link, never in a pool
    shared with other links: held claims and the bytes of their page lists, early-abort marks,
    marks of answered rooms, the unknown rooms a ``Reconcile`` is answered for. A link over a
    quota is refused, or loses its own oldest marks; it is counted and logged once. The link
    bounds (``ChannelConfig.max_links``, ``max_links_per_host``) make the sums bounded.
"""

from __future__ import annotations

from kvfsm.control._decode_routing import UNTOLD_REASON, DecodeRouting
from kvfsm.control._prefill_routing import PrefillRouting
from kvfsm.control._routing_common import (
    Action,
    Deliver,
    GrantLease,
    RevokeLease,
    RoutingConfig,
    Send,
    Slot,
)

__all__ = [
    "UNTOLD_REASON",
    "Action",
    "DecodeRouting",
    "Deliver",
    "GrantLease",
    "PrefillRouting",
    "RevokeLease",
    "RoutingConfig",
    "Send",
    "Slot",
]
