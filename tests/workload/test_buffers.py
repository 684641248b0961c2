"""``DecodeChecks``: the byte check and the late-write watch that the demo's and the chaos
campaign's decode ranks share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvfsm.workload.buffers import DecodeChecks, Shape, make_buffers


@dataclass
class _Plan:
    room: int
    src: list[int]
    src_aux: int


@dataclass
class _Item:
    dst: npt.NDArray[np.int32] | None
    dst_aux: int
    checked: int = 0
    mismatched: int = 0


def _checks() -> DecodeChecks:
    shape = Shape(layers=1, num_pages=8, page_bytes=16, aux_rows=4, aux_row_bytes=8)
    kv, aux = make_buffers(shape)
    want_kv, want_aux = make_buffers(shape)
    for i, buf in enumerate(want_kv):
        buf[:] = np.arange(8, dtype=np.uint8)[:, None] + 16 * i
    want_aux[:] = np.arange(4, dtype=np.uint8)[:, None] + 100
    return DecodeChecks(kv, aux, want_kv, want_aux, marker=0x5A)


def test_a_late_write_is_counted_once_and_the_marker_put_back() -> None:
    checks = _checks()
    item, plan = _Item(np.array([2, 3], np.int32), 1), _Plan(room=9, src=[5, 6], src_aux=0)
    checks.settled(item, plan)
    checks.check_all()
    assert checks.late_writes == 0
    checks.kv[1][3, 0] ^= 0xFF  # a write after room 9 settled
    checks.aux[1, 2] ^= 0xFF
    checks.check_all()
    assert checks.late_writes == 2
    assert checks.late_notes == [
        "page 3 changed after room 9 settled",
        "aux row 1 changed after its room settled",
    ]
    assert np.all(checks.kv[1][3] == 0x5A)
    checks.check_all()
    assert checks.late_writes == 2  # counted once
    checks.kv[0][2, 0] ^= 0xFF  # lands before page 2 is handed out again
    checks.check(np.array([2], np.int32), np.array([1], np.int32), hand_out=True)
    assert checks.late_writes == 3
    assert np.all(checks.kv[0][2] == 0x5A)  # handed out with the marker, not the late bytes
    checks.kv[0][2, 0] ^= 0xFF  # in use now: not a late write
    checks.check_all()
    assert checks.late_writes == 3


def test_landed_counts_every_byte_and_each_that_differs() -> None:
    checks = _checks()
    item, plan = _Item(np.array([0, 4], np.int32), 2), _Plan(room=1, src=[5, 6], src_aux=3)
    for buf, want in zip(checks.kv, checks.want_kv, strict=True):
        buf[[0, 4]] = want[[5, 6]]
    checks.aux[2] = checks.want_aux[3]
    checks.landed(item, plan)
    assert (item.checked, item.mismatched) == (2 * 2 * 16 + 8, 0)
    checks.kv[1][4, :3] ^= 1
    again = _Item(item.dst, 2)
    checks.landed(again, plan)
    assert (again.checked, again.mismatched) == (item.checked, 3)
