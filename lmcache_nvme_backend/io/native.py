"""The native I/O engine: batches of chunk reads and writes run without the GIL.

The compiled module (``io/csrc``: ``module.c`` the binding, ``batches.c`` shares into a
batch and its outcome, ``workers.c`` queues and threads, ``chunkio.c`` one chunk's I/O,
hashes and verdict, ``pool.c`` removed files kept for reuse, ``xxh3.c`` the checksum) is
built at install time when a C compiler is there (``setup.py``; optional).  It runs the
Python engine's steps (``python_engine.py``, ``python_chunks.py``) for a whole batch per GIL
round trip, so one process moves many GiB/s before the interpreter limits it
(``docs/benchmarks.md``, "GIL ceiling").  Python keeps the decisions (index, placement,
capacity) and every uncommon case: an unverified read comes back with its header and
checksum for ``disk/validate.judge_chunk``, a failed one with its errno for
``io.files.read_failure``, a write that made its namespace's directory as ``NEW_NAMESPACE``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from .engine import Batch, OnDone, ReadShare, WriteShare

_MISSING = ""  # why the extension is not there
try:
    from . import _native  # type: ignore[attr-defined]
except ImportError as exc:  # not built: no C compiler at install time
    _native = None
    _MISSING = str(exc)

#: Eventfds one ``wait`` may signal (``NativeEngine.signal_later``).
MAX_WAIT_SIGNALS: int = getattr(_native, "MAX_WAIT_SIGNALS", 0)

logger = logging.getLogger(__name__)
PR_SET_NAME = 15
#: This process's own symbols (libc's among them), called without releasing the GIL.
_LIBC = ctypes.PyDLL(None)


def _name_os_thread(name: bytes) -> None:
    """Give the calling thread ``name`` in the kernel too (``top -H``, ``/proc/<pid>/task``),
    as the engine's own threads have: the completion thread's CPU is then told apart from
    LMCache's threads.  Best effort: elsewhere than Linux it keeps its name.  It holds the
    GIL throughout (``PyDLL``, no library lookup), so the engine's count of GIL releases
    stays one per batch."""
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.prctl(PR_SET_NAME, name)


def available() -> bool:
    """Whether the compiled engine is importable."""
    return _native is not None


def unavailable_reason() -> str:
    """Why it is not (empty when it is), with the fix."""
    if _native is not None:
        return ""
    return (f"the native I/O extension is not built ({_MISSING}); reinstall with a C "
            "compiler present (e.g. apt-get install gcc, then pip install -e . again)")


def counters() -> dict[str, int]:
    """The engine's process-wide counters: GIL releases (``gil_releases``, of them
    ``wake_releases``), ``hashed_bytes``, the checksum's CPU time sampled in one hash call in
    eight (``hash_sampled_ns`` over ``hash_sampled_bytes``, see ``hash_cpu_ns``), and
    ``overlapped_writes`` (O_DIRECT chunks written through Linux AIO while hashed)."""
    return dict(_native.counters()) if _native is not None else {}


def hash_cpu_ns(before: dict[str, int], after: dict[str, int]) -> float:
    """The checksum's CPU time between two ``counters()`` readings, estimated from the timed
    calls' nanoseconds per byte (hashing costs the same per byte in every call)."""
    sampled = after["hash_sampled_bytes"] - before["hash_sampled_bytes"]
    hashed = after["hashed_bytes"] - before["hashed_bytes"]
    if sampled <= 0:
        return 0.0
    return (after["hash_sampled_ns"] - before["hash_sampled_ns"]) * hashed / sampled


#: ``memory_view(address, length)``: a writable byte view of the memory at ``address`` (None
#: without the engine), which the caller keeps alive while the view is in use.
memory_view: Callable[[int, int], memoryview | None] = (
    _native.memory_view if _native is not None else lambda address, length: None)


#: ``gc_untrack(*objs)``: the cycle collector stops tracking these objects, never part of a
#: cycle (the index entries: a full collection took 0.17 s per million); a no-op without the
#: engine.
gc_untrack: Callable[..., None] = (
    _native.gc_untrack if _native is not None else lambda *objs: None)


