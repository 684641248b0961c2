"""Scaling curves: how kvfsm's costs grow with the work, beside raw NIXL on the same work, in one
run.

The other benchmarks measure one pair at a few sizes. Operators run thousands of requests in
flight, dozens of decode servers per prefill, 32k-token prompts on 60 to 160 KV buffers (a
32k-token request on an 80-layer model is 2,048 pages x 160 buffers, about 330k descriptors).
Each curve here sweeps one of those dimensions; every point runs ``transfer.py``'s raw-NIXL
loop and its kvfsm runner (sender rooms through the public facade, the room actors on the
engine's loop, ``NixlTransport`` posting) against a passive NIXL peer process, DRAM to DRAM
over UCX, best of ``--repeat``, every destination checksummed. The curves:

* ``rooms``: rooms in flight 1 -> 4,096 (4 pages of 4 KiB a room, 1 or 2 chunks, at least
  ``2 x`` in-flight rooms per point). kvfsm's control CPU per room is its loop thread's CPU
  (the room actors, the pump, the thread that shares the GIL with a scheduler) per room.
  Target: at the largest count <= 1.5x its value at 16.
* ``peers``: decode peers per prefill 1 -> 32, the rooms spread round-robin over them. The
  peers are NIXL agents in one process (each its own UCX worker and its own slice of the
  buffer: several decode managers per process); kvfsm connects all of them, raw NIXL adds them
  all as remote agents. Target: kvfsm's loop CPU per room at the most peers <= 1.5x at 1.
* ``descriptors``: one room of pages x buffers descriptors, 1,280 -> 327,680 (160 buffers of
  1 KiB pages, 8 -> 2,048 pages), destination pages scattered (one permutation, the same in
  every buffer) and contiguous. Targets: the time to post and complete grows linearly (the
  time per descriptor never rises by more than 1.5x from one size to the next), and kvfsm's
  time above raw NIXL's is <= 0.5 us per descriptor at every size.
* ``page_size``: the same bytes in pages of 4 KiB -> 1 MiB, one room of one chunk, destination
  pages permuted, best of 5 (``--repeat`` sets it too). Target: kvfsm/raw bandwidth >= 0.9
  from 64 KiB up.
* ``live_rooms``: memory per live room with 1,000 -> 10,000 sender rooms parked in
  Bootstrapping (``room_lifecycle.memory_per_live_room``: tracemalloc and RSS). No raw-NIXL
  counterpart (NIXL has no rooms). Target: <= 8 KiB per live room at the most, both figures.

Each curve prints a table and whether its target was met, and writes
``<figures>/scaling_<curve>.json`` and ``.png`` (``--figures``, default ``benchmarks/figures``).
``--quick`` runs fewer points (what ``./dev.sh bench`` runs), ``--tiny`` toy sizes (the test).

Run: ``python benchmarks/scaling.py`` (``--curves rooms,peers``, ``--quick``, ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import room_lifecycle
import transfer
from transfer import KIB, Bench, Case, Heads, Peer, RawNixl, Result, measure

if TYPE_CHECKING:
    from nixl_cu12._api import nixl_prepped_dlist_handle

CURVES: Final = ("rooms", "peers", "descriptors", "page_size", "live_rooms")
FIGURES: Final = Path(__file__).resolve().parent / "figures"
MIB: Final = 1024 * KIB
ROOM_PAGES: Final = 4  # pages of 4 KiB a room on the rooms and peers curves
SMALL_PAGE: Final = 4 * KIB


@dataclass(frozen=True)
class Sizes:
    """The points of each curve for one mode (full, ``--quick``, ``--tiny``)."""

    windows: tuple[int, ...]
    min_rooms: int  # rooms per point on the rooms curve: max(2 x in flight, this)
    peers: tuple[int, ...]
    peer_rooms: int
    peer_window: int
    buffers: int
    desc_pages: tuple[int, ...]
    desc_page_bytes: int
    page_sizes: tuple[int, ...]
    page_total: int  # bytes moved per page-size point
    live: tuple[int, ...]
    repeat: int
    #: repetitions on the page-size curve, whose points are one room of one chunk each: a
    #: single event per repetition, so the noisiest on a shared machine
    page_repeat: int


MODES: Final = {
    "full": Sizes(
        windows=(1, 4, 16, 64, 256, 1024, 4096),
        min_rooms=1024,
        peers=(1, 2, 4, 8, 16, 32),
        peer_rooms=1024,
        peer_window=64,
        buffers=160,
        desc_pages=(8, 32, 128, 512, 2048),
        desc_page_bytes=KIB,
        page_sizes=(4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB),
        page_total=256 * MIB,
        live=(1000, 3000, 10_000),
        repeat=3,
        page_repeat=5,
    ),
    "quick": Sizes(
        windows=(1, 16, 256, 4096),
        min_rooms=512,
        peers=(1, 4, 32),
        peer_rooms=512,
        peer_window=64,
        buffers=160,
        desc_pages=(8, 128, 2048),
        desc_page_bytes=KIB,
        page_sizes=(4 * KIB, 64 * KIB, MIB),
        page_total=128 * MIB,
        live=(1000, 10_000),
        repeat=3,
        page_repeat=5,
    ),
    "tiny": Sizes(
        windows=(1, 16),
        min_rooms=32,
        peers=(1, 2),
        peer_rooms=16,
        peer_window=4,
        buffers=4,
        desc_pages=(8, 32),
        desc_page_bytes=KIB,
        page_sizes=(4 * KIB, 64 * KIB),
        page_total=4 * MIB,
        live=(200,),
        repeat=1,
        page_repeat=1,
    ),
}


# -- shared pieces -----------------------------------------------------------------------------


@contextlib.contextmanager
def _bench(
    cases: Sequence[Case], repeat: int, agents: int = 1, peer_bytes: int = 0
) -> Iterator[Bench]:
    """A source buffer and a peer process sized for ``cases`` (``agents`` NIXL agents in it,
    ``peer_bytes`` of buffer if more), every resource the runners build closed on exit, then
    the peer stopped."""
    src = transfer._source(max(case.src_bytes for case in cases))
    nbytes = max(peer_bytes, *(case.dst_bytes for case in cases))
    peer = Peer(nbytes, f"scaling-decode-{os.getpid()}", agents=agents)
    try:
        bench = Bench(peer=peer, src=src, repeat=repeat)
        with bench.stack:
            yield bench
    finally:
        peer.close()


def _interleaved(
    case: Case, bench: Bench, runs: Sequence[Callable[[Case, Bench], Result]]
) -> list[Result]:
    """Each of ``runs`` on ``case``, one repetition each in turn, ``bench.repeat`` rounds, so
    that a change of load on this shared machine hits every runner alike; each runner's
    fastest repetition (with that repetition's CPU, as ``measure`` reports it)."""
    rounds, bench.repeat = bench.repeat, 1
    best: list[Result | None] = [None] * len(runs)
    try:
        for _ in range(rounds):
            for i, run in enumerate(runs):
                result = run(case, bench)
                if (prev := best[i]) is None or result.seconds < prev.seconds:
                    if prev is not None:
                        result.samples = prev.samples + result.samples
                    best[i] = result
                elif prev is not None:
                    prev.samples.extend(result.samples)
    finally:
        bench.repeat = rounds
    return [r for r in best if r is not None]


def _raw_and_kvfsm(case: Case, bench: Bench) -> tuple[Result, Result]:
    raw, kv = _interleaved(case, bench, (transfer.run_raw_nixl, transfer.run_kvfsm))
    return raw, kv


def _per_room(r: Result) -> dict[str, float]:
    """One row's figures per room: wall, process CPU, and the loop (kvfsm) or posting (raw
    NIXL) thread's CPU."""
    thread = (r.cpu_us_per_chunk or 0.0) * r.chunks / r.rooms
    return {
        "wall_us_per_room": r.seconds / r.rooms * 1e6,
        "process_cpu_us_per_room": r.extra["process_cpu_s"] / r.rooms * 1e6,
        "thread_cpu_us_per_room": thread,
        "room_p50_us": r.extra.get("room_p50_us", 0.0),
        "gbps": r.gbps,
        # kvfsm: how often its pump went round per room (where loop CPU goes with many peers)
        "pump_rounds_per_room": r.extra.get("pump_rounds", 0.0) / r.rooms,
        # kvfsm: NIXL requests per room (below 1 where rooms' chunks merged into one request)
        "nixl_requests_per_room": r.extra.get("nixl_requests", 0.0) / r.rooms,
        # kvfsm: the poster's hand-backs of results to the loop per room (each a wake-up)
        "hand_backs_per_room": r.extra.get("poster_hand_backs", 0.0) / r.rooms,
    }


def _room_case(name: str, rooms: tuple[transfer.Room, ...], pages: int, window: int) -> Case:
    note = f"{ROOM_PAGES} x 4 KiB pages a room, {window} in flight"
    return Case(name, SMALL_PAGE, pages, rooms, window, note)


def _ratio_target(points: list[dict[str, Any]], key: str, at: int, ref: int) -> float | None:
    by = {p["x"]: p for p in points}
    if at not in by or ref not in by or not by[ref]["kvfsm"][key]:
        return None
    return float(by[at]["kvfsm"][key] / by[ref]["kvfsm"][key])


# -- curve: rooms in flight --------------------------------------------------------------------


def curve_rooms(sizes: Sizes) -> dict[str, Any]:
    rng = np.random.default_rng(20261206)
    counts = [max(2 * w, sizes.min_rooms) for w in sizes.windows]
    pool = max(counts) * ROOM_PAGES
    rooms = transfer._rooms(pool, ROOM_PAGES, 2, rng)  # one destination permutation for all
    cases = [
        _room_case(f"rooms_{w}", rooms[:n], pool, w)
        for w, n in zip(sizes.windows, counts, strict=True)
    ]
    points = []
    with _bench(cases, sizes.repeat) as bench:
        for w, case in zip(sizes.windows, cases, strict=True):
            raw, kv = _raw_and_kvfsm(case, bench)
            points.append({"x": w, "rooms": len(case.rooms), **_pair(raw, kv)})
    ratio = _ratio_target(points, "thread_cpu_us_per_room", max(sizes.windows), 16)
    return {
        "x_label": "rooms in flight",
        "metric": "kvfsm loop-thread CPU per room (us)",
        "points": points,
        "target": f"kvfsm control CPU per room at {max(sizes.windows)} in flight <= 1.5x at 16",
        "value": ratio,
        "met": ratio is not None and ratio <= 1.5,
    }


def _pair(raw: Result, kv: Result) -> dict[str, Any]:
    a, b = _per_room(raw), _per_room(kv)
    return {
        "raw_nixl": a,
        "kvfsm": b,
        "kvfsm_caller_cpu_us_per_room": kv.extra.get("caller_cpu_ms", 0.0) / kv.rooms * 1e3,
        # What kvfsm's process spends beyond raw NIXL's for the same rooms (the copies and a
        # minimal loop are in both), per room.
        "extra_process_cpu_us_per_room": b["process_cpu_us_per_room"]
        - a["process_cpu_us_per_room"],
        "bandwidth_ratio": kv.gbps / raw.gbps,
    }


# -- curve: decode peers per prefill -----------------------------------------------------------


class PeersKvfsm(transfer.Kvfsm):
    """kvfsm connected to the first ``peers`` agents of the peer process as ``decode<i>``, each
    with its own slice of ``slice_pages`` pages; a room goes to the peer whose slice holds its
    destination pages."""

    def __init__(self, bench: Bench, pages: int, slice_pages: int, peers: int) -> None:
        self.slice_pages, self.peers = slice_pages, peers
        super().__init__(bench, SMALL_PAGE, pages, name="kvfsm")

    def _connect(self, remote: Any, piece: Any) -> None:
        from kvfsm.transport import LayoutSummary

        peer, part = self.bench.peer, self.slice_pages * SMALL_PAGE
        for i, metadata in enumerate(peer.metadatas[: self.peers]):
            summary = LayoutSummary(
                kv=((peer.base + i * part, part, SMALL_PAGE, 0),), kv_kind=remote.kv_kind
            )
            self.engine.call(self.transport.connect_peer(f"decode{i}", metadata, summary, piece))

    def _destinations(self, case: Case) -> list[tuple[str, bytes]]:
        out = []
        for room in case.rooms:
            dst = np.concatenate([d for _, d in room])
            i = int(dst[0]) // self.slice_pages
            out.append((f"decode{i}", (dst - i * self.slice_pages).astype(np.int32).tobytes()))
        return out


class PeersRaw(RawNixl):
    """Raw NIXL with the first ``peers`` agents of the peer process added as remote agents and
    one prepared list per agent over its slice."""

    def __init__(self, bench: Bench, slice_pages: int, peers: int) -> None:
        super().__init__(bench)  # adds agent 0
        self.slice_pages = slice_pages
        self.names = [self.remote or ""]
        for metadata in bench.peer.metadatas[1:peers]:
            self.names.append(self.agent.add_remote_agent(metadata))

    def close(self) -> None:
        for name in self.names[1:]:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)
        self.names = self.names[:1]
        super().close()

    def run(self, case: Case) -> Result:
        bench, agent, page = self.bench, self.agent, case.page_bytes
        part = self.slice_pages * page
        lists: list[nixl_prepped_dlist_handle] = []
        try:
            lists.append(
                agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", transfer._descs(bench.src_addr, case.pages, page), "DRAM"
                )
            )
            for i, name in enumerate(self.names):
                descs = transfer._descs(bench.peer.base + i * part, self.slice_pages, page)
                lists.append(agent.prep_xfer_dlist(name, descs, "DRAM"))
            local, remotes = lists[0], lists[1:]
            route = []
            for room in case.rooms:
                i = int(room[0][1][0]) // self.slice_pages
                route.append((remotes[i], i * self.slice_pages))
            return measure(
                "raw_nixl",
                case,
                bench,
                reset=bench.peer.clear,
                go=lambda: self._send(case, local, remotes[0], route),
                checksum=lambda: bench.peer.checksum(case),
            )
        finally:
            for handle in lists:
                agent.release_dlist_handle(handle)


