"""The native I/O engine: batches of chunk reads and writes run without the GIL.

The compiled module (``io/csrc``: ``module.c`` the batches and threads, ``chunkio.c`` one
chunk's open, vectored I/O, block hashes and verdict, ``xxh3.c`` the checksum) is built at
install time when a C compiler is there (``setup.py``; optional).  It runs the same steps
as the Python engine (``posix.py``, ``files.py``, ``disk/safe_fs.py``) for a whole batch
per GIL round trip: on a big server one process then moves many GiB/s before the
interpreter becomes its limit (``docs/benchmarks.md``, "GIL ceiling").

What stays in Python: deciding per batch (the index, placement, capacity), and every case
that is not the common one.  A read the engine could not verify comes back with its header
and checksum for ``disk/validate.judge_chunk`` to name the defect; a read that failed is run
again through the Python engine, whose exceptions classify it (gone, planted, short, drive
error) exactly as before.  A write whose shard directory does not exist yet comes back for
Python to create the directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

try:
    from . import _native  # type: ignore[attr-defined]
except ImportError as exc:  # not built: no C compiler at install time
    _native = None
    _MISSING = f"{exc}"
else:
    _MISSING = ""

OK, JUDGE, FAILED, NEED_DIR = 0, 1, 2, 3


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
    """The engine's process-wide counters: GIL releases, hashing CPU ns and bytes hashed."""
    return dict(_native.counters()) if _native is not None else {}


def simd() -> str:
    """The checksum loop the engine runs (``avx2``, ``sse2`` or ``scalar``)."""
    return str(_native.simd()) if _native is not None else ""


class ReadItem(NamedTuple):
    """One chunk to read: ``rel`` beneath the root descriptor, into ``dest``."""

    root_fd: int
    rel: bytes
    dest: memoryview
    payload_len: int
    direct: bool
    key: bytes
    meta: bytes


class WriteItem(NamedTuple):
    """One chunk file to write as ``tmp_name`` in ``dir_rel`` and rename to ``final_name``."""

    root_fd: int
    dir_rel: bytes
    tmp_name: bytes
    final_name: bytes
    payload: memoryview
    key: bytes
    namespace: bytes
    meta: bytes
    gpu_checksum: tuple[int, int] | None
    direct: bool
    mode: int
    fsync_level: int  # 0 none, 1 data, 2 full


class Batch(NamedTuple):
    """Per item a status (OK, JUDGE, FAILED, NEED_DIR), and the details of the rest: for
    reads ``(index, errno, header or None, payload checksum of the bytes that landed)``,
    for writes ``(index, status, errno)``."""

    statuses: bytes
    details: list[Any]


class NativeEngine:
    """Worker threads of the compiled engine; one instance per chunk store."""

    name = "native"

    def __init__(self, threads: int, task_size: int) -> None:
        if _native is None:
            raise RuntimeError(unavailable_reason())
        self._engine = _native.Engine(threads, task_size)

    def read(self, items: Sequence[ReadItem]) -> Batch:
        """Read and verify a batch; the calling thread helps and returns when all are done."""
        return Batch(*self._engine.read(items))

    def submit_read(self, items: Sequence[ReadItem], token: object) -> None:
        """Start a batch; :meth:`wait` hands it back with ``token``."""
        self._engine.submit_read(items, token)

    def wait(self, timeout_s: float) -> list[tuple[object, Batch]] | None:
        """Finished batches (``[]`` after ``timeout_s``); None once closed and drained."""
        done = self._engine.wait(timeout_s)
        return None if done is None else [(token, Batch(*res)) for token, res in done]

    def write(self, items: Sequence[WriteItem]) -> Batch:
        """Write and publish a batch of chunk files on the calling thread."""
        return Batch(*self._engine.write(items))

    def close(self) -> None:
        """Finish queued reads, stop the threads (finished batches stay for ``wait``)."""
        self._engine.close()
