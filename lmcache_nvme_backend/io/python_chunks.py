"""One chunk read or written by the Python engine, from a share's plain values.

Step for step what ``csrc/chunkio.c`` does per chunk (``chunk_read_run`` and ``finalize``,
``chunk_write_run``), so that both engines give the same statuses and errnos for the same
files:

* a read opens its file beneath the root's descriptor (``beneath.open_at``: no link
  followed) ``O_NONBLOCK`` (a FIFO never blocks) and reads only a regular file (else
  ``EINVAL``); its pieces (``posix.plan_pieces``: in place when the buffer allows, staged
  otherwise) each land and are hashed block by block by the thread that read them (a
  block spanning two pieces by the one that lands second); a file shorter than its header
  and payload is ``ENODATA``; the last piece judges the chunk (``format.quick_verdict``);
* a write removes its share's victims (on the share's first chunk), opens its shard
  directory beneath the root (making what is missing, exactly ``dir_mode``), creates its
  temp name ``O_EXCL | O_NOFOLLOW`` with exactly ``mode`` (a dead writer's leftover is
  replaced once), writes the payload hashed piece by piece and the header
  (``posix.ChunkFileIO.write_hashed_to``), syncs as asked and renames it into place; any
  failure removes the temp file.

``shares_to_reads`` and ``shares_to_writes`` turn batches (``engine.ReadShare``,
``engine.WriteShare``) into these chunks, refusing a malformed share as the compiled
engine does before anything runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import operator
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..disk import format as fmt
from ..disk.format import block_digests as hash_blocks
from .beneath import make_dirs_at, open_at, unlink_at
from .engine import FAILED, JUDGE, NEW_NAMESPACE, OK, ReadShare, WriteShare
from .files import create_in_dir
from .posix import ChunkFileIO, Piece, ShortFileError, plan_pieces, read_piece

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_HEX = re.compile(r"[0-9a-f]*")


@dataclass(eq=False)
class ShareRead:
    """One chunk of a read share: ``rel`` beneath ``root_fd`` into ``dest``, checked against
    ``key`` and ``meta``.  ``status`` and ``detail`` (``(errno, header or None, computed
    checksum)``, None when OK) are final once its last piece ran."""

    root_fd: int
    rel: str
    payload_len: int
    dest: memoryview
    direct: bool
    key: bytes
    meta: bytes
    header: bytes = b""
    error: BaseException | None = None
    pieces: list[Piece] = field(default_factory=list)
    status: int = FAILED
    detail: tuple[int, bytes | None, int] | None = None
    digests: list[int] = field(default_factory=list)  # each checksum block's, as it lands
    _pending: list[int] = field(default_factory=list)  # per block: pieces still to land
    _left: int = 0  # pieces not run yet
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, task_size: int) -> None:
        """Split the read into pieces of at most ``task_size`` and count each block's."""
        self.pieces = plan_pieces(self.dest, self.payload_len, self.direct, task_size)
        blocks = -(-self.payload_len // fmt.BLOCK_SIZE)
        self.digests, self._pending = [0] * blocks, [0] * blocks
        for piece in self.pieces:
            for block in self._blocks_of(piece):
                self._pending[block] += 1
        self._left = len(self.pieces)

    def run_piece(self, piece: Piece, head: memoryview) -> bool:
        """Read and hash one of its pieces (``head``: the thread's aligned header buffer);
        True when it was the last: the chunk is then judged and its buffers let go."""
        if self.error is None:
            try:
                self._transfer(piece, head)
            except ShortFileError:  # shorter than its header and payload, or cut meanwhile
                self._fail(OSError(errno.ENODATA, os.strerror(errno.ENODATA), self.rel))
            except Exception as exc:  # a piece must always count down
                self._fail(exc)
        if not self._piece_done(piece):
            return False
        try:
            self._judge()
        except Exception:  # never expected: the batch must end all the same
            logger.exception("NVMe tier: judging %s failed", self.rel)
            self.status, self.detail = FAILED, (errno.EIO, None, 0)
            self.release()
        return True

    def _transfer(self, piece: Piece, head: memoryview) -> None:
        fd = open_at(self.root_fd, self.rel, _READ_FLAGS | (_O_DIRECT if self.direct else 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # never read (read_failure names what it is)
                raise OSError(errno.EINVAL, "not a regular file", self.rel)
            header = read_piece(fd, st.st_size, piece, self.payload_len, self.direct, head,
                                self.rel)
            if header is not None:
                self.header = header
            if piece.copy is not None:
                src, dst = piece.copy
                dst[:] = src
        finally:
            os.close(fd)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def _blocks_of(self, piece: Piece) -> range:
        """The checksum blocks that the piece's payload bytes touch."""
        end = min(piece.start + piece.length, self.payload_len)
        if end <= piece.start:
            return range(0)
        return range(piece.start // fmt.BLOCK_SIZE, (end - 1) // fmt.BLOCK_SIZE + 1)

    def _piece_done(self, piece: Piece) -> bool:
        """Hash the blocks this piece completed; True when it was the chunk's last piece."""
        with self._lock:
            ready = []
            for block in self._blocks_of(piece):
                self._pending[block] -= 1
                if self._pending[block] == 0:
                    ready.append(block)
        # A version 1 file is checked over the whole payload (``_computed``): block digests
        # would be hashed for nothing once its header has landed.
        if self.error is None and fmt.stated_version(self.header) != 1:
            for block in ready:  # xxh3 releases the GIL: other pieces keep reading
                begin = block * fmt.BLOCK_SIZE
                end = min(begin + fmt.BLOCK_SIZE, self.payload_len)
                self.digests[block] = hash_blocks(self.dest[begin:end])[0]
        with self._lock:
            self._left -= 1
            return self._left == 0

    def _computed(self) -> int:
        """The payload checksum of the bytes that landed, as the header that landed states
        its version: the whole payload's xxh3 for version 1, the block digests combined
        otherwise."""
        if fmt.stated_version(self.header) == 1:
            return fmt.payload_checksum(self.dest[: self.payload_len], version=1)
        return fmt.combine_block_digests(self.digests)

    def _judge(self) -> None:
        if self.error is not None:
            err = getattr(self.error, "errno", None)
            self.status, self.detail = FAILED, (err if isinstance(err, int) and err else
                                                errno.EIO, None, 0)
        else:
            computed = self._computed()
            if fmt.quick_verdict(self.header, self.key, self.meta, self.payload_len, computed):
                self.status = OK
            else:
                self.status, self.detail = JUDGE, (0, self.header, computed)
        self.release()

    def release(self) -> None:
        """Let go of every view of the destination (its owner may free or resize it once
        the batch is handed back, as after the compiled engine)."""
        for piece in self.pieces:
            for view in (*piece.bufs, *(piece.copy or ())):
                _release(view)
        self.pieces = []
        _release(self.dest)


@dataclass(eq=False)
class ShareWrite:
    """One chunk of a write share, as plain values; ``run`` writes and publishes it."""

    root_fd: int
    dir_rel: str
    tmp_name: str
    final_name: str
    payload: memoryview
    key: bytes
    namespace: bytes
    meta: bytes
    gpu_checksum: tuple[int, int] | None
    direct: bool
    mode: int
    dir_mode: int
    fsync_level: int
    victims: tuple[str, ...]

    def run(self, io: ChunkFileIO) -> tuple[int, int]:
        """Remove the victims, write, sync and publish; ``(status, errno)``: OK or
        NEW_NAMESPACE (this call made the namespace's directory) with 0, or FAILED with the
        errno.  The payload is let go of either way."""
        try:
            for victim in self.victims:
                unlink_at(self.root_fd, victim)
            return self._publish(io)
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the payload (run, or cancelled before it ran)."""
        _release(self.payload)

    def _publish(self, io: ChunkFileIO) -> tuple[int, int]:
        created_at = -1
        # O_PATH: a descriptor only to name entries by; fsync needs a real one
        flags = (os.O_RDONLY if self.fsync_level >= 2 else _O_PATH) | os.O_DIRECTORY
        try:
            try:
                dir_fd = open_at(self.root_fd, self.dir_rel, flags)
            except FileNotFoundError:
                dir_fd, created_at = make_dirs_at(self.root_fd, self.dir_rel, self.dir_mode)
        except OSError as exc:
            return FAILED, exc.errno or errno.EIO
        try:
            err = self._write_and_rename(dir_fd, io)
            if not err and self.fsync_level >= 2:
                os.fsync(dir_fd)
        except OSError as exc:
            err = exc.errno or errno.EIO
        finally:
            os.close(dir_fd)
        if err:
            return FAILED, err
        # dir_rel is ns/<namespace id>/aa[/bb]: component 1 is the namespace's directory
        return (NEW_NAMESPACE if 0 <= created_at <= 1 else OK), 0

    def _write_and_rename(self, dir_fd: int, io: ChunkFileIO) -> int:
        """The temp file written whole and renamed to the final name; 0 or an errno."""
        try:
            fd = create_in_dir(dir_fd, self.tmp_name, self.direct, self.mode)
        except FileExistsError:  # left by a dead writer that had this name
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_name, dir_fd=dir_fd)
            try:
                fd = create_in_dir(dir_fd, self.tmp_name, self.direct, self.mode)
            except OSError as exc:
                return exc.errno or errno.EIO
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # O_DIRECT refused after the file was made
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp_name, dir_fd=dir_fd)
            return exc.errno or errno.EIO
        try:
            try:
                io.write_hashed_to(fd, self.payload, self._header_for, direct=self.direct,
                                   sync_data=self.fsync_level >= 1)
            finally:
                os.close(fd)
            os.rename(self.tmp_name, self.final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp_name, dir_fd=dir_fd)
            if isinstance(exc, OSError):
                return exc.errno or errno.EIO
            return errno.EINVAL if isinstance(exc, ValueError) else errno.EIO
        return 0

    def _header_for(self, digests: list[int]) -> bytes:
        return fmt.encode_raw_header(self.key, self.namespace, self.meta, len(self.payload),
                                     fmt.combine_block_digests(digests), time.time_ns(),
                                     self.gpu_checksum)


def _release(view: memoryview) -> None:
    """Let go of a view now; one still exported (held by a traceback after a failure) is
    let go of by the garbage collector instead."""
    with contextlib.suppress(BufferError):
        view.release()


# -- batches into chunks, checked as the compiled engine checks them ---------------------------


def shard_dir(prefix: str, levels: int, digest: str) -> str:
    """A chunk's shard directory as ``RootLayout`` names it (``csrc/module.c``
    ``put_shard_dir``): the prefix and the digest's first two characters, and with two
    levels ``/`` and the next two."""
    return prefix + digest[0:2] + ("/" + digest[2:4] if levels == 2 else "")


def _naming(naming: object, fields: int, what: str) -> tuple[str, int, list[str]]:
    """(prefix, levels, suffixes) of a share's naming; TypeError or ValueError when bad."""
    if not isinstance(naming, tuple) or len(naming) != fields or \
            not all(isinstance(naming[i], str) for i in range(fields) if i != 1):
        raise TypeError(f"{what}'s naming is (shard_prefix, shard_levels, final_suffix"
                        f"{', temp_suffix' if fields == 4 else ''})")
    prefix, levels, *suffixes = naming
    if levels not in (1, 2):
        raise ValueError(f"shard_levels must be 1 or 2, not {levels}")
    if any("\0" in text for text in (prefix, *suffixes)):
        raise ValueError(f"{what}'s naming holds a NUL character")
    return prefix, levels, suffixes


def _digests(digests: list[str], levels: int) -> None:
    for digest in digests:
        if not isinstance(digest, str):
            raise TypeError(f"a digest must be str, not {type(digest).__name__}")
        if len(digest) < 2 * levels or not _HEX.fullmatch(digest):
            raise ValueError(f"digest {digest!r} is not lowercase hex of {2 * levels} "
                             "characters or more")


def _columns(share: tuple[object, ...], at: int, what: str) -> None:
    columns = [c for c in share[at : at + 3] if isinstance(c, list)]
    if len(columns) != 3 or len({len(c) for c in columns}) != 1:
        raise TypeError(f"{what}'s digests, buffers and keys must be lists of one length")
    if not all(isinstance(key, bytes) for key in columns[2]):
        raise TypeError(f"{what}'s keys must be bytes")


def _byte_view(buf: object, writable: bool) -> memoryview:
    """A one-dimensional byte view of a buffer (``BufferError``: a read-only destination)."""
    view = memoryview(buf)  # type: ignore[arg-type]
    if writable and view.readonly:
        view.release()
        raise BufferError("a destination is not writable")
    if view.format != "B" or view.ndim != 1:
        cast = view.cast("B")
        view.release()
        return cast
    return view


def shares_to_reads(shares: Sequence[ReadShare], task_size: int) -> list[ShareRead]:
    """The chunks of a read batch, share by share, each planned in pieces of at most
    ``task_size``; ``TypeError`` / ``ValueError`` / ``BufferError`` for a malformed share
    (then no buffer is kept)."""
    reads: list[ShareRead] = []
    try:
        for n, share in enumerate(shares):
            what = f"read share {n}"
            if not isinstance(share, tuple) or len(share) != 8:
                raise TypeError(f"{what} is not a tuple of 8")
            root_fd, naming, direct, payload_len, meta, digests, dests, keys = share
            prefix, levels, (suffix,) = _naming(naming, 3, what)
            _columns(share, 5, what)
            _digests(digests, levels)
            if not isinstance(meta, bytes):
                raise TypeError(f"{what}'s metadata must be bytes")
            for digest, dest, key in zip(digests, dests, keys, strict=True):
                rel = f"{shard_dir(prefix, levels, digest)}/{digest}{suffix}"
                read = ShareRead(operator.index(root_fd), rel, operator.index(payload_len),
                                 _byte_view(dest, True), bool(direct), key, meta)
                reads.append(read)
                if len(read.dest) < read.payload_len:
                    raise ValueError(f"destination {len(reads) - 1} holds {len(read.dest)} "
                                     f"bytes, need {read.payload_len}")
                read.plan(task_size)
    except BaseException:
        for read in reads:
            read.release()
        raise
    return reads


def shares_to_writes(shares: Sequence[WriteShare]) -> list[ShareWrite]:
    """The chunks of a write batch, share by share (a share's victims with its first
    chunk); ``TypeError`` / ``ValueError`` for a malformed share (then no buffer is kept)."""
    writes: list[ShareWrite] = []
    try:
        for n, share in enumerate(shares):
            what = f"write share {n}"
            if not isinstance(share, tuple) or len(share) != 13:
                raise TypeError(f"{what} is not a tuple of 13")
            (root_fd, naming, namespace, meta, direct, mode, dir_mode, fsync_level, victims,
             digests, payloads, keys, gpu) = share
            prefix, levels, (final_suffix, temp_suffix) = _naming(naming, 4, what)
            _columns(share, 9, what)
            if not digests:  # its victims would be left
                raise ValueError(f"{what} has no chunks")
            _digests(digests, levels)
            if not isinstance(victims, tuple) or not all(isinstance(v, str) for v in victims):
                raise TypeError(f"{what}: victims must be a tuple of str")
            if not isinstance(namespace, bytes) or not isinstance(meta, bytes):
                raise TypeError(f"{what}'s namespace and metadata must be bytes")
            if gpu is not None and (not isinstance(gpu, list) or len(gpu) != len(digests)):
                raise TypeError(f"{what}'s GPU checksums are None or a list of one per chunk")
            for i, digest in enumerate(digests):
                final = digest + final_suffix
                writes.append(ShareWrite(
                    operator.index(root_fd), shard_dir(prefix, levels, digest),
                    final + temp_suffix, final, _byte_view(payloads[i], False), keys[i],
                    namespace, meta, _gpu_checksum(gpu, i), bool(direct),
                    operator.index(mode), operator.index(dir_mode),
                    operator.index(fsync_level), victims if i == 0 else ()))
    except BaseException:
        for write in writes:
            write.release()
        raise
    return writes


def _gpu_checksum(column: list[tuple[int, int]] | None, i: int) -> tuple[int, int] | None:
    if column is None:
        return None
    a, b = column[i]
    return operator.index(a), operator.index(b)