def simd() -> str:
    """The checksum loop the engine runs (``avx2``, ``sse2`` or ``scalar``)."""
    return str(_native.simd()) if _native is not None else ""


class NativeEngine:
    """The compiled engine's threads, and one Python thread that hands finished batches
    back (``nvme-io-done``); one instance per chunk store."""

    name = "native"

    def __init__(self, threads: int, write_threads: int, task_size: int,
                 recycle_bytes: int = 0, recycle_suffix: str | None = None) -> None:
        """``recycle_bytes``: up to this many bytes of removed chunk files are kept, renamed
        ``<name><recycle_suffix>``, for writes of the same size to overwrite in place."""
        if _native is None:
            raise RuntimeError(unavailable_reason())
        self._engine = _native.Engine(threads, write_threads, task_size, recycle_bytes,
                                      recycle_suffix)
        self._threads = threads
        self._signals: list[int] = []  # eventfds the completer's next wait writes
        self._completer = threading.Thread(target=self._complete, name="nvme-io-done",
                                           daemon=True)
        self._completer.start()

    def read(self, shares: Sequence[ReadShare]) -> Batch:
        return Batch(*self._engine.read_shares(shares))

    def submit_read(self, shares: Sequence[ReadShare], on_done: OnDone) -> None:
        """Start reading a batch; ``on_done(batch)`` runs on ``nvme-io-done`` after it."""
        self._engine.submit_read_shares(shares, on_done)

    def submit_write(self, shares: Sequence[WriteShare], on_done: OnDone) -> None:
        """Start writing a batch (writers at nice 10 let reads go first for up to 50 ms);
        ``on_done(batch)`` runs on ``nvme-io-done`` after it."""
        self._engine.submit_shares(shares, on_done)

    def writer_thread_ids(self) -> list[int]:
        """Kernel ids of the engine's write threads (each runs at nice 10)."""
        return list(self._engine.thread_ids())[self._threads:]

    def cancel_writes(self) -> int:
        return int(self._engine.cancel_writes())

    def wait(self, timeout_s: float, signals: tuple[int, ...] = ()
             ) -> list[tuple[OnDone, Batch]] | None:
        """Finished batches (``[]`` after ``timeout_s``); None once closed and drained.  First
        signals each eventfd in ``signals``, in the GIL release that waiting makes anyway."""
        done = self._engine.wait(timeout_s, signals)
        return None if done is None else [(token, Batch(*res)) for token, res in done]

    def reading(self) -> AbstractContextManager[None]:
        """Changes nothing: the compiled writers see only the engine's own reads."""
        return contextlib.nullcontext()

    def signal_later(self, eventfd: int) -> bool:
        """On ``nvme-io-done``: have ``eventfd`` signalled in the thread's next GIL release
        (saving one release here); False on any other thread: the caller signals it."""
        if threading.get_ident() != self._completer.ident:
            return False
        if eventfd not in self._signals:
            if len(self._signals) == MAX_WAIT_SIGNALS:
                return False
            self._signals.append(eventfd)
        return True

    def unlink(self, items: Sequence[tuple[int, str]]) -> list[int]:
        """``ChunkEngine.unlink``, keeping files for reuse (see ``recycle_bytes``)."""
        return list(self._engine.unlink(items))

    def retired_bytes(self) -> int:
        """Bytes in removed chunk files kept for reuse now (on disk, outside the index)."""
        return int(self._engine.retired_bytes())

    def close(self) -> None:
        self._engine.close()
        if self._completer is not threading.current_thread():
            self._completer.join()

    def _complete(self) -> None:
        _name_os_thread(b"nvme-io-done")
        signals = self._signals
        while (done := self.wait(1.0, tuple(signals))) is not None:
            signals.clear()
            for on_done, batch in done:
                try:
                    on_done(batch)
                except Exception:
                    logger.exception("NVMe tier: completing an I/O batch failed")

