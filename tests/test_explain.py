"""``kvfsm explain``: its table against every reason kvfsm writes, and its reading of real
failed-room lines (a real prefill-decode pair, a real engine's deadlines) and of a real
``kill -USR1`` dump of a process with live rooms."""

from __future__ import annotations

import ast
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfsm import explain as ex
from kvfsm.control import ChannelConfig
from kvfsm.explain import _rules as rules
from kvfsm.rooms import RoomConfig, RoomEngine
from kvfsm.rooms._engine import live_rooms_lines
from kvfsm.rooms._loopback import LoopbackSink
from kvfsm.states import (
    AbortRequested,
    ChunkFailed,
    ChunkStalled,
    DeadlineExpired,
    KVPoll,
    PeerFailed,
    PeerLost,
    Role,
    failure_reason,
)
from tests.helpers.cli import REPO
from tests.helpers.control import Decode
from tests.helpers.observed_pair import DECODE_ABORTED, PREFILL_ABORTED, WAITING, observed_pair
from tests.helpers.prefill_process import PrefillProcess
from tests.helpers.waiting import wait_until_sync

PACKAGE = REPO / "kvfsm"

# -- the table against the reasons in the code ------------------------------------------------

#: Callables that take a room's reason, the prefix the room's reason gets, and the position of
#: the reason among their arguments.
REASON_CALLS = {
    "PeerLost": ("peer lost: ", 0),
    "PeerFailed": ("peer failed: ", 0),
    "EventRejected": ("rejected: ", 0),
    "ChunkFailed": ("chunk 7 failed: ", 1),
    "ChunkStalled": ("chunk 7 stalled: ", 1),
    "AbortRequested": ("aborted (local): ", 0),
    "fail": ("rejected: ", 0),  # RoomCore.fail, Room._fail
    "reject": ("rejected: ", 0),  # a facade's reject
    "abort": ("aborted (local): ", 0),  # a facade's abort
    "_lose": ("peer lost: ", 1),  # the control plane's lost link: every room on it
    "_fail_named": ("rejected: ", 3),
}
#: Functions whose returned strings are a room's refusal (the core's per-event checks).
REFUSING = ("_check_",)


