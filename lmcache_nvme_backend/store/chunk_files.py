"""Writing one chunk file through the Python engine (the native engine does the same steps
in C for a whole batch, ``io/csrc/chunkio.c``).

The chunk is written under this thread's temp name and renamed into place.  Create,
rename and (``fsync: full``) directory sync all go through one descriptor of the shard
directory, opened beneath the root without following a link; it is opened afresh for
every chunk, so a directory replaced meanwhile is never written through.  The temp file
is removed if anything fails.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from ..config import NVMeSettings
from ..disk.format import combine_block_digests, encode_header
from ..disk.layout import CHUNK_SUFFIX, temp_name
from ..disk.safe_fs import open_dir_beneath, open_dirs_beneath
from ..io.posix import PosixIOEngine, create_in_dir
from .roots import RootState, write_namespace_file
from .writeback import ChunkWrite

#: The checksum the GPU read path checks, for a chunk (None: not recorded).
GpuChecksum = Callable[[ChunkWrite], tuple[int, int]]


def write_chunk_file(root: RootState, job: ChunkWrite, engine: PosixIOEngine,
                     settings: NVMeSettings, gpu_checksum: GpuChecksum | None) -> None:
    """Write ``job`` as its chunk file on ``root`` and publish it by rename; raises OSError."""
    name = job.digest + CHUNK_SUFFIX
    dir_fd = _open_shard_dir(root, job, root.layout.shard_rel(job.ns_id, job.digest), settings)
    tmp = temp_name(name)
    try:
        try:
            _write_temp(dir_fd, tmp, root, job, engine, settings, gpu_checksum)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if settings.fsync == "full":
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _open_shard_dir(root: RootState, job: ChunkWrite, rel: str, settings: NVMeSettings) -> int:
    """A descriptor of the chunk's shard directory, created (and the namespace's name
    file with it) when it does not exist yet."""
    try:
        return open_dir_beneath(root.layout.root, rel)
    except FileNotFoundError:
        pass
    dir_fd = open_dirs_beneath(root.layout.root, rel, settings.dir_mode)
    try:
        write_namespace_file(root.layout, job.ns_id, job.namespace, settings.file_mode)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _write_temp(dir_fd: int, tmp: str, root: RootState, job: ChunkWrite,
                engine: PosixIOEngine, settings: NVMeSettings,
                gpu_checksum: GpuChecksum | None) -> None:
    """Write the temp file: payload hashed while it is written, header (v2) last."""
    def header_for(digests: list[int]) -> bytes:
        return encode_header(job.key, job.namespace, job.meta, job.nbytes,
                             combine_block_digests(digests),
                             gpu_checksum=None if gpu_checksum is None else gpu_checksum(job))

    try:
        fd = create_in_dir(dir_fd, tmp, root.direct, settings.file_mode)
    except FileExistsError:
        # Left by a dead writer that had this thread's host, pid and thread id.
        os.unlink(tmp, dir_fd=dir_fd)
        fd = create_in_dir(dir_fd, tmp, root.direct, settings.file_mode)
    try:
        engine.write_hashed_to(fd, job.payload, header_for, direct=root.direct,
                               sync_data=settings.fsync != "none")
    finally:
        os.close(fd)