def curve_peers(sizes: Sizes) -> dict[str, Any]:
    rng = np.random.default_rng(20261207)
    n = sizes.peer_rooms
    src_pages = n * ROOM_PAGES
    slice_pages = src_pages  # with one peer, every room lands in slice 0
    most = max(sizes.peers)
    cases = []
    for peers in sizes.peers:
        rooms: list[transfer.Room] = []
        perms = [rng.permutation(slice_pages).astype(np.int32) for _ in range(peers)]
        for r in range(n):
            i, k = r % peers, r // peers
            src = np.arange(r * ROOM_PAGES, (r + 1) * ROOM_PAGES, dtype=np.int32)
            dst = perms[i][k * ROOM_PAGES : (k + 1) * ROOM_PAGES] + i * slice_pages
            cut = int(rng.integers(1, ROOM_PAGES))
            two = bool(rng.integers(0, 2))
            chunks = ((src[:cut], dst[:cut]), (src[cut:], dst[cut:])) if two else ((src, dst),)
            rooms.append(chunks)
        case = _room_case(f"peers_{peers}", tuple(rooms), src_pages, sizes.peer_window)
        cases.append(case)
    points = []
    # The peer's buffer: one slice per agent (Case.dst_bytes covers the source pages only).
    with _bench(cases, sizes.repeat, most, most * slice_pages * SMALL_PAGE) as bench:
        raw = PeersRaw(bench, slice_pages, most)
        bench.stack.callback(raw.close)
        kv = PeersKvfsm(bench, src_pages, slice_pages, most)
        bench.stack.callback(kv.close)
        runs = (lambda c, _: raw.run(c), lambda c, _: kv.run(c))
        for peers, case in zip(sizes.peers, cases, strict=True):
            points.append({"x": peers, "rooms": n, **_pair(*_interleaved(case, bench, runs))})
    ratio = _ratio_target(points, "thread_cpu_us_per_room", most, 1)
    return {
        "x_label": "decode peers per prefill",
        "metric": "kvfsm loop-thread CPU per room (us)",
        "points": points,
        "target": f"kvfsm CPU per room at {most} peers <= 1.5x at 1",
        "value": ratio,
        "met": ratio is not None and ratio <= 1.5,
        "note": f"{sizes.peer_window} rooms in flight; every point connected to all {most} peers",
    }


