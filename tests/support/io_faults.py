"""Slow, blocked and failing chunk I/O for tests, whichever engine the store runs.

A store reads and writes through one engine (``io/engine.py``: the native one when it is
built, the Python one otherwise), in batches of shares.  These helpers put a fault at that
seam, the same for both: a batch is delayed, or its result turned into the errors a drive
or a file system would report (the store then handles them exactly as it would handle the
engine's own).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.store.chunk_store import ChunkStore


def before_each_write(store: ChunkStore, hook: Callable[[], None]) -> None:
    """Call ``hook`` before every chunk write of ``store`` (it may sleep or block, as a
    slow or stuck drive would, without blocking the store call that queued the chunk)."""
    engine = store.engine
    real_submit = engine.submit_write

    def delayed(shares: Any, on_done: Callable[[seam.Batch], None]) -> None:
        for _ in range(_chunks(shares)):
            hook()
        real_submit(shares, on_done)

    def native_submit(shares: Any, on_done: Callable[[seam.Batch], None]) -> None:
        threading.Thread(target=delayed, args=(shares, on_done), daemon=True).start()

    engine.submit_write = native_submit  # type: ignore[method-assign]


def fail_writes_under(store: ChunkStore, root: Path, err: int = errno.EIO) -> None:
    """Every chunk write beneath ``root`` fails with ``err``, as a failing drive would."""
    engine = store.engine
    real_submit = engine.submit_write
    bad = os.stat(root)

    def beneath_root(fd: int) -> bool:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (bad.st_dev, bad.st_ino)

    def native_submit(shares: Any, on_done: Callable[[seam.Batch], None]) -> None:
        kept, keep, at = [], [], 0  # the shares not beneath ``root`` (by their root_fd)
        for share in shares:
            if not beneath_root(share[0]):
                kept.append(share)
                keep += range(at, at + len(share[9]))
            at += len(share[9])

        def merged(done: seam.Batch) -> None:
            statuses = bytearray([seam.FAILED] * at)
            details = [(i, seam.FAILED, err) for i in range(at) if i not in keep]
            for k, i in enumerate(keep):
                statuses[i] = done.statuses[k]
            details += [(keep[d[0]], *d[1:]) for d in done.details]
            on_done(seam.Batch(bytes(statuses), sorted(details)))

        real_submit(kept, merged)

    engine.submit_write = native_submit  # type: ignore[method-assign]


def _chunks(shares: Any) -> int:
    """The chunks of a batch of write shares (their digests' column)."""
    return sum(len(share[9]) for share in shares)


class FlakyReads:
    """Injects EIO, a short read or EACCES into every chunk read of a store.

    The bytes are really read; then the batch comes back with every chunk failed with the
    errno a drive or a file system would report, before the chunks are judged.
    """

    ERRNOS = {"eio": errno.EIO, "short": errno.ENODATA, "eacces": errno.EACCES}

    def __init__(self, store: ChunkStore, mode: str) -> None:
        self.store = store
        self.errno = self.ERRNOS[mode]
        self.active = threading.Event()
        engine = store.engine
        engine.read = self._failing(engine.read)  # type: ignore[method-assign]
        engine.submit_read = self._failing_async(engine.submit_read)  # type: ignore[method-assign]

    def _failing(self, real: Callable[[Any], seam.Batch]) -> Callable[[Any], seam.Batch]:
        return lambda batch: self.failed(real(batch))

    def _failing_async(self, real: Callable[[Any, Callable[[seam.Batch], None]], None]
                       ) -> Callable[[Any, Callable[[seam.Batch], None]], None]:
        return lambda batch, on_done: real(batch, lambda done: on_done(self.failed(done)))

    def failed(self, batch: seam.Batch) -> seam.Batch:
        if not self.active.is_set():
            return batch
        n = len(batch.statuses)
        return seam.Batch(bytes([seam.FAILED] * n), [(i, self.errno, None, 0) for i in range(n)])

    def __enter__(self) -> FlakyReads:
        self.active.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self.active.clear()


class StuckReads:
    """Every chunk read of a store hangs, as one on a stopped GlusterFS brick or a lost NFS
    server does, until ``release``: then each held batch really runs (its bytes land
    wherever the store told the engine to put them) and comes back late.  Closing the
    engine waits for the release too, as joining an I/O thread stuck in the kernel would.
    """

    def __init__(self, store: ChunkStore) -> None:
        self.released = threading.Event()
        self.batches = 0  # batches the store handed to the engine
        engine = store.engine
        real_submit, real_close = engine.submit_read, engine.close

        def stuck(shares: Any, on_done: Callable[[seam.Batch], None]) -> None:
            self.batches += 1
            threading.Thread(target=self._late, args=(real_submit, shares, on_done),
                             daemon=True).start()

        def stuck_close() -> None:
            self.released.wait()
            real_close()

        engine.submit_read = stuck  # type: ignore[method-assign]
        engine.close = stuck_close  # type: ignore[method-assign]

    def _late(self, submit: Callable[..., None], shares: Any,
              on_done: Callable[[seam.Batch], None]) -> None:
        self.released.wait()
        with contextlib.suppress(RuntimeError):  # closed meanwhile: ends with the engine
            submit(shares, on_done)

    def release(self) -> None:
        """The filesystem answers again: held batches run, and later ones are not held."""
        self.released.set()
