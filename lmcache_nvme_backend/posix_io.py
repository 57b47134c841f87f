"""POSIX I/O engine: chunk files read and written with O_DIRECT and aligned buffers.

The engine knows the file layout (header, then a 4 KiB-aligned padded payload)
but nothing about keys, indexes or capacity.  It moves bytes between chunk
files and caller memory:

* zero copy when the caller's buffer is 4 KiB aligned (the bulk of the payload
  is read or written in place; only a sub-4 KiB tail goes through a staging
  buffer), one staging copy when it is not;
* large payloads are split into ``task_size`` pieces and all pieces of a batch
  are issued in parallel on a thread pool (the syscalls release the GIL), which
  is how a Python process reaches a drive's queue depth;
* O_DIRECT is probed once per directory; where the filesystem refuses it the
  engine runs buffered and says so.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .format import ALIGNMENT, HEADER_SIZE, padded_length

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Linux transfers at most this many bytes in one read/write call.
_MAX_IO_CALL = 0x7FFFF000 // ALIGNMENT * ALIGNMENT


class ShortFileError(OSError):
    """The file ended before the bytes its header promises."""


class AlignedBuffer:
    """Page-aligned anonymous memory (mmap), usable as an O_DIRECT buffer."""

    def __init__(self, size: int) -> None:
        self.size = max(ALIGNMENT, padded_length(size))
        self._map = mmap.mmap(-1, self.size)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        self._map.close()


def buffer_address(buf: memoryview) -> int:
    """Address of the first byte of a buffer (works for read-only buffers too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


def is_aligned(buf: memoryview) -> bool:
    return buffer_address(buf) % ALIGNMENT == 0


def probe_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` accept O_DIRECT writes and reads of aligned buffers."""
    if not _O_DIRECT:
        return False
    probe = directory / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
    buf = AlignedBuffer(ALIGNMENT)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_DIRECT | _O_CLOEXEC, 0o600)
    except OSError as exc:
        # Linux creates the file before it refuses O_DIRECT with EINVAL.
        probe.unlink(missing_ok=True)
        buf.close()
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        os.pwrite(fd, buf.view, 0)
        os.preadv(fd, [buf.view], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buf.close()


@dataclass
class ReadRequest:
    """Read one chunk file: header into ``header`` bytes, payload into ``dest``."""

    path: Path
    payload_len: int
    dest: memoryview
    direct: bool
    header: bytes = b""
    error: BaseException | None = None
    _fd: int = -1
    _copies: list[tuple[memoryview, memoryview]] = field(default_factory=list)


class PosixIOEngine:
    """Reads and writes chunk files with O_DIRECT (or buffered I/O) and a thread pool."""

    name = "posix"

    def __init__(self, task_size: int, pool: ThreadPoolExecutor) -> None:
        """``pool`` runs the read pieces; its owner shuts it down."""
        if task_size % ALIGNMENT:
            raise ValueError(f"task size {task_size} is not a multiple of {ALIGNMENT}")
        self.task_size = task_size
        self._pool = pool
        self._local = threading.local()

    # -- reads ---------------------------------------------------------------

    def read_chunks(self, requests: list[ReadRequest]) -> None:
        """Fill each request's ``header`` and ``dest``; failures land in ``request.error``.

        All pieces of all requests are issued at once on the pool, so a batch of
        chunks (or one large chunk) keeps several I/Os in flight.
        """
        pieces: list[tuple[ReadRequest, Callable[[], None]]] = []
        for req in requests:
            try:
                pieces.extend((req, piece) for piece in self._plan_read(req))
            except (OSError, ValueError) as exc:
                req.error = exc
        self._run_pieces(pieces)
        for req in requests:
            if req._fd >= 0:
                os.close(req._fd)
                req._fd = -1
            if req.error is None:
                for src, dst in req._copies:
                    dst[:] = src
            req._copies.clear()

    def read_header(self, path: Path, direct: bool) -> tuple[bytes, int]:
        """The raw header of a chunk file and the file's size."""
        fd = _open_read(path, direct)
        try:
            size = os.fstat(fd).st_size
            buf = self._staging("header", HEADER_SIZE)
            _preadv_full(fd, [buf[:HEADER_SIZE]], 0)
            return bytes(buf[:HEADER_SIZE]), size
        finally:
            os.close(fd)

    def _plan_read(self, req: ReadRequest) -> list[Callable[[], None]]:
        if len(req.dest) < req.payload_len:
            raise ValueError(f"destination holds {len(req.dest)} bytes, need {req.payload_len}")
        req._fd = fd = _open_read(req.path, req.direct)
        need = HEADER_SIZE + (padded_length(req.payload_len) if req.direct else req.payload_len)
        if os.fstat(fd).st_size < need:
            raise ShortFileError(errno.EIO, "chunk file shorter than its payload", str(req.path))
        header_buf = AlignedBuffer(HEADER_SIZE)
        pieces: list[Callable[[], None]] = []

        def read_header() -> None:
            _preadv_full(fd, [header_buf.view], 0)
            req.header = bytes(header_buf.view)
            header_buf.close()

        pieces.append(read_header)
        in_place, staged = _split_for_direct(req.dest, req.payload_len, req.direct)
        for offset in range(0, len(in_place), self.task_size):
            part = in_place[offset : offset + self.task_size]
            pieces.append(_reader(fd, part, HEADER_SIZE + offset))
        if staged:
            staging = AlignedBuffer(staged)
            start = len(in_place)
            staged_io = padded_length(staged) if req.direct else staged
            pieces.append(_reader(fd, staging.view[:staged_io], HEADER_SIZE + start))
            req._copies.append((staging.view[:staged], req.dest[start : start + staged]))
        return pieces

    # -- writes --------------------------------------------------------------

    def write_chunk(self, path: Path, header: bytes, payload: memoryview, *, direct: bool,
                    mode: int, sync_data: bool) -> None:
        """Create ``path`` (must not exist) holding header, payload and zero padding."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
        fd = os.open(path, flags | (_O_DIRECT if direct else 0), mode)
        try:
            if not direct:
                pad = bytes(padded_length(len(payload)) - len(payload))
                _pwritev_full(fd, [header, payload, pad], 0)
            else:
                head = self._staging("header", HEADER_SIZE)
                head[:HEADER_SIZE] = header
                _pwritev_full(fd, [head[:HEADER_SIZE]], 0)
                in_place, staged = _split_for_direct(payload, len(payload), direct=True)
                for offset in range(0, len(in_place), self.task_size):
                    _pwritev_full(fd, [in_place[offset : offset + self.task_size]],
                                  HEADER_SIZE + offset)
                if staged:
                    tail = self._staging("write", padded_length(staged))
                    tail[:staged] = payload[len(in_place) :]
                    tail[staged : padded_length(staged)] = bytes(padded_length(staged) - staged)
                    _pwritev_full(fd, [tail[: padded_length(staged)]], HEADER_SIZE + len(in_place))
            if sync_data:
                os.fdatasync(fd)
        finally:
            os.close(fd)

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

    def _run_pieces(self, pieces: list[tuple[ReadRequest, Callable[[], None]]]) -> None:
        if len(pieces) <= 2:
            for req, piece in pieces:
                _run_piece(req, piece)
            return
        futures: list[Future[None]] = [
            self._pool.submit(_run_piece, req, piece) for req, piece in pieces
        ]
        for fut in futures:
            fut.result()


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


def _open_read(path: Path, direct: bool) -> int:
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | (_O_DIRECT if direct else 0)
    return os.open(path, flags)


def _run_piece(req: ReadRequest, piece: Callable[[], None]) -> None:
    if req.error is not None:
        return
    try:
        piece()
    except OSError as exc:
        req.error = exc


def _reader(fd: int, buf: memoryview, offset: int) -> Callable[[], None]:
    return lambda: _preadv_full(fd, [buf], offset)


def _preadv_full(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Read exactly ``sum(len(b))`` bytes at ``offset``; a premature EOF is ``ShortFileError``."""
    for buf in bufs:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done : done + _MAX_IO_CALL]], offset)
            if n == 0:
                raise ShortFileError(errno.EIO, "unexpected end of chunk file")
            done += n
            offset += n


def _pwritev_full(fd: int, bufs: list[memoryview | bytes], offset: int) -> None:
    """Write every byte of ``bufs`` at ``offset``."""
    for buf in bufs:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = os.pwritev(fd, [view[done : done + _MAX_IO_CALL]], offset)
            done += n
            offset += n
