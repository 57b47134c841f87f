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

import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..disk.format import ALIGNMENT, HEADER_SIZE, padded_length
from ..disk.layout import split_tree_path
from ..disk.safe_fs import NotAChunkFile, create_beneath, kind_of, open_beneath

__all__ = ["AlignedBuffer", "NotAChunkFile", "PosixIOEngine", "ReadRequest", "ShortFileError",
           "create_for_write", "open_for_read", "probe_direct_io", "probe_direct_read"]

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# Linux transfers at most this many bytes in one read/write call.
HUGE_PAGE = 2 * 1024 * 1024
_MAX_IO_CALL = 0x7FFFF000 // ALIGNMENT * ALIGNMENT


class ShortFileError(OSError):
    """The file ended before the bytes its header promises."""


class AlignedBuffer:
    """Page-aligned private anonymous memory (mmap), usable as an O_DIRECT buffer.

    Buffers of 2 MiB and more start on a 2 MiB boundary and ask for transparent
    huge pages: a direct read into 4 KiB pages needs one DMA segment per page,
    and queues with a segment limit (virtio-blk: 254) split every 2 MiB read
    into several requests.  Measured on a virtio disk: 2 MiB O_DIRECT reads at
    queue depth 8 ran 2.4x faster into huge-page buffers (docs/cli.md).
    """

    def __init__(self, size: int) -> None:
        self.size = max(ALIGNMENT, padded_length(size))
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if self.size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
            self._map = mmap.mmap(-1, self.size, flags=flags)
            self._base = memoryview(self._map)
            self.view = self._base
            return
        huge_span = -(-self.size // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, huge_span + HUGE_PAGE, flags=flags)
        self._base = memoryview(self._map)
        offset = -buffer_address(self._base) % HUGE_PAGE
        self._map.madvise(mmap.MADV_HUGEPAGE, offset, huge_span)
        self.view = self._base[offset : offset + self.size]

    def close(self) -> None:
        self.view.release()
        self._base.release()
        self._map.close()


def buffer_address(buf: memoryview) -> int:
    """Address of the first byte of a buffer (works for read-only buffers too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


def is_aligned(buf: memoryview) -> bool:
    return buffer_address(buf) % ALIGNMENT == 0


def probe_direct_io(directory: Path, existing: Path | None = None) -> bool:
    """Whether files in ``directory`` accept O_DIRECT writes and reads of aligned buffers.

    The probe file has a random name, created ``O_EXCL | O_NOFOLLOW`` (a name planted in
    the directory is skipped, never followed).  On a full filesystem (ENOSPC / EDQUOT:
    no block or no inode for the probe) the answer comes from reading ``existing`` (a
    regular file in the same filesystem, e.g. the cache marker) with O_DIRECT, which
    needs no space; with no such file the answer is False (buffered I/O, always safe).
    """
    if not _O_DIRECT:
        return False
    buf = AlignedBuffer(ALIGNMENT)
    try:
        for _ in range(16):
            probe = directory / f".odirect-probe-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_DIRECT
                             | _O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                # Linux creates the file before it refuses O_DIRECT with EINVAL.
                _unlink_missing_ok(probe)
                if exc.errno == errno.EINVAL:
                    return False
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    return existing is not None and probe_direct_read(existing)
                raise
        else:
            raise FileExistsError(errno.EEXIST, "no free probe file name", str(directory))
        try:
            os.pwrite(fd, buf.view, 0)
            os.preadv(fd, [buf.view], 0)
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return existing is not None and probe_direct_read(existing)
            raise
        finally:
            os.close(fd)
            _unlink_missing_ok(probe)
    finally:
        buf.close()


def probe_direct_read(path: Path) -> bool:
    """Whether an existing regular file reads with O_DIRECT into an aligned buffer.

    Writes nothing and needs no free space: what ``lmcache-nvme verify`` uses, and
    the store's probe on a full filesystem.  A missing or unusable file is False.
    """
    if not _O_DIRECT:
        return False
    buf = AlignedBuffer(ALIGNMENT)
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_DIRECT | _O_CLOEXEC)
    except OSError:
        buf.close()
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.preadv(fd, [buf.view], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


def _unlink_missing_ok(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


@dataclass
class ReadRequest:
    """Read one chunk file: header into ``header`` bytes, payload into ``dest``."""

    path: Path
    payload_len: int
    dest: memoryview
    direct: bool
    header: bytes = b""
    error: BaseException | None = None
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
        chunks (or one large chunk) keeps several I/Os in flight.  Each piece
        opens the file itself: opening (a disk read when the inode cache is cold)
        runs in parallel too, and a piece is one pool task, not two.
        """
        pieces: list[tuple[ReadRequest, Callable[[], None]]] = []
        for req in requests:
            try:
                pieces.extend((req, piece) for piece in self._plan_read(req))
            except ValueError as exc:
                req.error = exc
        self._run_pieces(pieces)
        for req in requests:
            if req.error is None:
                for src, dst in req._copies:
                    dst[:] = src
            req._copies.clear()

    def read_header(self, path: Path, direct: bool) -> tuple[bytes, int]:
        """The raw header of a chunk file and the file's size."""
        fd = open_for_read(path, direct)
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
        need = HEADER_SIZE + (padded_length(req.payload_len) if req.direct else req.payload_len)
        # (file offset, buffers) of each I/O; the header rides with the first payload piece
        ios: list[tuple[int, list[memoryview]]] = []
        in_place, staged = _split_for_direct(req.dest, req.payload_len, req.direct)
        for offset in range(0, len(in_place), self.task_size):
            ios.append((HEADER_SIZE + offset, [in_place[offset : offset + self.task_size]]))
        if staged:
            staging = AlignedBuffer(staged)
            start = len(in_place)
            staged_io = padded_length(staged) if req.direct else staged
            ios.append((HEADER_SIZE + start, [staging.view[:staged_io]]))
            req._copies.append((staging.view[:staged], req.dest[start : start + staged]))
        first = ios[0][1] if ios else []

        def header_and_first_piece() -> None:
            # the running thread's own buffer: no mmap/munmap (and TLB shootdown) per chunk
            head = self._staging("header", HEADER_SIZE)[:HEADER_SIZE]
            fd = open_for_read(req.path, req.direct)
            try:
                if os.fstat(fd).st_size < need:
                    raise ShortFileError(errno.EIO, "chunk file shorter than its payload",
                                         str(req.path))
                _preadv_full(fd, [head, *first], 0)
            finally:
                os.close(fd)
            req.header = bytes(head)

        return [header_and_first_piece,
                *(_reader(req, bufs, offset) for offset, bufs in ios[1:])]

    # -- writes --------------------------------------------------------------

    def write_chunk(self, path: Path, header: bytes, payload: memoryview, *, direct: bool,
                    mode: int, sync_data: bool) -> None:
        """Create ``path`` (must not exist) holding header, payload and zero padding."""
        fd = create_for_write(path, direct, mode)  # exactly nvme.file_mode, never a link
        try:
            if not direct:
                pad = bytes(padded_length(len(payload)) - len(payload))
                _pwritev_full(fd, [header, payload, pad], 0)
            else:
                head = self._staging("header", HEADER_SIZE)
                head[:HEADER_SIZE] = header
                in_place, staged = _split_for_direct(payload, len(payload), direct=True)
                # the header goes out with the first payload piece, in one call
                _pwritev_full(fd, [head[:HEADER_SIZE], in_place[: self.task_size]], 0)
                for offset in range(self.task_size, len(in_place), self.task_size):
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


def open_for_read(path: Path, direct: bool) -> int:
    """Open a chunk file for reading; every read of a chunk file opens it here.

    ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks the reader) and an ``fstat``
    check: anything but a regular file raises :class:`NotAChunkFile`, which readers
    treat as a miss, not a drive error.  A file in a cache tree's shard directory is
    opened beneath its root without following a link in any component
    (``disk/safe_fs.py``).
    """
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
    where = split_tree_path(path)
    try:
        if where is not None:
            fd = open_beneath(where[0], where[1], flags | (_O_DIRECT if direct else 0))
        else:
            fd = os.open(path, flags | (_O_DIRECT if direct else 0))
    except OSError as exc:
        if isinstance(exc, NotAChunkFile):
            raise
        if exc.errno == errno.ELOOP:
            raise NotAChunkFile(errno.ELOOP, "a symbolic link (never followed)",
                                str(path)) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.EINVAL):
            # a socket (ENXIO), or O_DIRECT refused by a directory or a special file
            try:
                st = os.lstat(path)
            except OSError:
                raise exc from None
            if not stat.S_ISREG(st.st_mode):
                raise NotAChunkFile(exc.errno, f"a {kind_of(st.st_mode)}, not a chunk file",
                                    str(path)) from None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotAChunkFile(errno.EINVAL, f"a {kind_of(st.st_mode)}, not a chunk file",
                            str(path))
    return fd


def create_for_write(path: Path, direct: bool, mode: int) -> int:
    """Create a new chunk (temp) file with exactly ``mode`` for writing.

    ``O_EXCL`` (never an existing file or link); in a cache tree's shard directory no
    component is reached through a link (``NotAChunkFile``).
    """
    flags = os.O_WRONLY | (_O_DIRECT if direct else 0)
    where = split_tree_path(path)
    if where is not None:
        return create_beneath(where[0], where[1], mode, flags)
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # open() applied the umask
    except OSError:
        os.close(fd)
        raise
    return fd


def _run_piece(req: ReadRequest, piece: Callable[[], None]) -> None:
    if req.error is not None:
        return
    try:
        piece()
    except OSError as exc:
        req.error = exc


def _reader(req: ReadRequest, bufs: list[memoryview], offset: int) -> Callable[[], None]:
    def read() -> None:
        fd = open_for_read(req.path, req.direct)
        try:
            _preadv_full(fd, bufs, offset)
        finally:
            os.close(fd)

    return read


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
