"""``python -m kvfsm``: the ``kvfsm`` command (:mod:`kvfsm.cli`), for where the script is not on
``PATH`` or another interpreter's kvfsm is wanted."""

from __future__ import annotations

from kvfsm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