# -- curve: descriptors per room ---------------------------------------------------------------


def curve_descriptors(sizes: Sizes) -> dict[str, Any]:
    rng = np.random.default_rng(20261208)
    page = sizes.desc_page_bytes
    cases: list[tuple[int, str, Case]] = []
    for pages in sizes.desc_pages:
        # Whole pages in ``buffers`` regions: Heads with one row a page and equal TP is one
        # descriptor per (buffer, page) on both sides, for raw NIXL and for kvfsm alike.
        heads = Heads(sizes.buffers, 1, page, 1, 1, 0, 1, 0)
        arange = np.arange(pages, dtype=np.int32)
        for layout, dst in (("scattered", rng.permutation(pages).astype(np.int32)),
                            ("contiguous", arange.copy())):  # fmt: skip
            name = f"desc_{layout}_{pages}"
            note = f"{sizes.buffers} buffers x {pages} pages of {page} B, {layout}"
            case = Case(name, page, pages, (((arange, dst),),), 1, note, heads)
            cases.append((sizes.buffers * pages, layout, case))
    rows: dict[str, list[dict[str, Any]]] = {"scattered": [], "contiguous": []}
    with _bench([c for _, _, c in cases], sizes.repeat) as bench:
        for descriptors, layout, case in cases:
            raw, kv = _raw_and_kvfsm(case, bench)
            rows[layout].append(
                {
                    "x": descriptors,
                    "raw_nixl_s": raw.seconds,
                    "kvfsm_s": kv.seconds,
                    "raw_nixl_us_per_desc": raw.seconds / descriptors * 1e6,
                    "kvfsm_us_per_desc": kv.seconds / descriptors * 1e6,
                    "extra_us_per_desc": (kv.seconds - raw.seconds) / descriptors * 1e6,
                    "kvfsm_loop_cpu_us": (kv.cpu_us_per_chunk or 0.0) * kv.chunks,
                    "raw_process_cpu_s": raw.extra["process_cpu_s"],
                    "kvfsm_process_cpu_s": kv.extra["process_cpu_s"],
                }
            )
    for points in rows.values():
        # The marginal cost: what one more descriptor adds between two sizes, kvfsm above raw
        # NIXL (the fixed cost of a room, the same at every size, cancels out).
        for a, b in itertools.pairwise(points):
            grow_kv, grow_raw = b["kvfsm_s"] - a["kvfsm_s"], b["raw_nixl_s"] - a["raw_nixl_s"]
            b["marginal_extra_us_per_desc"] = (grow_kv - grow_raw) / (b["x"] - a["x"]) * 1e6
    worst = max(p["extra_us_per_desc"] for layout in rows.values() for p in layout)
    linear = {
        runner: all(_linear(points, runner) for points in rows.values())
        for runner in ("raw_nixl", "kvfsm")
    }
    return {
        "x_label": "descriptors per room",
        "metric": "time to post and complete (s)",
        "points": rows["scattered"],
        "contiguous": rows["contiguous"],
        "target": "kvfsm's time grows linearly; kvfsm above raw NIXL <= 0.5 us per descriptor "
        "at every size",
        "value": worst,
        "linear": linear,
        "worst_marginal_extra_us_per_desc": max(
            (p.get("marginal_extra_us_per_desc", 0.0) for ps in rows.values() for p in ps),
            default=0.0,
        ),
        "met": linear["kvfsm"] and worst <= 0.5,
    }