def _text(node: ast.expr | None, names: dict[str, ast.expr]) -> str | None:
    """A literal, an f-string (each placeholder as 7: numbers and names alike) or a name bound
    to one in the same function (or module); None for anything computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [str(v.value) if isinstance(v, ast.Constant) else "7" for v in node.values]
        return "".join(parts)
    if isinstance(node, ast.Name) and node.id in names:
        return _text(names[node.id], {})
    return None


def _bound(body: ast.AST) -> dict[str, ast.expr]:
    return {
        n.targets[0].id: n.value
        for n in ast.walk(body)
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
    }


def reasons_in_the_code() -> list[tuple[str, str]]:
    """(where, the room's reason) for every reason kvfsm/ spells out where it fails a room."""
    found: list[tuple[str, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = {
            k: v
            for k, v in _bound(tree).items()
            if any(isinstance(n, ast.Assign) and n.value is v for n in tree.body)
        }
        module.update(
            {
                n.target.id: n.value
                for n in tree.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value
            }
        )
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            names = {**module, **_bound(fn)}
            where = f"{path.relative_to(REPO)}:{fn.name}"
            if fn.name.startswith(REFUSING):
                for ret in ast.walk(fn):
                    if isinstance(ret, ast.Return):
                        text = _text(ret.value, {})
                        if text is not None:
                            found.append((where, "rejected: " + text))
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call):
                    continue
                func = call.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name not in REASON_CALLS:
                    continue
                prefix, index = REASON_CALLS[name]
                keywords = {k.arg: k.value for k in call.keywords}
                origin = keywords.get("origin")
                if isinstance(origin, ast.Constant):
                    prefix = f"aborted ({origin.value}): "
                arg = call.args[index] if index < len(call.args) else keywords.get("reason")
                text = _text(arg, names)
                if text is not None:
                    found.append((f"{where}:{call.lineno}", prefix + text))
    return found


def test_every_reason_the_code_spells_out_has_its_own_row() -> None:
    """Each reason kvfsm writes literally (or as an f-string) where it fails a room is read by
    a rule of its own: not unknown, and not only by its family's fallback row. A new reason
    added to the code without a row fails here, naming where it is written."""
    found = reasons_in_the_code()
    # The collector itself works: the package writes dozens of reasons in these calls.
    assert len(found) >= 40, found
    missing = [
        (where, reason, ex.classify(reason).rule.kind)
        for where, reason in found
        if ex.classify(reason).rule.kind == "unknown" or ex.classify(reason).rule.fallback
    ]
    assert not missing, "\n".join(f"{w}: {r!r} -> {k}" for w, r, k in missing)


def test_every_failure_event_has_a_family() -> None:
    """``failure_reason``'s prefix for every failure event (whatever the words after it) is
    read by a rule: a new failure event or a reworded prefix without a row fails here."""
    events = [
        AbortRequested("anything"),
        AbortRequested("anything", origin="peer"),
        DeadlineExpired(KVPoll.Transferring, 2.5),
        PeerLost("anything"),
        PeerFailed("anything"),
        ChunkFailed(3, "anything"),
        ChunkStalled(3, "anything"),
    ]
    for event in [*events]:
        reason = failure_reason(event)
        assert ex.classify(reason).rule.kind != "unknown", reason
    from kvfsm.states import FAILURE_EVENTS, EventRejected

    assert {type(e) for e in events} | {EventRejected} == set(FAILURE_EVENTS)
    assert ex.classify(failure_reason(EventRejected("anything"))).rule.kind == "rejected"


@pytest.mark.parametrize(
    ("reason", "role", "kind", "law"),
    [
        # Written from parameters (the ledger's and the fence's words): spelled as they build them.
        (
            "chunk 2 failed: write lease of fence 9 expired 0.25s ago: not posted",
            "sender",
            "fenced",
            rules.LAW_FENCE,
        ),
        (
            "chunk 2 stalled: write lease of fence 9 revoked; released",
            "sender",
            "fenced",
            rules.LAW_FENCE,
        ),
        (
            "chunk 2 failed: write lease of fence 9 void: the stale-progress gate refused "
            "(see kvfsm.transport._fence)",
            "sender",
            "fenced_out",
            rules.LAW_FENCE,
        ),
        (
            "chunk 4 stalled: in flight past its 30s deadline; released",
            "sender",
            "chunk_stalled",
            rules.LAW_STALL,
        ),
        ("chunk 4 stalled: peer lost; released", "sender", "chunk_peer_lost", rules.LAW_LIVENESS),
        (
            "chunk 1 failed: page index 900 out of range [0, 64)",
            "sender",
            "page_out_of_range",
            rules.LAW_INPUT,
        ),
        ("rejected: mailbox overflow (> 1024)", "receiver", "mailbox_overflow", rules.LAW_QUOTA),
        (
            "rejected: could not execute PostChunk: boom",
            "sender",
            "internal_error",
            rules.LAW_INTERNAL,
        ),
        (
            "rejected: page 70 already held by room 3 gen 5",
            "receiver",
            "bad_pages",
            rules.LAW_INPUT,
        ),
        ("rejected: ChunkSubmitted in Bootstrapping", "sender", "illegal_event", rules.LAW_INPUT),
        (
            "peer lost: cannot reach prefill rank 0: handshake refused: prefill rank 0 refused "
            "decode rank 0: over ChannelConfig.max_links",
            "receiver",
            "handshake_refused",
            rules.LAW_HANDSHAKE,
        ),
        (
            "peer lost: cannot reach prefill rank 3: bootstrap registry http://10.0.0.7:8998 "
            "unreachable: TimeoutError: ",
            "receiver",
            "registry_timeout",
            rules.LAW_REGISTRY,
        ),
        (
            "peer lost: cannot reach prefill rank 3: bootstrap registry http://10.0.0.7:8998 "
            "unreachable: ClientConnectorError: Cannot connect to host 10.0.0.7:8998",
            "receiver",
            "unreachable",
            rules.LAW_LINK,
        ),
        (
            "peer lost: kvfsm-decode-t-r0-h-pid9-ab silent for more than 2s",
            "sender",
            "peer_silent",
            rules.LAW_LIVENESS,
        ),
        (
            "refused: engine is shutting down; no new rooms",
            "sender",
            "shutdown",
            rules.LAW_SHUTDOWN,
        ),
    ],
)
def test_reasons_built_from_parameters(reason: str, role: str, kind: str, law: str) -> None:
    found = ex.classify(reason, role)
    assert (found.rule.kind, found.rule.law) == (kind, law)


@pytest.mark.parametrize("role", ["sender", "receiver"])
@pytest.mark.parametrize(
    "state", [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring]
)
def test_each_state_deadline_has_its_own_check(role: str, state: KVPoll) -> None:
    """What a room waits for differs by role and state; so does the first check."""
    reason = failure_reason(DeadlineExpired(state, 300.0))
    found = ex.classify(reason, role)
    assert found.rule.kind == "deadline"
    assert not found.rule.fallback
    assert found.rule.role == role
    assert found.groups == {"state": state.name, "seconds": "300"}


def test_a_relayed_reason_is_read_as_the_peers() -> None:
    found = ex.classify(
        "peer failed: deadline expired: Transferring for more than 120s", "receiver"
    )
    assert found.rule.kind == "peer_failed"
    assert found.cause is not None
    # The peer of a receiver is a sender: its Transferring deadline is the sender's row.
    assert (found.cause.rule.kind, found.cause.rule.role) == ("deadline", "sender")


def test_an_unknown_reason_is_reported_with_its_words() -> None:
    line = json.dumps(
        {"event": "room_failed", "room": 9, "generation": 1, "role": "sender", "reason": "zap"}
    )
    report = ex.explain("some prefix: " + line)
    (finding,) = report.failed
    assert (finding.kind, finding.law, finding.reason) == ("unknown", rules.LAW_UNKNOWN, "zap")
    assert "zap" in finding.explanation


# -- real failed-room lines ---------------------------------------------------------------------


class _Lines(logging.Handler):
    """The failed-room lines as a log file holds them: level and logger before the JSON."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def failed_log() -> Iterator[_Lines]:
    handler = _Lines()
    logger = logging.getLogger("kvfsm.rooms.failed")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _by_room(findings: list[ex.Finding]) -> dict[tuple[int, str], ex.Finding]:
    return {(f.room, f.role): f for f in findings}


def test_a_real_pair_s_failed_rooms(failed_log: _Lines) -> None:
    """The pair's aborts on both sides, then its prefill closed under a waiting decode room:
    each room is named by the law that ended it, its peer, and the check that fits."""
    with observed_pair() as pair:
        waiting = pair.waiting
        assert waiting is not None
        prefill_agent, prefill_incarnation = pair.prefill.agent.name, None
        if pair.prefill.control is not None:
            prefill_incarnation = pair.prefill.control.incarnation
        decode_agent = pair.decode.agent.name
        pair.prefill.close()
        wait_until_sync(lambda: waiting.poll() is KVPoll.Failed, timeout=20)
        wait_until_sync(lambda: len(pair.failure_lines) >= 4, timeout=10)
    text = "\n".join(failed_log.lines)
    rooms = _by_room(ex.explain(text).failed)

    mine = rooms[(PREFILL_ABORTED, "sender")]
    assert (mine.kind, mine.law) == ("caller_abort", rules.LAW_ABORT)
    assert "operator test" in mine.explanation

    theirs = rooms[(DECODE_ABORTED, "sender")]
    assert (theirs.kind, theirs.law) == ("peer_aborted", rules.LAW_PEER)
    assert theirs.cause is not None
    assert theirs.cause["kind"] == "caller_abort"
    assert "client went away" in theirs.cause["explanation"]
    assert theirs.peer is not None
    assert theirs.peer["agent"] == decode_agent
    assert "decode" in theirs.check
    assert f"--room {DECODE_ABORTED}" in theirs.check
    assert any(e["kind"] == "frame_in" for e in theirs.timeline)

    decode_side = rooms[(DECODE_ABORTED, "receiver")]
    assert decode_side.kind == "caller_abort"

    lost = rooms[(WAITING, "receiver")]
    assert lost.kind in ("peer_closed", "peer_silent"), lost.reason
    assert lost.law in (rules.LAW_LINK, rules.LAW_LIVENESS)
    assert lost.peer is not None
    assert (lost.peer["engine"], lost.peer["rank"], lost.peer["agent"]) == (
        "t",
        0,
        prefill_agent,
    )
    if prefill_incarnation is not None:
        assert lost.peer["incarnation"] == prefill_incarnation
    # Both managers ran in this process: the agent name says which process to look at.
    assert f"prefill process (pid {os.getpid()} on " in lost.check
    # What led there: the link's loss, then the room's failure.
    assert [e["what"] for e in lost.timeline if e["kind"] in ("link", "state")][-2:] == [
        "peer lost",
        "entered Failed",
    ]


def test_a_real_peer_fallen_silent(failed_log: _Lines) -> None:
    """A prefill process stopped (SIGSTOP) under a decode room that waits for its chunks: the
    room fails at the liveness bound, and explain names that bound and the silent peer."""
    silence = ChannelConfig(heartbeat_s=0.2, liveness_factor=2.0)
    prefill = PrefillProcess(silence)
    decode = Decode({"port": prefill.port}, silence)
    try:
        receiver = decode.receive(60, [1, 2], aux_row=0)
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            wait_until_sync(lambda: receiver.poll() is KVPoll.Failed, timeout=20)
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
    finally:
        decode.close()
        prefill.close()
    (lost,) = [f for f in ex.explain("\n".join(failed_log.lines)).failed if f.room == 60]
    assert (lost.kind, lost.law) == ("peer_silent", rules.LAW_LIVENESS)
    assert lost.reason.endswith("silent for more than 0.4s")
    assert "sent nothing, not even a heartbeat, for 0.4s" in lost.explanation
    assert lost.peer is not None
    assert lost.peer["rank"] == 0
    assert "is the prefill process" in lost.check
    assert "`kill -USR1` it" in lost.check


def test_deadlines_of_a_real_engine_and_the_summary(
    failed_log: _Lines, capsys: pytest.CaptureFixture[str]
) -> None:
    """Receivers whose caller never calls send_metadata fail at their WaitingForInput
    deadline; many rooms of one kind print as a summary first."""
    config = RoomConfig(deadlines={Role.RECEIVER: {KVPoll.WaitingForInput: 0.2}})
    with RoomEngine(LoopbackSink(), config) as engine:
        rooms = [engine.receiver(40 + i) for i in range(ex.SUMMARY_FROM)]
        for room in rooms:
            room.init(0)
        wait_until_sync(lambda: all(r.poll() is KVPoll.Failed for r in rooms), timeout=20)
    report = ex.explain("\n".join(failed_log.lines))
    assert len(report.failed) == ex.SUMMARY_FROM
    for finding in report.failed:
        assert (finding.kind, finding.law) == ("deadline", rules.LAW_DEADLINE)
        assert "send_metadata within 0.2s" in finding.explanation
        assert "KV pool" in finding.check
        assert any(e["kind"] == "deadline" for e in finding.timeline)
    ex.print_report(report, per_kind=2)
    out = capsys.readouterr().out
    assert f"== {ex.SUMMARY_FROM} failed rooms" in out
    assert f"{ex.SUMMARY_FROM}  deadline" in out
    assert out.count("room 4") == 2  # two shown of the kind, the rest counted
    assert f"and {ex.SUMMARY_FROM - 2} more deadline rooms" in out


# -- a real kill -USR1 dump ---------------------------------------------------------------------

#: A process with a real pair and live rooms (the observed pair's waiting decode room), with
#: kvfsm's SIGUSR1 dump installed and its log going to stderr as ``kvfsm`` has them; it names
#: its agents when the pair is up, then waits for its stdin to close.
DUMPED = """
import logging, sys
from kvfsm._child import dump_stacks_on_sigusr1
from tests.helpers.observed_pair import observed_pair
dump_stacks_on_sigusr1()
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
with observed_pair() as pair:
    print("agents", pair.prefill.agent.name, pair.decode.agent.name, flush=True)
    sys.stdin.read()
"""


def test_a_real_usr1_dump(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with (
        err.open("wb") as sink,
        subprocess.Popen(
            [sys.executable, "-c", DUMPED],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
        ) as proc,
    ):
        try:
            assert proc.stdout is not None
            assert proc.stdin is not None
            line = ""
            while not line.startswith("agents "):  # (NIXL's own lines come to stdout too)
                line = proc.stdout.readline()
                assert line, "the dumped process ended before its pair was up"
            _, prefill_agent, decode_agent = line.split()
            time.sleep(0.3)  # the waiting room ages a little: its age is reported against 300 s
            proc.send_signal(signal.SIGUSR1)
            wait_until_sync(lambda: "kvfsm live rooms:" in err.read_text(), timeout=20)
            assert proc.poll() is None  # the dump did not stop it
            proc.stdin.close()
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    report = ex.explain(err.read_text())

    assert report.engines == 2  # prefill's engine and decode's
    (live,) = [f for f in report.live if f.room == WAITING]
    assert (live.role, live.state, live.kind) == ("receiver", "WaitingForInput", "waiting")
    assert live.deadline_s == 300.0
    assert live.in_state_s is not None
    assert 0.3 <= live.in_state_s < 60
    assert live.deadline_in_s is not None
    assert live.deadline_in_s > 200
    assert live.peer is not None
    assert live.peer["agent"] == prefill_agent
    assert "send_metadata" in live.explanation
    assert "KV pool" in live.check
    assert live.pid == proc.pid

    names = {t.name for t in report.threads}
    assert "MainThread" in names
    assert sum(n.startswith("kvfsm") for n in names) >= 2  # the engines' loop threads at least
    (current,) = [t for t in report.threads if t.current]
    assert current.name == "MainThread"
    # The failed rooms logged as warnings before the dump are read from the same text.
    assert any(f.kind == "peer_aborted" for f in report.failed)
    assert decode_agent


def test_a_room_past_its_deadline_in_a_dump_is_overdue(failed_log: _Lines) -> None:
    """A real engine whose loop is blocked cannot fire a deadline: the room it holds is read
    from the dump (what the SIGUSR1 handler writes, taken while the loop is blocked) past its
    deadline, and reported as a wedge of the engine rather than as a room still waiting."""
    config = RoomConfig(deadlines={Role.RECEIVER: {KVPoll.WaitingForInput: 0.2}})
    with RoomEngine(LoopbackSink(), config) as engine:
        room = engine.receiver(50)
        room.init(0)
        wait_until_sync(lambda: room.poll() is KVPoll.WaitingForInput, timeout=10)
        release = threading.Event()
        engine.loop.call_soon_threadsafe(release.wait, 20)
        try:
            time.sleep(0.5)  # real time: the loop is blocked, its clock is the real one
            text = "\n".join(live_rooms_lines())
        finally:
            release.set()
        wait_until_sync(lambda: room.poll() is KVPoll.Failed, timeout=10)
    (live,) = [f for f in ex.explain(text).live if f.room == 50]
    assert live.kind == "overdue"
    assert live.deadline_in_s is not None
    assert live.deadline_in_s < -0.2
    assert "not running room steps" in live.explanation
    assert "loop thread" in live.check
    # Once the loop ran again, the room failed at that deadline after all.
    (failed,) = [f for f in ex.explain("\n".join(failed_log.lines)).failed if f.room == 50]
    assert failed.kind == "deadline"


def test_the_command_reads_stdin_and_says_when_there_is_nothing(tmp_path: Path) -> None:
    line = json.dumps(
        {
            "event": "room_failed",
            "room": 5,
            "generation": 2,
            "role": "receiver",
            "reason": "peer lost: kvfsm-prefill-t-r0-hostA-pid42-ab silent for more than 2s",
            "peer": {"engine": "t", "rank": 0, "agent": "kvfsm-prefill-t-r0-hostA-pid42-ab"},
            "timeline": [],
        }
    )
    cli = [sys.executable, "-m", "kvfsm", "explain"]
    done = subprocess.run(
        [*cli, "--json", "-"],
        input=f"WARNING x: {line}\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    (room,) = body["failed"]
    assert room["kind"] == "peer_silent"
    assert "pid 42 on hostA" in room["check"]
    assert body["summary"]["failed"] == {"peer_silent": 1}

    empty = tmp_path / "empty.log"
    empty.write_text("nothing to see\n")
    done = subprocess.run(
        [*cli, str(empty)], capture_output=True, text=True, cwd=REPO, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "no failed-room lines" in done.stderr
