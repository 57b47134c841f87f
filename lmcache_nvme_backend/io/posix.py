"""Host I/O of chunk files: O_DIRECT and aligned buffers, for the Python engine and the tools.

It knows the file layout (header, then a 4 KiB-aligned padded payload), not keys, indexes
or capacity: ``write_chunk`` and ``read_chunk`` move a whole chunk file, ``read_header``
reads a header by path.  A payload moves in I/Os of at most ``task_size`` bytes, the header
in the first; zero copy where the caller's buffer is 4 KiB aligned (only a sub-4 KiB tail
is staged), one staging copy where it is not.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..disk.format import ALIGNMENT, HEADER_SIZE, padded_length
from ..disk.safe_fs import NotAChunkFile
from .buffers import AlignedBuffer, is_aligned
from .files import ShortFileError, open_for_read, probe_direct_io, probe_direct_read

__all__ = ["NotAChunkFile", "ShortFileError", "probe_direct_io", "probe_direct_read",
           "read_chunk", "read_header", "write_chunk"]

# Linux transfers at most this many bytes in one read/write call.
_MAX_IO_CALL = 0x7FFFF000 // ALIGNMENT * ALIGNMENT

_local = threading.local()


def write_chunk(fd: int, header: bytes, payload: memoryview, direct: bool,
                task_size: int) -> None:
    """Write a new, empty chunk file whole: ``header``, then the payload zero padded to 4 KiB."""
    in_place, staged = _split_for_direct(payload, len(payload), direct)
    rest = padded_length(len(payload)) - len(in_place)  # the staged bytes and the padding
    tail = _staging("write", rest)[:rest]
    tail[:staged] = payload[len(in_place) :]
    tail[staged:] = bytes(rest - staged)
    head = _staging("header", HEADER_SIZE)[:HEADER_SIZE]
    head[:] = header
    _transfer(os.pwritev, fd, head, [in_place, tail], task_size)


def read_chunk(fd: int, size: int, dest: memoryview, payload_len: int, direct: bool,
               task_size: int, path: str = "") -> bytes:
    """Read an open chunk file of ``size`` bytes: its payload into ``dest``, and its header,
    returned.  ``ShortFileError`` when the file is shorter than the header and payload."""
    if size < HEADER_SIZE + (padded_length(payload_len) if direct else payload_len):
        raise ShortFileError(errno.EIO, "chunk file shorter than its payload", path)
    in_place, staged = _split_for_direct(dest, payload_len, direct)
    head = _staging("header", HEADER_SIZE)[:HEADER_SIZE]
    if not staged:
        _transfer(os.preadv, fd, head, [in_place], task_size)
        return bytes(head)
    staging = AlignedBuffer(staged).view  # freed with its last view
    _transfer(os.preadv, fd, head, [in_place, staging[: padded_length(staged)]], task_size)
    dest[len(in_place) : payload_len] = staging[:staged]
    return bytes(head)


def read_header(path: Path, direct: bool) -> tuple[bytes, int]:
    """The raw header of a chunk file and the file's size."""
    head = _staging("header", HEADER_SIZE)[:HEADER_SIZE]
    fd, size = open_for_read(path, direct)
    try:
        _move_all(os.preadv, fd, [head], 0)
        return bytes(head), size
    finally:
        os.close(fd)


def _staging(purpose: str, size: int) -> memoryview:
    """The calling thread's aligned buffer for ``purpose``, at least ``size`` bytes, reused
    across calls (no mmap/munmap, and TLB shootdown, per chunk)."""
    bufs: dict[str, AlignedBuffer] = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(purpose)
    if buf is None or buf.size < size:
        if buf is not None:
            buf.close()
        buf = bufs[purpose] = AlignedBuffer(size)
    return buf.view


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


IoCall = Callable[[int, list[memoryview], int], int]


def _transfer(call: IoCall, fd: int, head: memoryview, views: list[memoryview],
              task_size: int) -> None:
    """``call`` (``os.preadv`` or ``os.pwritev``) on the header at offset 0 and the payload
    ``views`` after it, in calls of at most ``task_size`` payload bytes, the header in the
    first: one call for a chunk of at most ``task_size``."""
    step = min(task_size, _MAX_IO_CALL - HEADER_SIZE)
    pieces = [view[at : at + step] for view in views for at in range(0, len(view), step)]
    offset = _move_all(call, fd, [head, *pieces[:1]], 0)
    for piece in pieces[1:]:
        offset = _move_all(call, fd, [piece], offset)


def _move_all(call: IoCall, fd: int, bufs: list[memoryview], offset: int) -> int:
    """Move every byte of ``bufs`` at ``offset``, resuming after a partial transfer; the
    offset after them.  A read that meets the end of the file is ``ShortFileError``."""
    views = [b for b in bufs if len(b)]
    while views:
        n = call(fd, views, offset)
        if n == 0:
            raise ShortFileError(errno.EIO, "unexpected end of chunk file")
        offset += n
        while n:  # drop what moved
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0
    return offset