def _linear(points: list[dict[str, Any]], runner: str) -> bool:
    """No superlinear step: the time per descriptor never rises by more than 1.5x from one size
    to the next (fixed costs make it fall at small sizes)."""
    per = [p[f"{runner}_us_per_desc"] for p in points]
    return all(b <= 1.5 * a for a, b in itertools.pairwise(per))


# -- curve: page size --------------------------------------------------------------------------


def curve_page_size(sizes: Sizes) -> dict[str, Any]:
    rng = np.random.default_rng(20261209)
    cases = []
    for page in sizes.page_sizes:
        pages = sizes.page_total // page
        arange = np.arange(pages, dtype=np.int32)
        perm = rng.permutation(pages).astype(np.int32)
        note = f"{pages} pages of {page} B, one chunk, dst permuted"
        cases.append(Case(f"page_{page}", page, pages, (((arange, perm),),), 1, note))
    points = []
    with _bench(cases, sizes.page_repeat) as bench:
        for page, case in zip(sizes.page_sizes, cases, strict=True):
            raw, kv = _raw_and_kvfsm(case, bench)
            points.append(
                {
                    "x": page,
                    "raw_nixl_gbps": raw.gbps,
                    "kvfsm_gbps": kv.gbps,
                    "ratio": kv.gbps / raw.gbps,
                    "raw_nixl_s": raw.seconds,
                    "kvfsm_s": kv.seconds,
                }
            )
    judged = [p["ratio"] for p in points if p["x"] >= 64 * KIB]
    worst = min(judged) if judged else None
    return {
        "x_label": "page size (bytes)",
        "metric": "bandwidth (GB/s)",
        "points": points,
        "target": "kvfsm/raw NIXL bandwidth >= 0.9 from 64 KiB up",
        "value": worst,
        "met": worst is not None and worst >= 0.9,
        "note": f"{sizes.page_total // MIB} MiB per point",
    }


