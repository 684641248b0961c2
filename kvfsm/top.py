"""``kvfsm top``: a live terminal view of one or more ranks' status servers.

For each status server (:mod:`kvfsm.status`) it shows

* its live rooms by role and state, and its counters since it started;
* the oldest rooms that are not terminal: their age, the state they wait in, the time left
  before that state's deadline and how much of the deadline is used;
* each control link: up or down, the heartbeat's round trip, the write lease, last heard;
* GB/s, rooms finished per second and failures by reason kind over the last minute.

Polling (:class:`Poller`: plain HTTP GETs, one thread per server) is apart from drawing
(:func:`render`, a pure function from samples to a ``rich`` renderable), so a frame can be
drawn from recorded samples without a terminal or a server. Rates are sums of the deltas
between successive samples of counters kept in a sliding 60 s window (:class:`Window`); a
counter that went down (the rank restarted) counts from zero again.

``kvfsm top URL [URL ...]`` redraws every ``--interval`` seconds (0.5) until Ctrl-C;
``--once`` takes two samples ``--interval`` apart and prints one frame. ``--svg FILE`` also
writes the last frame as an SVG screenshot. A URL may be a bare ``host:port``. The exit
status is 1 if no server answered the last sample, 2 on a bad flag, 130 on Ctrl-C before
``--once`` has drawn, 0 otherwise (Ctrl-C is how the live view is left). Needs ``rich``:
``pip install 'kvfsm[top]'``.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final

from kvfsm.states import NON_TERMINAL, KVPoll

try:
    from rich import box
    from rich.columns import Columns
    from rich.console import Console, Group, RenderableType
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvfsm top needs rich: pip install 'kvfsm[top]'") from exc

__all__ = [
    "Poller",
    "Rates",
    "Sample",
    "Window",
    "add_parser",
    "parse_metrics",
    "rates",
    "render",
    "run",
]

#: Seconds of samples the rates are computed over.
WINDOW_S: Final = 60.0
#: Failed rooms asked of ``/failures`` per sample when the rank serves no metrics: new
#: failures are told apart from the previous sample's, so this many may fail between two
#: samples before some are counted without their kind.
FAILURES_LIMIT: Final = 200
#: Down links shown per server (the peer book remembers hundreds); every up link is shown.
DOWN_LINKS_SHOWN: Final = 5
HELP: Final = (
    "a live view of running ranks' status servers: rooms by state, the oldest rooms and their "
    "deadlines, peer links, GB/s, rooms/s and failures by kind"
)
_NOT_KEPT: Final = "(kind not kept)"
#: Shown where there is no value (an en dash).
DASH: Final = "\u2013"


@dataclass(frozen=True)
class Sample:
    """What one status server said at one time; ``error`` set if it did not answer."""

    url: str
    #: ``time.monotonic()`` when the counters were read.
    t: float
    error: str | None = None
    #: ``/rooms``: live rooms.
    rooms: Sequence[Mapping[str, Any]] = ()
    #: ``/links``: control links.
    links: Sequence[Mapping[str, Any]] = ()
    #: ``/stats``: the engine's counters (``rooms``), the control plane's, the data path's.
    stats: Mapping[str, Any] = field(default_factory=dict)
    #: From ``/metrics``, when the rank serves it: failed rooms since start by reason kind.
    failures_by_kind: Mapping[str, float] | None = None
    #: From ``/metrics``: each (role, state)'s deadline in seconds.
    deadlines: Mapping[tuple[str, str], float] = field(default_factory=dict)
    #: From ``/failures``, when the rank serves no metrics: the last failed rooms, newest first.
    failures: Sequence[Mapping[str, Any]] | None = None


class Window:
    """One server's samples over the last ``span_s`` seconds (and the one just before, so the
    rates cover the whole span once it has filled)."""

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.span_s = span_s
        self.samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while len(self.samples) > 2 and self.samples[1].t <= sample.t - self.span_s:
            self.samples.popleft()


# -- rates --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """What happened between the first and the last answered sample of a window."""

    span_s: float
    #: Bytes moved by finished chunks; None where the rank counts none (decode: its KV is
    #: written by prefill, which counts the bytes).
    bytes: int | None
    succeeded: int
    failed: int
    #: Failed rooms by reason kind (sums to ``failed`` give or take a sample's skew).
    by_kind: Mapping[str, int]

    @property
    def gb_per_s(self) -> float | None:
        return None if self.bytes is None else self.bytes / 1e9 / self.span_s

    @property
    def rooms_per_s(self) -> float:
        return (self.succeeded + self.failed) / self.span_s


def _count(stats: Mapping[str, Any], *path: str) -> int | None:
    value: Any = stats
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return int(value) if isinstance(value, int | float) else None


def _delta(before: float | None, after: float | None) -> int:
    """How much a counter grew; one that went down was reset (a restarted rank): count anew."""
    if after is None:
        return 0
    if before is None or after < before:
        return int(after)
    return int(after - before)


def _failure_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (row.get("role"), row.get("room"), row.get("generation"), row.get("created"))


def _new_failures(before: Sample, after: Sample, failed: int) -> Counter[str]:
    """Rooms that failed between two samples, by reason kind."""
    kinds: Counter[str] = Counter()
    if before.failures_by_kind is not None and after.failures_by_kind is not None:
        for kind, total in after.failures_by_kind.items():
            if grew := _delta(before.failures_by_kind.get(kind), total):
                kinds[kind] += grew
        return kinds
    if before.failures is not None and after.failures is not None:
        # Newest first, the same number of rows each time: a row the previous sample did not
        # list is new (exact while fewer than FAILURES_LIMIT fail between two samples).
        seen = {_failure_key(row) for row in before.failures}
        for row in after.failures:
            if _failure_key(row) not in seen:
                kinds[str(row.get("reason_kind") or "unknown")] += 1
    # What /stats counted beyond the rows (more than the limit, or no flight recorder).
    if (missing := failed - sum(kinds.values())) > 0:
        kinds[_NOT_KEPT] += missing
    return kinds


def rates(samples: Iterable[Sample]) -> Rates | None:
    """The rates over the answered ones of ``samples`` (oldest first); None with fewer than two.

    Bytes are the data path's ``bytes_done`` in ``/stats`` (bytes moved by finished chunks),
    which every prefill rank keeps whether or not it serves metrics, so no engine counter had to
    be added and no metrics needed; rooms finished are the engine's ``succeeded`` and ``failed``.
    Failures by kind come from ``/metrics``' per-kind counter when served (exact at any rate),
    else from the new rows of ``/failures``.
    """
    answered = [s for s in samples if s.error is None]
    if len(answered) < 2:
        return None
    moved: int | None = None
    succeeded = failed = 0
    kinds: Counter[str] = Counter()
    for before, after in pairwise(answered):
        if (now := _count(after.stats, "transport", "bytes_done")) is not None:
            moved = (moved or 0) + _delta(_count(before.stats, "transport", "bytes_done"), now)
        succeeded += _delta(
            _count(before.stats, "rooms", "succeeded"), _count(after.stats, "rooms", "succeeded")
        )
        step_failed = _delta(
            _count(before.stats, "rooms", "failed"), _count(after.stats, "rooms", "failed")
        )
        failed += step_failed
        kinds += _new_failures(before, after, step_failed)
    span = max(answered[-1].t - answered[0].t, 1e-9)
    return Rates(span, moved, succeeded, failed, dict(kinds))


# -- rendering ----------------------------------------------------------------------------------

_STATES: Final = (*NON_TERMINAL, KVPoll.Success, KVPoll.Failed)
_WAITING: Final = frozenset(state.name for state in NON_TERMINAL)


def _table(title: str) -> Table:
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False
    )


def _dash(value: object, fmt: str = "{}") -> str:
    """A value, or an en dash where there is none."""
    return DASH if value is None else fmt.format(value)


def _rooms_table(sample: Sample) -> Table:
    """Live rooms: a row per state, a column per role that has any (terminal rooms count until
    they are settled and reaped)."""
    counts = Counter((str(r.get("role")), str(r.get("state"))) for r in sample.rooms)
    roles = sorted({role for role, _ in counts}) or ["rooms"]
    table = _table("live rooms by state")
    table.add_column("state")
    for role in roles:
        table.add_column(role, justify="right")
    for state in _STATES:
        table.add_row(state.name, *(str(counts[(role, state.name)]) for role in roles))
    totals = (sum(n for (r, _), n in counts.items() if r == role) for role in roles)
    table.add_row(Text("all", style="bold"), *map(str, totals))
    return table


def _deadline_used(sample: Sample, room: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """Seconds ``room`` has been in its state and the fraction of its deadline used, where the
    state's deadline is known (from ``/metrics``): the deadline less the time left of it."""
    seconds = sample.deadlines.get((str(room.get("role")), str(room.get("state"))))
    left = room.get("deadline_in_s")
    if seconds is None or not isinstance(left, int | float) or seconds <= 0:
        return None, None
    spent = max(0.0, seconds - float(left))
    return spent, spent / seconds


