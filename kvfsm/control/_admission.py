"""Which connections prefill's control listener keeps, sans-IO: the bounds on connections still
in their handshake and on links, in total and per peer host.

Rule 1: a connection is *unauthenticated* until its peer proved the secret (without a secret:
        until its Hello was checked). At most ``max_unauthenticated`` wait at once, and at most
        ``max_unauthenticated_per_host`` from one host. A new one over the host's bound sheds
        that host's oldest; over the total, the oldest of all. A host that opens connections
        in a loop sheds its own, never another host's.
Rule 2: a *link* slot is taken only once the peer is authenticated, before prefill loads its
        NIXL metadata: strangers without the secret never hold one. At most ``max_links``
        links (taken slots included), at most ``max_links_per_host`` from one host. A link
        over a bound is refused (never one already open), with the bound's name in the
        reason. A reconnection that replaces a link of the same peer incarnation from the
        same host does not count twice.
Rule 3: the routing core's per-link quotas times these bounds are what peers can make prefill
        keep (docs/reliability.md gives the figures).

Tokens are whatever the listener names a connection by (its cancel scope); links are named by
their generation. Nothing here reads a clock or touches a socket, except the throttled log.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["Admission", "Throttled"]


@dataclass(slots=True)
class _Host:
    waiting: dict[Hashable, None] = field(default_factory=dict)  # unauthenticated, oldest first
    links: int = 0  # open links and taken slots


class Admission:
    """The listener's books (Rules 1 and 2). Loop thread only."""

    def __init__(
        self,
        *,
        max_unauthenticated: int,
        max_unauthenticated_per_host: int,
        max_links: int,
        max_links_per_host: int,
    ) -> None:
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_host = max_unauthenticated_per_host
        self.max_links = max_links
        self.max_links_per_host = max_links_per_host
        self._hosts: dict[str, _Host] = {}
        self._waiting: dict[Hashable, str] = {}  # unauthenticated -> host, oldest first
        self._slots: dict[Hashable, str] = {}  # slots taken, link not open yet -> host
        self._links: dict[int, str] = {}  # open links -> host
        self._count = 0  # links + slots

    @property
    def links(self) -> int:
        """Links open, and slots taken by handshakes about to open one."""
        return self._count

    def links_from(self, host: str) -> int:
        entry = self._hosts.get(host)
        return 0 if entry is None else entry.links

    def host_of(self, generation: int) -> str:
        """The peer host of open link ``generation`` ('' if unknown)."""
        return self._links.get(generation, "")

    def waiting(self, host: str | None = None) -> int:
        """Unauthenticated connections (from ``host``)."""
        if host is None:
            return len(self._waiting)
        entry = self._hosts.get(host)
        return 0 if entry is None else len(entry.waiting)

    def arrived(self, token: Hashable, host: str) -> list[Hashable]:
        """A new connection from ``host``; returns those to shed now (Rule 1)."""
        entry = self._hosts.setdefault(host, _Host())
        entry.waiting[token] = None
        self._waiting[token] = host
        shed: list[Hashable] = []
        if len(entry.waiting) > self.max_unauthenticated_per_host:
            shed.append(next(iter(entry.waiting)))
            self.authenticated(shed[-1])
        if len(self._waiting) > self.max_unauthenticated:
            shed.append(next(iter(self._waiting)))
            self.authenticated(shed[-1])
        return shed

    def authenticated(self, token: Hashable) -> None:
        """The connection no longer counts as unauthenticated (proved, shed or gone)."""
        host = self._waiting.pop(token, None)
        if host is not None:
            entry = self._hosts[host]
            del entry.waiting[token]
            self._forget(host, entry)

    def take_slot(self, token: Hashable, host: str, replaces: int | None = None) -> str | None:
        """An authenticated peer from ``host`` asks for a link: take a slot for it and return
        None, or return why it is refused (Rule 2). ``replaces``: the generation of the open
        link it will replace (the same peer incarnation reconnecting), if any."""
        entry = self._hosts.setdefault(host, _Host())
        discount = 1 if replaces is not None and self._links.get(replaces) == host else 0
        refusal = None
        if entry.links - discount >= self.max_links_per_host:
            refusal = (
                f"{entry.links} control links from {host} already "
                f"(ChannelConfig.max_links_per_host {self.max_links_per_host})"
            )
        elif self._count - discount >= self.max_links:
            refusal = (
                f"{self._count} control links already (ChannelConfig.max_links {self.max_links})"
            )
        if refusal is not None:
            self._forget(host, entry)
            return refusal
        self._slots[token] = host
        entry.links += 1
        self._count += 1
        return None

    def opened(self, token: Hashable, generation: int) -> None:
        """The slot ``token`` took is the open link ``generation`` now."""
        host = self._slots.pop(token, None)
        if host is not None:
            self._links[generation] = host

    def released(self, token: Hashable) -> None:
        """The connection's handshake is over: what it still holds goes (a slot that never
        became a link, or its unauthenticated place)."""
        self.authenticated(token)
        host = self._slots.pop(token, None)
        if host is not None:
            self._drop_link(host)

    def closed(self, generation: int) -> None:
        """Link ``generation`` is lost: its slot is free."""
        host = self._links.pop(generation, None)
        if host is not None:
            self._drop_link(host)

    def _drop_link(self, host: str) -> None:
        entry = self._hosts[host]
        entry.links -= 1
        self._count -= 1
        self._forget(host, entry)

    def _forget(self, host: str, entry: _Host) -> None:
        if not entry.waiting and entry.links == 0:
            del self._hosts[host]


class Throttled:
    """A warning that a flood would repeat: logged at once, then at most once per
    ``every_s`` with how many were left out since (the caller passes ``now``)."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self._log = log
        self._every = every_s
        self._next = float("-inf")
        self._left_out = 0

    def warning(self, now: float, message: str) -> None:
        if now < self._next:
            self._left_out += 1
            return
        self._next = now + self._every
        more = self._left_out
        self._left_out = 0
        if more:
            message = (
                f"{message} ({more} more like it since the last line; one per {self._every:g} s)"
            )
        self._log.warning("%s", message)