# -- curve: live rooms -------------------------------------------------------------------------


def curve_live_rooms(sizes: Sizes) -> dict[str, Any]:
    points = [{"x": n, **room_lifecycle.memory_per_live_room(n)} for n in sizes.live]
    last = points[-1]
    worst = max(last["bytes_per_live_room"], last["rss_bytes_per_live_room"])
    return {
        "x_label": "live rooms",
        "metric": "bytes per live room",
        "points": points,
        "target": f"<= 8 KiB per live room at {last['x']}, traced and RSS",
        "value": worst,
        "met": worst <= 8 * KIB,
        "note": "sender rooms parked in Bootstrapping on the null transport (no NIXL)",
    }


RUNS: Final[dict[str, Callable[[Sizes], dict[str, Any]]]] = {
    "rooms": curve_rooms,
    "peers": curve_peers,
    "descriptors": curve_descriptors,
    "page_size": curve_page_size,
    "live_rooms": curve_live_rooms,
}


# -- tables and plots --------------------------------------------------------------------------


def print_curve(name: str, c: dict[str, Any]) -> None:
    print(f"\n== {name}: {c['metric']} against {c['x_label']}")
    pts = c["points"]
    if name in ("rooms", "peers"):
        print(
            f"{'x':>6} {'rooms':>6} | {'raw wall':>9} {'raw CPU':>8} | {'kvfsm wall':>10} "
            f"{'loop CPU':>9} {'caller':>7} {'process':>8} {'reqs':>5} {'backs':>5} | "
            f"{'extra CPU':>9}   (us per room; reqs: kvfsm's NIXL requests per room; backs:"
            " its poster's hand-backs to the loop per room)"
        )
        for p in pts:
            r, k = p["raw_nixl"], p["kvfsm"]
            print(
                f"{p['x']:>6} {p['rooms']:>6} | {r['wall_us_per_room']:>9.1f} "
                f"{r['process_cpu_us_per_room']:>8.1f} | {k['wall_us_per_room']:>10.1f} "
                f"{k['thread_cpu_us_per_room']:>9.1f} {p['kvfsm_caller_cpu_us_per_room']:>7.1f} "
                f"{k['process_cpu_us_per_room']:>8.1f} {k['nixl_requests_per_room']:>5.2f} "
                f"{k['hand_backs_per_room']:>5.2f} | "
                f"{p['extra_process_cpu_us_per_room']:>9.1f}"
            )
    elif name == "descriptors":
        print(f"{'layout':<10} {'descs':>8} {'raw s':>9} {'kvfsm s':>9} {'raw us/d':>9} "
              f"{'kvfsm us/d':>10} {'extra us/d':>10} {'marginal':>9}")  # fmt: skip
        for layout, rows in (("scattered", pts), ("contiguous", c["contiguous"])):
            for p in rows:
                print(
                    f"{layout:<10} {p['x']:>8,} {p['raw_nixl_s']:>9.4f} {p['kvfsm_s']:>9.4f} "
                    f"{p['raw_nixl_us_per_desc']:>9.3f} {p['kvfsm_us_per_desc']:>10.3f} "
                    f"{p['extra_us_per_desc']:>10.3f} "
                    f"{p.get('marginal_extra_us_per_desc', float('nan')):>9.3f}"
                )
        print(
            "linear (time per descriptor never up 1.5x from one size to the next): "
            + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in c["linear"].items())
            + "; marginal: kvfsm above raw NIXL per added descriptor"
        )
    elif name == "page_size":
        print(f"{'page':>9} {'raw GB/s':>9} {'kvfsm GB/s':>10} {'kvfsm/raw':>9}")
        for p in pts:
            print(f"{p['x']:>9,} {p['raw_nixl_gbps']:>9.2f} {p['kvfsm_gbps']:>10.2f} "
                  f"{p['ratio']:>9.2f}")  # fmt: skip
    else:
        print(f"{'live':>7} {'traced B/room':>14} {'RSS B/room':>11}")
        for p in pts:
            print(f"{p['x']:>7,} {p['bytes_per_live_room']:>14,.0f} "
                  f"{p['rss_bytes_per_live_room']:>11,.0f}")  # fmt: skip
    value = c["value"]
    shown = "-" if value is None else f"{value:.3g}"
    print(f"target: {c['target']}: {shown} -> {'met' if c['met'] else 'NOT met'}")