def _oldest_table(sample: Sample, n: int) -> Table:
    waiting = [r for r in sample.rooms if r.get("state") in _WAITING]
    waiting.sort(key=lambda r: -float(r.get("age_s") or 0.0))
    table = _table(f"oldest rooms not terminal ({min(n, len(waiting))} of {len(waiting)})")
    for name in ("room", "gen", "role", "state", "age s", "in state s", "deadline in s"):
        table.add_column(name, justify="left" if name in ("role", "state") else "right")
    table.add_column("deadline used", justify="right")
    if not waiting:
        table.add_row(*[DASH] * 8)
    for room in waiting[:n]:
        spent, used = _deadline_used(sample, room)
        style = "" if used is None else "red" if used >= 0.8 else "yellow" if used >= 0.5 else ""
        table.add_row(
            str(room.get("room")),
            str(room.get("generation")),
            str(room.get("role")),
            str(room.get("state")),
            _dash(room.get("age_s"), "{:.1f}"),
            _dash(spent, "{:.1f}"),
            _dash(room.get("deadline_in_s"), "{:.1f}"),
            Text(_dash(None if used is None else 100 * used, "{:.0f}%"), style=style),
        )
    return table


def _links_table(sample: Sample) -> Table:
    up = [link for link in sample.links if link.get("up")]
    down = [link for link in sample.links if not link.get("up")]
    shown = up + down[-DOWN_LINKS_SHOWN:]
    table = _table(f"peer links ({len(up)} up, {len(down)} down)")
    for name in ("peer", "link", "state", "rtt ms", "lease", "last heard s"):
        table.add_column(name, justify="right" if name.endswith(("s", "link")) else "left")
    for link in shown:
        peer = f"{link.get('role')} r{link.get('rank')}"
        if link.get("engine"):
            peer += f" {link.get('engine')}"
        table.add_row(
            peer,
            str(link.get("link")),
            Text("up", style="green") if link.get("up") else Text("down", style="bold red"),
            # Smoothed heartbeat round trip; ranks that do not measure it leave it out or null.
            _dash(link.get("rtt_ms"), "{:.2f}"),
            "live" if link.get("leased") else DASH,
            _dash(link.get("last_heard_s"), "{:.2f}"),
        )
    if len(down) > DOWN_LINKS_SHOWN:
        table.caption = f"and {len(down) - DOWN_LINKS_SHOWN} older down links"
    return table


