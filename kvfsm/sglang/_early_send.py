"""A request's chunks held behind SGLang's early-send event until the pages are written.

SGLang's prefill may send a request's already computed prefix pages before this step's forward
is enqueued (``maybe_send_cached_prefix_chunk``: a prefix-cache hit, or a chunked prompt whose
first chunk waited for decode's bootstrap). Under overlap scheduling the previous step's
forward may still be writing those pages on the GPU's forward stream, so the scheduler records
a CUDA event on that stream and hands it to the sender (``_early_send_wait_event``) for that one
chunk. A transfer posted before the event completes reads pages the GPU is still writing, and
decode gets torn KV with no error: the class of failure where pages are sent before the
forward finished them.

The wait must not be the scheduler's (that would undo the overlap for the step), so a chunk
with an unfinished event is handed to one background thread, which waits for the event (CUDA
releases the GIL while it waits) and only then hands the chunk to kvfsm. Every later chunk of
the same request queues behind it, so a request's chunks reach kvfsm in the order SGLang sent
them and the last chunk never overtakes the pages before it. A request whose room has already
ended skips the wait (its chunks move nothing). SGLang's own NIXL backend takes the event and
never waits on it; its Mooncake backend waits in its transfer worker, as here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvfsm.rooms import name_this_thread

__all__ = ["ChunkGate", "WaitEvent"]

log = logging.getLogger("kvfsm.sglang")


class WaitEvent(Protocol):
    """What kvfsm uses of ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


_waiter: concurrent.futures.ThreadPoolExecutor | None = None
_waiter_lock = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for the process: every early send of a step waits for the same forward, and
    the waits are rare (a prefix hit, a deferred first chunk)."""
    global _waiter  # noqa: PLW0603 - one lazily made worker per process, by design
    with _waiter_lock:
        if _waiter is None:
            _waiter = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvfsm-early-send", initializer=_named
            )
        return _waiter


def _named() -> None:
    """Named in the OS too, as every kvfsm thread is (``top -H``, ``py-spy``)."""
    name_this_thread(threading.current_thread().name)


class ChunkGate:
    """One request's order of chunks. ``submit(event, post)`` runs ``post`` (which hands one
    chunk to kvfsm) now on the caller's thread when nothing is held and ``event`` is None or
    done; otherwise queues it behind the event and anything already held. ``ended()`` says
    whether the request's room has ended (a held chunk then skips its wait); ``failed(reason)``
    fails it when an event cannot be waited for."""

    __slots__ = ("_draining", "_ended", "_failed", "_held", "_lock")

    def __init__(self, ended: Callable[[], bool], failed: Callable[[str], None]) -> None:
        self._ended = ended
        self._failed = failed
        self._lock = threading.Lock()
        self._held: collections.deque[tuple[WaitEvent | None, Callable[[], None]]] = (
            collections.deque()
        )
        #: True from the first chunk held until the worker has posted the last one held.
        self._draining = False

    @property
    def holding(self) -> bool:
        return self._draining

    def submit(self, event: Any, post: Callable[[], None]) -> None:
        if event is not None and not self._draining and _done(event):
            event = None
        with self._lock:
            if event is None and not self._draining:
                direct = True
            else:
                direct = False
                self._held.append((event, post))
                start = not self._draining
                self._draining = True
        if direct:
            # Chunks come from the scheduler thread alone, so no other chunk can be queued
            # between the check above and this post.
            post()
        elif start:
            _pool().submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._held:
                    self._draining = False
                    return
                event, post = self._held.popleft()
            if event is not None and not self._ended():
                try:
                    event.synchronize()
                except Exception as exc:
                    log.warning("waiting for an early send's pages failed: %r", exc)
                    self._failed(
                        f"waiting for the forward that writes its prefix pages failed: {exc!r}"
                    )
                    continue  # its pages may be torn: never posted
            try:
                post()
            except Exception:  # the worker must go on with the next chunk and request
                log.exception("posting a held chunk failed")


def _done(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:
        return False
