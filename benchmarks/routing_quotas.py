"""What peers can make a prefill rank keep: the per-link quotas and link bounds, in bytes.

Prefill's routing core (``PrefillRouting``) is filled to every per-link quota by links that
send nothing but frames within them, at the default ``ChannelConfig``; ``tracemalloc`` measures
what each table costs per entry, and what ``links`` full links cost in all:

* held    - claims and page lists held for rooms that do not exist yet (``pending_max`` a link):
            one claim with a 16-byte page list; the page lists' own bytes are bounded apart,
            by ``held_bytes_max`` a link;
* early   - early-abort marks (``pending_max`` a link; as many again per link for the marks
            lost links leave, in their hosts' shares), with a 256-character reason (the most a
            mark keeps);
* finished - marks of decode rooms already answered (``pending_max`` a link);
* link    - the whole of one link filled at once (the three above, the answered marks of its
            aborts and of a Reconcile of unknown rooms, and the link's record), measured over
            ``links`` links and divided.

The worst case it prints is per link: ``held_bytes_max`` + ``outbox_max_bytes`` (frames
queued for a peer that does not take them; past it prefill stops reading that peer) plus the
answers to one read (64 KiB of frames) + the measured entries; in all: that times
``max_links``, plus the early-abort marks of lost links (``pending_max * max_links`` more).
Connections still in their handshake are bounded apart (``max_unauthenticated *
hello_max_bytes``, docs/reliability.md).

Run: ``python benchmarks/routing_quotas.py [--links 16] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tracemalloc
from collections.abc import Callable

import numpy as np

from kvfsm.control import ChannelConfig
from kvfsm.control._frames import Reconcile, RoomAbort, RoomClaim, RoomMetadata, pack_refs
from kvfsm.control._routing import PrefillRouting

MIB = 1 << 20
PAGES = np.arange(4, dtype="<i4").tobytes()
REASON = "r" * 256


def measured(fill: Callable[[PrefillRouting], int], core: PrefillRouting) -> float:
    """Bytes per entry that ``fill`` (returning how many it added) makes ``core`` keep."""
    gc.collect()
    before, _ = tracemalloc.get_traced_memory()
    n = fill(core)
    gc.collect()
    after, _ = tracemalloc.get_traced_memory()
    return (after - before) / n


def fill_link(core: PrefillRouting, link: int, what: str, m: int) -> int:
    base = link * 10_000_000
    if what in ("held", "all"):
        for i in range(m // 2):
            core.on_claim(link, RoomClaim(base + i, 1), 0.0)
        for i in range(m // 2, m):
            core.on_metadata(link, RoomMetadata(base + i, 1, PAGES, 0), 0.0)
    if what in ("early", "all"):
        for i in range(m):  # (each also marks its room answered: measured with "finished")
            reason = f"{i:08d}{REASON}"[:256]  # a string of its own, as a decoded frame's is
            core.on_abort(link, RoomAbort(base + m + i, 1, reason), 0.0)
    if what in ("finished", "all"):
        refs = pack_refs([(base + 2 * m + i, 1) for i in range(m)])
        core.on_reconcile(link, Reconcile(refs), 0.0)
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", type=int, default=16, help="links filled at once")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # Every link here goes over a quota on purpose: the core's one line per link is not news.
    logging.getLogger("kvfsm.control").setLevel(logging.ERROR)
    channel = ChannelConfig()
    config = channel.routing()
    m = config.pending_max
    tracemalloc.start()

    def fresh(links: int) -> PrefillRouting:
        core = PrefillRouting(config)
        for link in range(1, links + 1):
            core.link_opened(link, f"decode-{link}-1", 0.0, 0.0, 2000, host="10.0.0.9")
        return core

    per_entry: dict[str, float] = {}
    # Each table alone. An early abort also marks its room answered: its own cost is that less
    # the answered mark's, which a Reconcile of unknown rooms measures alone.
    per_entry["finished"] = measured(lambda c: fill_link(c, 1, "finished", m), fresh(1))
    both = measured(lambda c: fill_link(c, 1, "early", m), fresh(1))
    per_entry["early"] = both - per_entry["finished"]
    per_entry["held"] = measured(lambda c: fill_link(c, 1, "held", m), fresh(1))

    links = args.links

    def fill_all(core: PrefillRouting) -> int:
        for link in range(1, links + 1):
            fill_link(core, link, "all", m)
        return links

    core = fresh(links)
    per_link = measured(fill_all, core)
    entries = core.entries()
    tracemalloc.stop()

    entries_per_link = per_link  # held + early + 2 x finished (aborts and refs), measured
    one_read = 8 * 65536  # the answers to one read: a 30-byte claim refused is ~250 bytes
    worst_link = entries_per_link + config.held_bytes_max + channel.outbox_max_bytes + one_read
    lost_marks = m * channel.max_links * per_entry["early"]
    worst_total = channel.max_links * worst_link + lost_marks
    pre_auth = channel.max_unauthenticated * (channel.hello_max_bytes + 65536)
    report = {
        "config": {
            "pending_max": m,
            "held_bytes_max": config.held_bytes_max,
            "outbox_max_bytes": channel.outbox_max_bytes,
            "max_links": channel.max_links,
            "max_links_per_host": channel.max_links_per_host,
            "max_unauthenticated": channel.max_unauthenticated,
            "max_unauthenticated_per_host": channel.max_unauthenticated_per_host,
        },
        "bytes_per_entry": {k: round(v) for k, v in per_entry.items()},
        "links_filled": links,
        "entries_kept": entries,
        "bytes_per_full_link_measured": round(per_link),
        "worst_per_link_mib": round(worst_link / MIB, 1),
        "worst_per_host_mib": round(channel.max_links_per_host * worst_link / MIB, 1),
        "worst_lost_links_marks_mib": round(lost_marks / MIB, 1),
        "worst_total_mib": round(worst_total / MIB, 1),
        "pre_authentication_mib": round(pre_auth / MIB, 1),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"defaults: {report['config']}")
    for name, value in report["bytes_per_entry"].items():
        print(f"  {name:9s} {value:6d} B per entry, {value * m / MIB:5.2f} MiB per link at quota")
    print(
        f"  one link at every quota ({links} filled at once): "
        f"{per_link / MIB:.2f} MiB of entries; entries kept {entries}"
    )
    print(
        f"worst case per link: {report['worst_per_link_mib']} MiB (entries + held_bytes_max + "
        f"outbox_max_bytes + one read's answers); per host: {report['worst_per_host_mib']} "
        f"MiB; lost links' marks: {report['worst_lost_links_marks_mib']} MiB; in all "
        f"(max_links links): {report['worst_total_mib']} MiB; before authentication: "
        f"{report['pre_authentication_mib']} MiB"
    )


if __name__ == "__main__":
    main()