def _failures_table(sample: Sample, got: Rates | None) -> Table:
    window = DASH if got is None else f"{got.span_s:.1f} s"
    if sample.failures_by_kind is not None:
        totals = {k: int(v) for k, v in sample.failures_by_kind.items() if v}
        total_name = "since start"
    else:
        totals = Counter(str(r.get("reason_kind") or "unknown") for r in sample.failures or ())
        total_name = f"last {len(sample.failures or ())} kept"
    recent = {} if got is None else dict(got.by_kind)
    table = _table("failures by reason kind")
    table.add_column("kind")
    table.add_column(f"last {window}", justify="right")
    table.add_column("per min", justify="right")
    table.add_column(total_name, justify="right")
    kinds = sorted(set(totals) | set(recent), key=lambda k: (-recent.get(k, 0), -totals.get(k, 0)))
    for kind in kinds:
        count = recent.get(kind, 0)
        per_min = None if got is None else 60.0 * count / got.span_s
        table.add_row(
            Text(kind, style="red" if count else ""),
            str(count),
            _dash(per_min, "{:.1f}"),
            _dash(totals.get(kind), "{}"),
        )
    if not kinds:
        table.add_row("(none)", "0", "0.0", "0")
    return table


def _throughput(got: Rates | None) -> Text:
    if got is None:
        return Text("rates: waiting for a second sample", style="dim")
    gb = got.gb_per_s
    text = Text()
    text.append(f"rates over the last {got.span_s:.1f} s: ", style="bold")
    text.append(f"{DASH} GB/s (this rank writes no KV)" if gb is None else f"{gb:.3f} GB/s")
    text.append(
        f"   {got.rooms_per_s:.1f} rooms/s ({got.succeeded} succeeded, {got.failed} failed)"
    )
    return text


