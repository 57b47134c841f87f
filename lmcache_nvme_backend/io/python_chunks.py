"""One chunk read or written by the Python engine, from a share's plain values.

What ``csrc/chunkio.c`` does per chunk, with the same statuses and errnos.  Paths resolve
beneath the root's descriptor (``disk/resolve.py``) and keep their errnos as they come (a
link is ``ELOOP`` or ``ENOTDIR``, a path out of the root ``EXDEV``):

* a read opens its file ``O_NONBLOCK`` and reads only a regular file (else ``EINVAL``); a
  file shorter than header and payload is ``ENODATA``; the checksum of what landed and the
  header then judge the chunk (``format.quick_verdict``);
* a write removes its share's victims (with the share's first chunk), opens its shard
  directory (making what is missing), creates its temp name ``O_EXCL | O_NOFOLLOW`` (a
  dead writer's leftover is replaced once), writes, syncs as asked and renames it into
  place; any failure removes the temp file.

``shares_to_reads`` and ``shares_to_writes`` turn batches into these chunks, refusing a
malformed share as the compiled engine does, before anything runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import operator
import os
import re
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..disk import format as fmt
from ..disk.resolve import make_dirs_at, open_at
from ..disk.safe_fs import create_in
from .engine import FAILED, JUDGE, NEW_NAMESPACE, OK, ReadShare, WriteShare
from .files import ShortFileError
from .posix import read_chunk, write_chunk

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_HEX = re.compile(r"[0-9a-f]*")


@dataclass(eq=False)
class ShareRead:
    """One chunk of a read share: ``rel`` beneath ``root_fd`` into ``dest``, checked against
    ``key`` and ``meta``.  ``status`` and ``detail`` (``(errno, header or None, computed
    checksum)``, None when OK) are final once it ran."""

    root_fd: int
    rel: str
    payload_len: int
    dest: memoryview
    direct: bool
    key: bytes
    meta: bytes
    status: int = FAILED
    detail: tuple[int, bytes | None, int] | None = None

    def run(self, task_size: int) -> None:
        """Read and judge the chunk in I/Os of at most ``task_size``; the buffer is let go."""
        try:
            header = self._read(task_size)
            # the checksum as the header that landed states its version (1: the whole
            # payload's xxh3; else the block digests combined)
            computed = fmt.payload_checksum(self.dest[: self.payload_len],
                                            fmt.stated_version(header) or fmt.FORMAT_VERSION)
            ok = fmt.quick_verdict(header, self.key, self.meta, self.payload_len, computed)
        except ShortFileError:  # shorter than its header and payload, or cut meanwhile
            self.detail = (errno.ENODATA, None, 0)
        except OSError as exc:
            self.detail = (exc.errno or errno.EIO, None, 0)
        except Exception:  # never expected: the batch must end all the same
            logger.exception("NVMe tier: reading %s failed unexpectedly", self.rel)
            self.detail = (errno.EIO, None, 0)
        else:
            if ok:
                self.status = OK
            else:
                self.status, self.detail = JUDGE, (0, header, computed)
        finally:
            self.release()

    def _read(self, task_size: int) -> bytes:
        fd = open_at(self.root_fd, self.rel, _READ_FLAGS | (_O_DIRECT if self.direct else 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # never read (read_failure names what it is)
                raise OSError(errno.EINVAL, "not a regular file", self.rel)
            return read_chunk(fd, st.st_size, self.dest, self.payload_len, self.direct,
                              task_size, self.rel)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Let go of the destination (its owner may free it once the batch is handed back)."""
        _release(self.dest)


