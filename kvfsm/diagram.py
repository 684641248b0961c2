"""The room state diagrams, generated from the transition tables in :mod:`kvfsm.states`.

The diagrams are Mermaid ``stateDiagram-v2`` text built from ``TABLES`` at call time, so they can
never drift from the code: one edge per (state, event type) in a role's table, labelled with the
event class name (self-edges included), ``[*] --> Bootstrapping`` for the start and
``State --> [*]`` for each terminal state. Print them with ``python -m kvfsm.diagram`` (both roles
as Markdown, ready to paste) or ``python -m kvfsm.diagram --role sender`` (one bare diagram).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvfsm.states import TABLES, TERMINAL, KVPoll, Role

__all__ = ["add_parser", "edges", "main", "mermaid", "mermaid_all", "run"]

#: How each role is titled in :func:`mermaid_all`.
TITLES = {Role.SENDER: "sender (prefill)", Role.RECEIVER: "receiver (decode)"}


def _role(role: Role | str) -> Role:
    return role if isinstance(role, Role) else Role(role)


def edges(role: Role | str) -> list[tuple[KVPoll, str, KVPoll]]:
    """``(source, event class name, target)`` for every edge of ``role``'s table, in table order."""
    table = TABLES[_role(role)]
    return [
        (source, event.__name__, target)
        for source, row in table.items()
        for event, target in row.items()
    ]


def mermaid(role: Role | str) -> str:
    """One role's state machine as a Mermaid ``stateDiagram-v2`` (no trailing newline)."""
    role = _role(role)
    lines = ["stateDiagram-v2", f"    [*] --> {KVPoll.Bootstrapping.name}"]
    lines += [f"    {s.name} --> {t.name} : {label}" for s, label, t in edges(role)]
    lines += [f"    {state.name} --> [*]" for state in TABLES[role] if state in TERMINAL]
    return "\n".join(lines)


def mermaid_all() -> str:
    """Both roles as Markdown: a heading and a fenced ``mermaid`` block each."""
    blocks = [f"## {TITLES[role]}\n\n```mermaid\n{mermaid(role)}\n```\n" for role in Role]
    return "\n".join(blocks).rstrip("\n")


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--role",
        choices=[role.value for role in Role],
        default=None,
        help="print only this role's diagram, without Markdown around it (default: both)",
    )
    return parser


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``diagram`` subcommand to ``kvfsm``'s subparsers and return its parser."""
    parser = subparsers.add_parser(
        "diagram",
        help="print the room state diagrams (Mermaid), generated from kvfsm.states",
        description=(__doc__ or "").split("\n\n")[0],
    )
    return _configure(parser)


def run(args: argparse.Namespace) -> int:
    """Print what ``args`` (from :func:`add_parser`) asks for; exit status 0."""
    role: str | None = args.role
    print(mermaid_all() if role is None else mermaid(role))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfsm.diagram", description=(__doc__ or "").split("\n\n")[0]
    )
    return run(_configure(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