def _since_start(sample: Sample) -> Text:
    counts = sample.stats.get("rooms")
    if not isinstance(counts, Mapping):
        return Text("")
    names = ("spawned", "succeeded", "failed", "deadline_expiries", "settle_timeouts")
    parts = [f"{counts[k]} {k.replace('_', ' ')}" for k in names if k in counts]
    return Text("since start: " + ", ".join(parts), style="dim")


def _server(samples: Sequence[Sample], oldest: int) -> Panel:
    last = samples[-1]
    got = rates(samples)
    if last.error is not None:
        lines = [Text(f"unreachable: {last.error}", style="bold red")]
        answered = [s for s in samples if s.error is None]
        if answered:
            lines.append(Text(f"last answered {last.t - answered[-1].t:.1f} s ago", style="dim"))
        return Panel(Group(*lines), title=last.url, title_align="left", border_style="red")
    # Side by side where the width allows, one under the other where it does not.
    body = Group(
        _since_start(last),
        _throughput(got),
        Columns([_rooms_table(last), _links_table(last)], padding=(0, 3)),
        Columns([_oldest_table(last, oldest), _failures_table(last, got)], padding=(0, 3)),
    )
    return Panel(body, title=last.url, title_align="left", border_style="blue")


def render(
    windows: Mapping[str, Sequence[Sample]], *, oldest: int = 5, interval: float | None = None
) -> RenderableType:
    """One frame: a panel per server (in ``windows``' order) from its samples, oldest first.
    ``oldest``: how many of the oldest rooms to list; ``interval``: said in the heading."""
    answering = sum(1 for s in windows.values() if s and s[-1].error is None)
    heading = f"kvfsm top: {answering} of {len(windows)} status servers answering"
    if interval is not None:
        heading += f", every {interval:g} s"
    panels = [_server(samples, oldest) for samples in windows.values() if samples]
    return Group(Text(heading, style="bold"), *panels)


# -- polling ------------------------------------------------------------------------------------

_LINE: Final = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL: Final = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
#: The escapes of a label value in Prometheus text: backslash, double quote, newline.
_ESCAPE: Final = re.compile(r"\\(.)")


def _unescape(match: re.Match[str]) -> str:
    return "\n" if match[1] == "n" else match[1]


