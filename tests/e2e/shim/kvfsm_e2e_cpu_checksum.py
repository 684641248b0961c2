"""A CPU digest for SGLang's KV checksum (tests only), so that the e2e suite can run SGLang's own
checksum check (``--disaggregation-enable-kv-checksum``) on a machine without a GPU.

SGLang 0.5.23 digests a request's KV pages with a CUDA kernel (Adler-32, JIT-built), and its
``KvChecksumComputer.compute`` asserts that the page indices are on a CUDA device: on a CPU a
prefill with the flag dies at its first digest (the e2e suite checks that error too). Only
that method is replaced here, by one that digests the same bytes (every item ``index`` of every
KV and state buffer, ``ptr + index * item_len`` for ``item_len`` bytes, buffers in SGLang's
order) with ``zlib.adler32`` on the CPU. Everything around it stays SGLang's: prefill digests
the pages it sends at the last chunk and ships the digest in the metadata row, decode digests
what landed in its pages before the request runs, and on a mismatch drops the request with
"KV checksum mismatch". Both servers of a pair must run it: the digest is this module's.
"""

from __future__ import annotations

import ctypes
import sys
import zlib
from typing import Any

#: The variable that installs it (``sitecustomize.py``); set on the checksum pair only.
ENABLE_ENV = "KVFSM_E2E_CPU_KV_CHECKSUM"
#: The SGLang module whose ``KvChecksumComputer`` is patched once it has been imported.
TARGET = "sglang.srt.disaggregation.checksum"
#: Logged (stderr, so the server's log) at a process's first digest of a request with state
#: items: what the digest covers, so a test can tell a check of state bytes from a KV-only one.
COVERS = "kvfsm-e2e: cpu digest covers"

#: Set once that line is logged.
_told: set[str] = set()


def _compute(self: Any, kv_page_indices_gpu: Any, state_indices_gpu: Any = None) -> int:
    # The attribute names and the buffer order are SGLang's ``KvChecksumComputer.compute``.
    kv = zip(self._kv_data_ptrs, self._kv_item_lens, strict=True)
    buffers = [(ptr, n, kv_page_indices_gpu) for ptr, n in kv]
    if self._state_data_ptrs:
        assert state_indices_gpu is not None
        buffers += [
            (ptr, n, state_indices_gpu)
            for ptr, n in zip(self._state_data_ptrs, self._state_item_lens, strict=True)
        ]
    if not _told and state_indices_gpu is not None and len(state_indices_gpu):
        _told.add(COVERS)
        print(
            f"{COVERS} {len(self._kv_data_ptrs)} KV buffers and "
            f"{len(self._state_data_ptrs)} state buffers",
            file=sys.stderr,
            flush=True,
        )
    digest = 1  # Adler-32's initial value, and SGLang's digest of nothing
    for ptr, item_len, indices in buffers:
        for index in indices.tolist():
            digest = zlib.adler32(ctypes.string_at(ptr + index * item_len, item_len), digest)
    return digest


def install(module: Any) -> None:
    module.KvChecksumComputer.compute = _compute
