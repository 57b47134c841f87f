"""Payload readers into GPU memory: kvikio (GDS or its compat mode) and a POSIX one.

A reader fills a contiguous uint8 CUDA tensor with a payload (at a 4 KiB-aligned offset
of its chunk file).  ``KvikioPayloadReader`` issues kvikio ``CuFile.pread`` for every
payload of a batch at once (DMA with cuFile/GDS, bounce buffers in compat mode);
``PosixTensorPayloadReader`` reads the same bytes into a CPU tensor, so the GPU reader's
logic is tested without a GPU.  kvikio is imported only when a reader is built.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..disk.format import HEADER_SIZE
from .files import open_for_read

if TYPE_CHECKING:
    import torch


@dataclass
class PayloadRead:
    """Read ``length`` bytes at the payload offset of ``path`` into ``dest``."""

    path: Path
    dest: torch.Tensor  # contiguous uint8, at least ``length`` bytes
    length: int
    nread: int = 0
    error: BaseException | None = None


class PayloadReader(Protocol):
    name: str

    def read(self, reads: Sequence[PayloadRead]) -> None:
        """Fill each read's ``dest``, ``nread`` and ``error``; never raises."""


class KvikioPayloadReader:
    """kvikio ``CuFile.pread`` of every payload of a batch at once (kvikio's thread pool).

    ``num_threads`` and ``task_size`` are process-wide kvikio settings (a larger payload
    is split into tasks read in parallel).  ``strict`` switches compat mode off, so a file
    cuFile cannot serve fails loudly instead of going through bounce buffers.
    """

    name = "kvikio"

    def __init__(self, threads: int, task_size: int, strict: bool) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        self.task_size = task_size
        settings: dict[str, Any] = {"num_threads": threads, "task_size": task_size}
        if strict:
            settings["compat_mode"] = kvikio.CompatMode.OFF
        kvikio.defaults.set(settings)

    def read(self, reads: Sequence[PayloadRead]) -> None:
        pending = []
        for r in reads:
            try:
                # kvikio opens by name: first make sure the name holds a regular file
                # (no link, no FIFO that would block a kvikio thread); see docs/robustness.md
                os.close(open_for_read(r.path, direct=False)[0])
                handle = self._kvikio.CuFile(r.path, "r")
            except OSError as exc:
                r.error = exc
                continue
            except Exception as exc:
                r.error = _open_error(r.path, exc)
                continue
            try:
                pending.append((r, handle, handle.pread(r.dest[: r.length], r.length,
                                                        HEADER_SIZE, self.task_size)))
            except Exception as exc:
                r.error = exc
                handle.close()
        for r, handle, future in pending:
            try:
                r.nread = int(future.get())
            except Exception as exc:
                r.error = exc
            finally:
                handle.close()


class PosixTensorPayloadReader:
    """``pread`` into CPU tensors: stands in for kvikio where there is no GPU (tests)."""

    name = "posix-tensor"

    def read(self, reads: Sequence[PayloadRead]) -> None:
        for r in reads:
            try:
                fd, _ = open_for_read(r.path, direct=False)
            except OSError as exc:
                r.error = exc
                continue
            try:
                view = memoryview(r.dest[: r.length].numpy()).cast("B")  # type: ignore[arg-type]
                while r.nread < r.length:
                    n = os.preadv(fd, [view[r.nread :]], HEADER_SIZE + r.nread)
                    if n == 0:
                        break
                    r.nread += n
            except OSError as exc:
                r.error = exc
            finally:
                os.close(fd)


def _open_error(path: Path, exc: BaseException) -> BaseException:
    """kvikio reports a missing file as RuntimeError; the store needs FileNotFoundError."""
    if not path.exists():
        return FileNotFoundError(errno.ENOENT, "chunk file vanished", str(path))
    return exc
