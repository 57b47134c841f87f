"""Slow, blocked and failing chunk I/O for tests, whichever engine the store runs.

A store reads and writes through the native engine when it is built (``io/native.py``,
whole batches) and through the Python engine otherwise (``io/posix.py``, chunk by
chunk).  These helpers put the same fault into either: the Python engine's calls are
wrapped, the native engine's batches are delayed, or their results turned into the
errors a drive or a file system would report (the store then handles them exactly as it
would handle the engine's own).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io.posix import ReadRequest, ShortFileError
from lmcache_nvme_backend.store.chunk_store import ChunkStore


def before_each_write(store: ChunkStore, hook: Callable[[], None]) -> None:
    """Call ``hook`` before every chunk write of ``store`` (it may sleep or block, as a
    slow or stuck drive would, without blocking the store call that queued the chunk)."""
    engine = store.native_engine
    if engine is None:
        real_write = store.io_engine.write_hashed_to

        def python_write(*args: Any, **kwargs: Any) -> None:
            hook()
            real_write(*args, **kwargs)

        store.io_engine.write_hashed_to = python_write  # type: ignore[method-assign]
        return
    real_submit = engine.submit_write

    def delayed(items: Any, on_done: Callable[[seam.Batch], None]) -> None:
        for _ in items:
            hook()
        real_submit(items, on_done)

    def native_submit(items: Any, on_done: Callable[[seam.Batch], None]) -> None:
        threading.Thread(target=delayed, args=(items, on_done), daemon=True).start()

    engine.submit_write = native_submit  # type: ignore[method-assign]


def fail_writes_under(store: ChunkStore, root: Path, err: int = errno.EIO) -> None:
    """Every chunk write beneath ``root`` fails with ``err``, as a failing drive would."""
    engine = store.native_engine
    if engine is None:
        real_write = store.io_engine.write_hashed_to

        def python_write(fd: int, *args: Any, **kwargs: Any) -> None:
            if root in Path(os.readlink(f"/proc/self/fd/{fd}")).parents:
                raise OSError(err, "injected")
            real_write(fd, *args, **kwargs)

        store.io_engine.write_hashed_to = python_write  # type: ignore[method-assign]
        return
    real_submit = engine.submit_write
    bad = os.stat(root)

    def beneath_root(fd: int) -> bool:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (bad.st_dev, bad.st_ino)

    def native_submit(items: Any, on_done: Callable[[seam.Batch], None]) -> None:
        keep = [i for i, item in enumerate(items) if not beneath_root(item[0])]  # its root_fd

        def merged(done: seam.Batch) -> None:
            statuses = bytearray([seam.FAILED] * len(items))
            details = [(i, seam.FAILED, err) for i in range(len(items)) if i not in keep]
            for k, i in enumerate(keep):
                statuses[i] = done.statuses[k]
            details += [(keep[d[0]], *d[1:]) for d in done.details]
            on_done(seam.Batch(bytes(statuses), sorted(details)))

        real_submit([items[i] for i in keep], merged)

    engine.submit_write = native_submit  # type: ignore[method-assign]


class FlakyReads:
    """Injects EIO, a short read or EACCES into every chunk read of a store.

    The bytes are really read; then the read fails, as a drive or a file system would
    report it, before the chunk is judged.  With the native engine every read of a batch
    comes back failed, so the store reads it again through the Python engine, which
    fails it the same way.
    """

    def __init__(self, store: ChunkStore, mode: str) -> None:
        self.store = store
        self.mode = mode
        self.active = threading.Event()
        engine = store.io_engine
        real_transfer = engine._transfer

        def transfer(req: ReadRequest, piece: object) -> None:
            real_transfer(req, piece)  # type: ignore[arg-type]
            if self.active.is_set():
                raise self.error()

        engine._transfer = transfer  # type: ignore[method-assign]
        native_engine = store.native_engine
        if native_engine is not None:
            native_engine.read = self._failing(native_engine.read)  # type: ignore[method-assign]
            native_engine.submit_read = self._failing_async(  # type: ignore[method-assign]
                native_engine.submit_read)

    def _failing(self, real: Callable[[Any], seam.Batch]) -> Callable[[Any], seam.Batch]:
        return lambda batch: self.failed(real(batch))

    def _failing_async(self, real: Callable[[Any, Callable[[seam.Batch], None]], None]
                       ) -> Callable[[Any, Callable[[seam.Batch], None]], None]:
        return lambda batch, on_done: real(batch, lambda done: on_done(self.failed(done)))

    def error(self) -> OSError:
        if self.mode == "eio":
            return OSError(errno.EIO, "injected EIO")
        if self.mode == "short":
            return ShortFileError(errno.EIO, "injected short read")
        return PermissionError(errno.EACCES, "injected permission denied")

    def failed(self, batch: seam.Batch) -> seam.Batch:
        if not self.active.is_set():
            return batch
        n = len(batch.statuses)
        return seam.Batch(bytes([seam.FAILED] * n),
                            [(i, errno.EIO, None, 0) for i in range(n)])

    def __enter__(self) -> FlakyReads:
        self.active.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self.active.clear()
