"""The shape every workload command shares (``kvfsm run``, ``kvfsm demo``, ``kvfsm chaos``): the
same exit statuses and the same messages, whichever job runs."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["run_command"]

_log = logging.getLogger("kvfsm.cli")


def run_command(
    name: str,
    validate: Callable[[], None],
    job: Callable[[], dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
    ok: Callable[[dict[str, Any]], bool],
    *,
    as_json: bool,
) -> int:
    """Validate (2 on a bad flag), run the job (130 on Ctrl-C, 1 on an error, without a
    traceback unless -vv), print the summary (one JSON object on stdout with ``--json``), and
    exit 0 only if the summary is clean."""
    try:
        validate()
    except ValueError as exc:
        print(f"kvfsm {name}: {exc}", file=sys.stderr)
        return 2
    try:
        summary = job()
    except KeyboardInterrupt:
        print(f"kvfsm {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        _log.debug("%s failed", name, exc_info=True)
        print(
            f"kvfsm {name}: error: {type(exc).__name__}: {exc} (-vv for the traceback)",
            file=sys.stderr,
        )
        return 1
    if as_json:
        print(json.dumps(summary))
    else:
        show(summary)
    return 0 if ok(summary) else 1