def parse_metrics(text: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """From Prometheus text (:mod:`kvfsm.metrics`): failed rooms by reason kind (all roles
    summed) and each (role, state)'s deadline. Only these two families are read."""
    kinds: dict[str, float] = {}
    deadlines: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith(("kvfsm_failures_total", "kvfsm_state_deadline_seconds")):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        labels = {k: _ESCAPE.sub(_unescape, v) for k, v in _LABEL.findall(match["labels"] or "")}
        value = float(match["value"])
        if match["name"] == "kvfsm_failures_total":
            kind = labels.get("kind", "unknown")
            kinds[kind] = kinds.get(kind, 0.0) + value
        elif match["name"] == "kvfsm_state_deadline_seconds":
            deadlines[(labels.get("role", ""), labels.get("state", ""))] = value
    return kinds, deadlines


class Poller:
    """Samples status servers, each in its own thread, with plain HTTP GETs."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 2.0) -> None:
        # host:port (a Prometheus target's instance) is taken as http://host:port; a server
        # named twice is sampled once.
        named = (url.rstrip("/") for url in urls)
        self.urls = list(dict.fromkeys(u if "://" in u else f"http://{u}" for u in named))
        self.timeout = timeout
        workers = max(1, len(self.urls))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="top")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def sample_all(self) -> list[Sample]:
        """One sample of every server, in ``urls``' order."""
        return list(self._pool.map(self.sample, self.urls))

    def _get(self, url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=self.timeout) as response:
            body: bytes = response.read()
            return body

    def sample(self, url: str) -> Sample:
        """One server's routes; a server that does not answer one of them is unreachable."""
        try:
            rooms = json.loads(self._get(f"{url}/rooms"))
            links = json.loads(self._get(f"{url}/links"))
            stats = json.loads(self._get(f"{url}/stats"))
            t = time.monotonic()
            if not (isinstance(rooms, list) and isinstance(links, list)):
                raise ValueError("not a kvfsm status server: /rooms or /links is not a list")
            if not isinstance(stats, dict):
                raise ValueError("not a kvfsm status server: /stats is not an object")
            try:
                kinds, deadlines = parse_metrics(self._get(f"{url}/metrics").decode())
            except urllib.error.HTTPError as exc:
                exc.close()
                if exc.code != 404:  # 404: this rank keeps no metrics
                    raise
                failures = json.loads(self._get(f"{url}/failures?limit={FAILURES_LIMIT}"))
                return Sample(url, t, rooms=rooms, links=links, stats=stats, failures=failures)
            return Sample(
                url,
                t,
                rooms=rooms,
                links=links,
                stats=stats,
                failures_by_kind=kinds,
                deadlines=deadlines,
            )
        except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts; bad JSON
            # A refused connection or a timeout is a URLError whose reason says it all; an
            # HTTPError's own text has its status code.
            reason = (
                None if isinstance(exc, urllib.error.HTTPError) else getattr(exc, "reason", None)
            )
            return Sample(url, time.monotonic(), error=str(reason or exc) or type(exc).__name__)


# -- the command ---------------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "urls", nargs="*", metavar="URL", help="status servers, http://host:port (one per rank)"
    )
    parser.add_argument(
        "--url", action="append", default=[], help="another status server (may be repeated)"
    )
    parser.add_argument(
        "--interval",
        type=_positive,
        default=0.5,
        help="seconds between samples, and between --once's two (%(default)s)",
    )
    parser.add_argument(
        "--once", action="store_true", help="take two samples, print one frame and exit"
    )
    parser.add_argument(
        "--oldest", type=int, default=5, help="oldest non-terminal rooms listed (%(default)s)"
    )
    parser.add_argument(
        "--timeout", type=_positive, default=2.0, help="seconds per HTTP request (%(default)s)"
    )
    parser.add_argument(
        "--width", type=int, default=None, help="columns to draw in (default: the terminal's)"
    )
    parser.add_argument("--svg", metavar="FILE", help="also write the last frame as an SVG")
    return parser


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``top`` subcommand to ``kvfsm``'s subparsers and return its parser."""
    parser = subparsers.add_parser(
        "top", help=HELP, description=(__doc__ or "").split("\n\n")[0].replace("``", "")
    )
    return _configure(parser)


def _step(poller: Poller, windows: Mapping[str, Window]) -> None:
    for sample in poller.sample_all():
        windows[sample.url].add(sample)


def run(args: argparse.Namespace) -> int:
    """Run ``kvfsm top`` as ``args`` (from :func:`add_parser`) ask."""
    urls: list[str] = [*args.urls, *args.url]
    if not urls:
        print("kvfsm top: give at least one status server URL", file=sys.stderr)
        return 2
    console = Console(width=args.width)
    poller = Poller(urls, timeout=args.timeout)
    windows = {url: Window() for url in poller.urls}
    frame: RenderableType = Text("")

    def draw() -> RenderableType:
        views = {url: list(w.samples) for url, w in windows.items()}
        return render(views, oldest=args.oldest, interval=None if args.once else args.interval)

    try:
        if args.once:
            try:
                _step(poller, windows)
                time.sleep(args.interval)
                _step(poller, windows)
            except KeyboardInterrupt:
                print("kvfsm top: interrupted", file=sys.stderr)
                return 130
            frame = draw()
            console.print(frame)
        else:
            from rich.live import Live  # noqa: PLC0415 - only when drawing live

            with Live(console=console, auto_refresh=False) as live:
                try:
                    while True:
                        started = time.monotonic()
                        _step(poller, windows)
                        frame = draw()
                        live.update(frame, refresh=True)
                        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
                except KeyboardInterrupt:
                    pass  # how a live view is left
    finally:
        poller.close()
    if args.svg is not None:
        # Drawn again on a console of its own: a live console would record every frame.
        recorder = Console(width=console.width, record=True, file=io.StringIO())
        recorder.print(frame)
        recorder.save_svg(args.svg, title="kvfsm top")
    answered = any(w.samples and w.samples[-1].error is None for w in windows.values())
    return 0 if answered else 1
