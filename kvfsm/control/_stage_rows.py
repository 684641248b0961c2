"""Decode's state rows as a prefill pipeline stage's link numbers them.

Decode names a request's state rows in its own layout, every state type of the model one after
another (row ``first_row(t) + item``), and sends the same list to every pipeline stage. A
stage's link pairs the stage's state regions with decode's (``_fingerprint.stage_state``), and
the summary it writes through lists only those, type after type as the stage holds them. When
the stage holds every type, both numberings agree and nothing is translated. When it holds no
buffer of a type (that type's layers all sit on other stages), the stage writes none of it, as
SGLang's NIXL backend does: decode's rows of that type are left out, and the rows of the types
after it are renumbered into the stage's summary.

Pure: it reads row ranges and returns packed int32 rows. A row outside every one of decode's
types becomes -1, which the transport refuses when the chunk is posted: a bad page list fails
its own room, never the link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfsm.states import RING_FIELDS

__all__ = ["StageRows"]


@dataclass(frozen=True, slots=True)
class StageRows:
    """Per decode state type, in decode's order: ``(first row in decode's layout, rows, first
    row in the stage's summary)``, the last -1 for a type the stage holds no buffer of."""

    types: tuple[tuple[int, int, int], ...]

    @classmethod
    def plan(
        cls,
        decode: Sequence[tuple[int, int]],
        stage: Sequence[tuple[int, int]],
        kinds: Sequence[int],
    ) -> StageRows | None:
        """``decode``: ``(first_row, rows)`` of each of decode's state types (its whole
        layout); ``stage``: the same for the summary the stage writes through; ``kinds``: the
        decode type of each of the stage's types (``_fingerprint.stage_types``). None when the
        numberings agree."""
        if len(stage) != len(kinds):
            raise ValueError(f"{len(stage)} state types in the stage's summary, {len(kinds)} named")
        held = {d: stage[t][0] for t, d in enumerate(kinds)}
        plan = tuple((first, rows, held.get(d, -1)) for d, (first, rows) in enumerate(decode))
        if all(first == mine for first, _, mine in plan):
            return None
        return cls(plan)

    def translate(self, packed: bytes) -> bytes:
        """Decode's packed int32 state rows as the stage's summary numbers them."""
        if not packed:
            return packed
        out: list[int] = []
        for row in np.frombuffer(packed, np.int32).tolist():
            for first, rows, mine in self.types:
                if first <= row < first + rows:
                    if mine >= 0:
                        out.append(mine + row - first)
                    break
            else:
                out.append(-1)  # no type of decode's holds it: refused when posted
        return np.asarray(out, np.int32).tobytes()

    def translate_rings(self, packed: bytes, rings: bytes) -> bytes:
        """Decode's ring-row segments (``RING_FIELDS`` int32 each, keyed by their row's
        position among ``packed``, decode's state rows) keyed by the positions
        :meth:`translate` gives those rows; a ring row the stage leaves out drops its entry."""
        if not rings or not packed:
            return rings
        places: list[int] = []
        kept = 0
        for row in np.frombuffer(packed, np.int32).tolist():
            mine = next((m for first, n, m in self.types if first <= row < first + n), 0)
            places.append(-1 if mine < 0 else kept)
            kept += mine >= 0
        entries = np.frombuffer(rings, np.int32).reshape(-1, RING_FIELDS).copy()
        at = entries[:, 0]
        known = (at >= 0) & (at < len(places))
        moved = np.where(known, np.asarray([*places, -1], np.int32)[np.where(known, at, -1)], -1)
        entries[:, 0] = np.where(known, moved, at)  # an unknown position stays, refused later
        return entries[(~known) | (moved >= 0)].astype("<i4").tobytes()