@dataclass(eq=False)
class ShareWrite:
    """One chunk of a write share, as plain values; ``run`` writes and publishes it.
    ``status`` and ``err`` are final once it ran (or was cancelled)."""

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
    status: int = FAILED
    err: int = 0

    def run(self, task_size: int) -> None:
        """Remove the victims, write, sync and publish: OK, NEW_NAMESPACE (this write made the
        namespace's directory) or FAILED with the errno; the payload is let go."""
        try:
            for victim in self.victims:
                unlink_at(self.root_fd, victim)
            created_at = self._publish(task_size)
        except OSError as exc:
            self.err = exc.errno or errno.EIO
        except ValueError:  # no room in the header for the key
            self.err = errno.EINVAL
        except Exception:  # never expected: the batch must end all the same
            logger.exception("NVMe tier: writing a chunk failed unexpectedly")
            self.err = errno.EIO
        else:
            # dir_rel is ns/<namespace id>/aa[/bb]: component 1 is the namespace's directory
            self.status = NEW_NAMESPACE if 0 <= created_at <= 1 else OK
        finally:
            self.release()

    @property
    def detail(self) -> tuple[int, int] | None:
        return None if self.status == OK else (self.status, self.err)

    def cancel(self) -> None:
        """End as FAILED with ``ECANCELED``, before it ran."""
        self.release()
        self.err = errno.ECANCELED

    def release(self) -> None:
        """Let go of the payload (run, or cancelled before it ran)."""
        _release(self.payload)

    def _publish(self, task_size: int) -> int:
        """Write, sync and rename; the first component of ``dir_rel`` made (-1: none)."""
        created_at = -1
        # O_PATH: a descriptor only to name entries by; fsync needs a real one
        flags = (os.O_RDONLY if self.fsync_level >= 2 else _O_PATH) | os.O_DIRECTORY
        try:
            dir_fd = open_at(self.root_fd, self.dir_rel, flags)
        except FileNotFoundError:
            dir_fd, created_at = make_dirs_at(self.root_fd, self.dir_rel, self.dir_mode)
        try:
            fd = self._create(dir_fd)
            try:
                try:
                    header = fmt.encode_raw_header(
                        self.key, self.namespace, self.meta, len(self.payload),
                        fmt.payload_checksum(self.payload), time.time_ns(), self.gpu_checksum)
                    write_chunk(fd, header, self.payload, self.direct, task_size)
                    if self.fsync_level >= 1:
                        os.fdatasync(fd)
                finally:
                    os.close(fd)
                os.rename(self.tmp_name, self.final_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                _remove(self.tmp_name, dir_fd)
                raise
            if self.fsync_level >= 2:
                os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return created_at

    def _create(self, dir_fd: int) -> int:
        flags = os.O_WRONLY | (_O_DIRECT if self.direct else 0)
        try:
            try:
                return create_in(dir_fd, self.tmp_name, self.mode, flags)
            except FileExistsError:  # left by a dead writer that had this name
                _remove(self.tmp_name, dir_fd)
                return create_in(dir_fd, self.tmp_name, self.mode, flags)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # O_DIRECT refused after the file was made
                _remove(self.tmp_name, dir_fd)
            raise


def unlink_at(root_fd: int, rel: str) -> int:
    """Remove the file ``rel`` beneath the root, following no link; 0 or an errno."""
    directory, _, name = rel.rpartition("/")
    try:
        if not directory:
            os.unlink(rel, dir_fd=root_fd)
            return 0
        dir_fd = open_at(root_fd, directory, _O_PATH | os.O_DIRECTORY)
        try:
            os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        return exc.errno or errno.EIO
    except ValueError:  # a NUL in the path
        return errno.EINVAL
    return 0


def _remove(name: str, dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _release(view: memoryview) -> None:
    """Let go of a view now (one still exported is left to the garbage collector)."""
    with contextlib.suppress(BufferError):
        view.release()


# -- batches into chunks, checked as the compiled engine checks them ---------------------------


def shard_dir(prefix: str, levels: int, digest: str) -> str:
    """A chunk's shard directory as ``RootLayout`` names it (``csrc`` ``put_shard_dir``)."""
    return prefix + digest[0:2] + ("/" + digest[2:4] if levels == 2 else "")


def _checked(share: object, n: int, kind: str, length: int, at: int
             ) -> tuple[str, str, int, list[str]]:
    """The checks of a share common to reads and writes (its length, naming, and the
    digests, buffers and keys columns from ``at``); ``(what, prefix, levels, suffixes)``."""
    what = f"{kind} share {n}"
    if not isinstance(share, tuple) or len(share) != length:
        raise TypeError(f"{what} is not a tuple of {length}")
    naming, fields = share[1], 3 if kind == "read" else 4
    if not isinstance(naming, tuple) or len(naming) != fields or \
            not all(isinstance(naming[i], str) for i in range(fields) if i != 1):
        raise TypeError(f"{what}'s naming is (shard_prefix, shard_levels, final_suffix"
                        f"{', temp_suffix' if fields == 4 else ''})")
    prefix, levels, *suffixes = naming
    if levels not in (1, 2):
        raise ValueError(f"shard_levels must be 1 or 2, not {levels}")
    if any("\0" in text for text in (prefix, *suffixes)):
        raise ValueError(f"{what}'s naming holds a NUL character")
    columns = [c for c in share[at : at + 3] if isinstance(c, list)]
    if len(columns) != 3 or len({len(c) for c in columns}) != 1:
        raise TypeError(f"{what}'s digests, buffers and keys must be lists of one length")
    if not all(isinstance(key, bytes) for key in columns[2]):
        raise TypeError(f"{what}'s keys must be bytes")
    for digest in columns[0]:
        if not isinstance(digest, str):
            raise TypeError(f"a digest must be str, not {type(digest).__name__}")
        if len(digest) < 2 * levels or not _HEX.fullmatch(digest):
            raise ValueError(f"digest {digest!r} is not lowercase hex of {2 * levels} "
                             "characters or more")
    return what, prefix, levels, suffixes


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


def shares_to_reads(shares: Sequence[ReadShare]) -> list[ShareRead]:
    """The chunks of a read batch; ``TypeError``, ``ValueError`` or ``BufferError`` for a
    malformed share (then no buffer is kept)."""
    reads: list[ShareRead] = []
    try:
        for n, share in enumerate(shares):
            what, prefix, levels, (suffix,) = _checked(share, n, "read", 8, 5)
            root_fd, _, direct, payload_len, meta, digests, dests, keys = share
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
    except BaseException:
        for read in reads:
            read.release()
        raise
    return reads


def shares_to_writes(shares: Sequence[WriteShare]) -> list[ShareWrite]:
    """The chunks of a write batch; ``TypeError`` or ``ValueError`` for a malformed share
    (then no buffer is kept)."""
    writes: list[ShareWrite] = []
    try:
        for n, share in enumerate(shares):
            what, prefix, levels, (final_suffix, temp_suffix) = _checked(share, n, "write", 13, 9)
            (root_fd, _, namespace, meta, direct, mode, dir_mode, fsync_level, victims,
             digests, payloads, keys, gpu) = share
            if not digests:  # its victims would be left
                raise ValueError(f"{what} has no chunks")
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