def plot_curve(name: str, c: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    pts = c["points"]
    xs = [p["x"] for p in pts]
    if name in ("rooms", "peers"):
        ax.plot(xs, [p["kvfsm"]["thread_cpu_us_per_room"] for p in pts], "o-",
                label="kvfsm loop-thread CPU")  # fmt: skip
        ax.plot(xs, [p["kvfsm"]["process_cpu_us_per_room"] for p in pts], "s--",
                label="kvfsm process CPU")  # fmt: skip
        ax.plot(xs, [p["raw_nixl"]["process_cpu_us_per_room"] for p in pts], "^-",
                label="raw NIXL process CPU")  # fmt: skip
        ax.set_ylabel("CPU per room (us)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    elif name == "descriptors":
        for layout, rows, style in (("scattered", pts, "-"), ("contiguous", c["contiguous"], ":")):
            dx = [p["x"] for p in rows]
            ax.plot(dx, [p["kvfsm_s"] for p in rows], "o" + style, label=f"kvfsm, {layout}")
            ax.plot(dx, [p["raw_nixl_s"] for p in rows], "^" + style, label=f"raw NIXL, {layout}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylabel("time to post and complete (s)")
    elif name == "page_size":
        ax.plot(xs, [p["kvfsm_gbps"] for p in pts], "o-", label="kvfsm")
        ax.plot(xs, [p["raw_nixl_gbps"] for p in pts], "^-", label="raw NIXL")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // MIB} MiB" if x >= MIB else f"{x // KIB} KiB" for x in xs])
        ax.set_ylabel("GB/s")
        ratio = ax.twinx()
        ratio.plot(xs, [p["ratio"] for p in pts], "k:", label="kvfsm/raw")
        ratio.axhline(0.9, color="grey", lw=0.8)
        ratio.set_ylabel("kvfsm/raw (target >= 0.9 from 64 KiB)")
        ratio.set_ylim(0, max(1.2, max(p["ratio"] for p in pts) * 1.1))
    else:
        ax.plot(xs, [p["bytes_per_live_room"] for p in pts], "o-", label="tracemalloc")
        ax.plot(xs, [p["rss_bytes_per_live_room"] for p in pts], "s--", label="RSS")
        ax.axhline(8 * KIB, color="grey", lw=0.8, label="target 8 KiB")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_ylabel("bytes per live room")
    ax.set_xlabel(c["x_label"])
    ax.set_ylim(bottom=0 if ax.get_yscale() == "linear" else None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    verdict = "met" if c["met"] else "not met"
    ax.set_title(f"scaling: {name} ({verdict})\n{c['target']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it is below it (the printed output is
    kept in the repository), else as given."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


# -- the run -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--curves", default=",".join(CURVES), help=f"of {','.join(CURVES)}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer points (./dev.sh bench)")
    mode.add_argument("--tiny", action="store_true", help="toy sizes (the test)")
    parser.add_argument("--repeat", type=int, help="repetitions per point; the best is reported")
    parser.add_argument("--figures", type=Path, default=FIGURES, help="where JSON and PNGs go")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines go to stdout
    curves = args.curves.split(",")
    unknown = [c for c in curves if c not in RUNS]
    if unknown:
        parser.error(f"unknown curve: {', '.join(unknown)}")
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    sizes = MODES[name]
    if args.repeat is not None:
        if args.repeat < 1:
            parser.error("--repeat must be >= 1")
        sizes = Sizes(**{**vars(sizes), "repeat": args.repeat, "page_repeat": args.repeat})
    args.figures.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {
        "mode": name,
        "python": sys.version.split()[0],
        "nixl": transfer._nixl_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "curves": {},
    }
    for curve in curves:
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        try:
            result = RUNS[curve](sizes)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        result.update(
            curve=curve,
            mode=name,
            repeat=sizes.page_repeat if curve == "page_size" else sizes.repeat,
            command=command.strip(),
            loadavg_start=load0,
            loadavg_end=os.getloadavg()[0],
            wall_s=time.perf_counter() - t0,
            cpus=os.cpu_count(),
        )
        report["curves"][curve] = result
        (args.figures / f"scaling_{curve}.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_curve(curve, result, args.figures / f"scaling_{curve}.png")
        if not args.json:
            print_curve(curve, result)
            print(f"load {load0:.2f} -> {result['loadavg_end']:.2f}, {result['wall_s']:.1f} s; "
                  f"{_shown(args.figures / f'scaling_{curve}.png')}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
