"""Host I/O of chunk files: O_DIRECT and aligned buffers, for the Python engine and the tools.

What is here knows the file layout (header, then a 4 KiB-aligned padded payload) but
nothing about keys, indexes or capacity:

* ``ChunkFileIO``: a chunk file written (hashed piece by piece, the header last, in
  ``write_hashed_to``) and each thread's aligned staging buffers;
* ``plan_pieces`` and ``read_piece``: a payload read in pieces of at most ``task_size``,
  zero copy when the caller's buffer is 4 KiB aligned (only a sub-4 KiB tail goes through
  a staging buffer), one staging copy when it is not, the header in the same vectored call
  as the first piece;
* ``read_header``: a chunk file's header and size, by path (metadata reads, the tools).

The Python engine (``python_engine.py``, ``python_chunks.py``) runs the pieces on its
threads beneath a root's descriptor; the compiled engine does the same in C.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..disk.format import ALIGNMENT, BLOCK_SIZE, HEADER_SIZE, padded_length
from ..disk.format import block_digests as hash_blocks
from ..disk.safe_fs import NotAChunkFile
from .buffers import AlignedBuffer, is_aligned
from .files import (
    ShortFileError,
    open_for_read,
    open_for_read_sized,
    probe_direct_io,
    probe_direct_read,
)

__all__ = ["AlignedBuffer", "ChunkFileIO", "NotAChunkFile", "Piece", "ShortFileError",
           "open_for_read", "plan_pieces", "probe_direct_io", "probe_direct_read", "read_header",
           "read_piece"]

# Linux transfers at most this many bytes in one read/write call.
_MAX_IO_CALL = 0x7FFFF000 // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Piece:
    """One I/O of a read: payload bytes ``[start, start + length)`` land through ``bufs``."""

    start: int
    length: int
    bufs: list[memoryview]  # land at file offset HEADER_SIZE + start
    copy: tuple[memoryview, memoryview] | None = None  # staged: (staging, dest) after the read


class ChunkFileIO:
    """Writes chunk files (O_DIRECT or buffered) and keeps each thread's aligned staging
    buffers (``PythonEngine``'s readers and writers, and ``read_header``)."""

    def __init__(self, task_size: int) -> None:
        """``task_size``: the largest single I/O, a multiple of 4 KiB."""
        if task_size % ALIGNMENT:
            raise ValueError(f"task size {task_size} is not a multiple of {ALIGNMENT}")
        self.task_size = task_size
        self._local = threading.local()

    def prepare_thread(self) -> None:
        """Map the calling thread's staging buffers now rather than on its first chunk."""
        self._staging("header", HEADER_SIZE)

    def header_buffer(self) -> memoryview:
        """The calling thread's aligned buffer of one header (reused by every read and write
        of the thread: no mmap/munmap, and TLB shootdown, per chunk)."""
        return self._staging("header", HEADER_SIZE)[:HEADER_SIZE]

    # -- writes --------------------------------------------------------------

    def write_hashed_to(self, fd: int, payload: memoryview,
                        header_for: Callable[[list[int]], bytes], *, direct: bool,
                        sync_data: bool) -> None:
        """Write the payload and the header ``header_for(block digests)`` into a new, empty
        chunk file, zero padded to 4 KiB.

        A payload of one piece is hashed first and written with its header in one call.
        A larger one is written piece by piece, each piece's checksum blocks hashed
        just before it is written (on this thread: xxh3 runs at several GB/s and
        releases the GIL, and a hand-off per chunk to another thread costs more than it
        overlaps), and the header, which needs every digest, goes last.  The caller
        publishes the file by renaming it only after this returns.
        """
        piece = max(BLOCK_SIZE, self.task_size // BLOCK_SIZE * BLOCK_SIZE)
        if len(payload) <= piece:  # one piece: nothing to overlap, one call for everything
            self._write_payload(fd, payload, direct, header_for(hash_blocks(payload)))
        else:
            digests: list[int] = []
            for start in range(0, len(payload), piece):
                view = payload[start : start + piece]
                digests += hash_blocks(view)
                self._write_payload(fd, view, direct, None, offset=start)
            _pwritev_full(fd, [self._header_view(header_for(digests), direct)], 0)
        if sync_data:
            os.fdatasync(fd)

    def _write_payload(self, fd: int, payload: memoryview, direct: bool,
                       header: bytes | None, offset: int = 0) -> None:
        """``payload`` at payload offset ``offset`` (file offset ``4096 + offset``), zero padded
        to 4 KiB when it ends the payload; with ``header``, the header first, in one call.

        ``offset`` is a multiple of 4 KiB: a payload written in pieces pads only its last.
        """
        lead = [] if header is None else [self._header_view(header, direct)]
        at = 0 if lead else HEADER_SIZE + offset  # a header starts the file
        if not direct:
            pad = bytes(padded_length(len(payload)) - len(payload))
            _pwritev_full(fd, [*lead, payload, pad], at)
            return
        in_place, staged = _split_for_direct(payload, len(payload), direct=True)
        if lead or len(in_place):  # the header goes out with the first payload piece
            _pwritev_full(fd, [*lead, in_place[: self.task_size]], at)
        for start in range(self.task_size, len(in_place), self.task_size):
            _pwritev_full(fd, [in_place[start : start + self.task_size]],
                          HEADER_SIZE + offset + start)
        if staged:
            tail = self._staging("write", padded_length(staged))
            tail[:staged] = payload[len(in_place) :]
            tail[staged : padded_length(staged)] = bytes(padded_length(staged) - staged)
            _pwritev_full(fd, [tail[: padded_length(staged)]],
                          HEADER_SIZE + offset + len(in_place))

    def _header_view(self, header: bytes, direct: bool) -> bytes | memoryview:
        """The header as written: copied into this thread's aligned buffer for O_DIRECT."""
        if not direct:
            return header
        head = self._staging("header", HEADER_SIZE)
        head[:HEADER_SIZE] = header
        return head[:HEADER_SIZE]

    # -- helpers -------------------------------------------------------------

    def _staging(self, purpose: str, size: int) -> memoryview:
        """A per-thread aligned buffer of at least ``size`` bytes, reused across calls."""
        bufs: dict[str, AlignedBuffer] = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(purpose)
        if buf is None or buf.size < size:
            if buf is not None:
                buf.close()
            buf = bufs[purpose] = AlignedBuffer(size)
        return buf.view


def read_header(path: Path, direct: bool) -> tuple[bytes, int]:
    """The raw header of a chunk file and the file's size (the calling thread's buffer)."""
    head = _HEADERS.header_buffer()
    fd, size = open_for_read_sized(path, direct)
    try:
        _preadv_full(fd, [head], 0)
        return bytes(head), size
    finally:
        os.close(fd)


#: Each thread's header buffer for ``read_header`` outside an engine (metadata reads).
_HEADERS = ChunkFileIO(ALIGNMENT)


def plan_pieces(dest: memoryview, payload_len: int, direct: bool, task_size: int
                ) -> list[Piece]:
    """The I/Os that read a payload of ``payload_len`` bytes into ``dest``: pieces of at most
    ``task_size`` landing in place (all of it when reads are buffered, or when ``dest`` is
    4 KiB aligned and holds the padded payload; else its whole 4 KiB pages), and one staged
    piece for the rest (through an aligned buffer, copied into ``dest`` after the read).
    An empty payload is one piece of no bytes: the header alone.  ``ValueError`` when
    ``dest`` holds fewer than ``payload_len`` bytes."""
    if len(dest) < payload_len:
        raise ValueError(f"destination holds {len(dest)} bytes, need {payload_len}")
    pieces: list[Piece] = []
    in_place, staged = _split_for_direct(dest, payload_len, direct)
    for offset in range(0, len(in_place), task_size):
        view = in_place[offset : offset + task_size]
        pieces.append(Piece(offset, len(view), [view]))
    if staged:
        staging = AlignedBuffer(staged).view
        start = len(in_place)
        staged_io = padded_length(staged) if direct else staged
        pieces.append(Piece(start, staged, [staging[:staged_io]],
                             copy=(staging[:staged], dest[start : start + staged])))
    if not pieces:  # an empty payload: the header alone
        pieces.append(Piece(0, 0, []))
    return pieces


def read_piece(fd: int, size: int, piece: Piece, payload_len: int, direct: bool,
               head: memoryview, path: str = "") -> bytes | None:
    """Read one piece (``plan_pieces``) from an open chunk file of ``size`` bytes; the first
    (``start`` 0) brings the header too, in the same vectored call, and is returned (None
    for the others) after the file's size was checked against the payload's.  A staged
    piece lands in its staging buffer (the caller copies it).  ``ShortFileError`` when the
    file is shorter than the header and payload."""
    if piece.start:
        _preadv_full(fd, piece.bufs, HEADER_SIZE + piece.start)
        return None
    need = HEADER_SIZE + (padded_length(payload_len) if direct else payload_len)
    if size < need:
        raise ShortFileError(errno.EIO, "chunk file shorter than its payload", path)
    _preadv_full(fd, [head, *piece.bufs], 0)
    return bytes(head)

def _split_for_direct(buf: memoryview, length: int, direct: bool) -> tuple[memoryview, int]:
    """(part usable in place, number of trailing bytes that need a staging buffer)."""
    if not direct:
        return buf[:length], 0
    if not is_aligned(buf):
        return buf[:0], length
    if len(buf) >= padded_length(length):
        return buf[: padded_length(length)], 0
    bulk = length // ALIGNMENT * ALIGNMENT
    return buf[:bulk], length - bulk


def _preadv_full(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Read exactly ``sum(len(b))`` bytes at ``offset`` into ``bufs``, one vectored call
    when the kernel allows; a premature EOF is ``ShortFileError``."""
    views = [b for b in bufs if len(b)]
    while views:
        n = os.preadv(fd, _capped(views), offset)
        if n == 0:
            raise ShortFileError(errno.EIO, "unexpected end of chunk file")
        offset += n
        views = _advance(views, n)


def _pwritev_full(fd: int, bufs: list[memoryview | bytes], offset: int) -> None:
    """Write every byte of ``bufs`` at ``offset``, one vectored call when the kernel allows."""
    views = [memoryview(b) for b in bufs if len(b)]
    while views:
        n = os.pwritev(fd, _capped(views), offset)
        offset += n
        views = _advance(views, n)


def _capped(views: list[memoryview]) -> list[memoryview]:
    """The leading buffers of one system call: at most ``_MAX_IO_CALL`` bytes in total."""
    out: list[memoryview] = []
    room = _MAX_IO_CALL
    for view in views:
        if room <= 0:
            break
        out.append(view[:room])
        room -= len(out[-1])
    return out


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    while n:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0] = views[0][n:]
            n = 0
    return views
