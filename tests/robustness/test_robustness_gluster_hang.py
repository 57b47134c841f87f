"""A stopped GlusterFS brick (``SIGSTOP`` of ``glusterfsd``) never stalls the caller.

While the brick is stopped every client call that reaches it hangs until GlusterFS's own
``network.ping-timeout`` (42 s): the case ``nvme.io_deadline_s`` is for.  The stores run
with its default, ``auto``: a GlusterFS mount (``fuse.glusterfs``) is a network filesystem,
so its reads have the 5 s deadline, and a local path beside it has none.  The chunks are
written through one mount and read through the other, so that no client cache can answer
for the brick.  The brick is always resumed (``finally``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.chunks import NS, payload_for, put, read
from support.gluster import gluster_volume
from support.stores import open_store

from lmcache_nvme_backend.config import IO_DEADLINE_AUTO_S
from lmcache_nvme_backend.store.chunk_store import ChunkStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BOUND_S = 15.0  # well under the 42 s a client call hangs for
KEYS = [f"k{i}" for i in range(8)]


def _until(condition: Callable[[], bool], timeout_s: float = BOUND_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _store(*roots: Path) -> ChunkStore:
    """A store with the default ``nvme.io_deadline_s`` (auto)."""
    return open_store(*roots, close_timeout_s=2, direct_io="off")


def test_auto_gives_a_gluster_path_the_deadline_and_a_local_one_none(tmp_path: Path) -> None:
    with gluster_volume(tmp_path, mounts=1) as volume:
        store = _store(tmp_path / "local", volume.mounts[0] / "cache")
        try:
            local, gluster = store.describe_roots()
            assert gluster.filesystem == "fuse.glusterfs"
            assert (local.deadline_s, gluster.deadline_s) == (0.0, IO_DEADLINE_AUTO_S)
            assert store.stats_snapshot()["deadline_roots"] == 1
        finally:
            store.close()


def test_a_stopped_brick_is_a_miss_by_the_deadline_and_heals(tmp_path: Path) -> None:
    with gluster_volume(tmp_path, mounts=2) as volume:
        assert volume.brick_pid is not None
        writer = _store(volume.mounts[0] / "cache")
        for key in KEYS:
            put(writer, key)
        assert writer.flush(30)
        writer.close()
        reader = _store(volume.mounts[1] / "cache")  # nothing of it read through this mount
        closing = _store(volume.mounts[0] / "cache")
        try:
            with _stopped(volume.brick_pid):
                started = time.monotonic()
                assert read(reader, KEYS[0]) is None
                assert time.monotonic() - started < BOUND_S
                snap = reader.stats_snapshot()
                assert snap["deadline_misses"] == 1 and snap["roots_hung"] == 1
                started = time.monotonic()
                assert not reader.lookup(KEYS[1], NS)  # from memory
                assert read(reader, KEYS[1]) is None
                put(reader, "new")
                assert reader.flush(BOUND_S)
                assert reader.counter("write_failures") == 1  # no path in service
                assert time.monotonic() - started < BOUND_S
                started = time.monotonic()
                closing.close()  # saves its manifest on the stopped brick
                assert time.monotonic() - started <= closing.close_bound_s + BOUND_S
            assert _until(lambda: reader.stats_snapshot()["roots_hung"] == 0)
            assert reader.counter("late_reads_discarded") == 1
            for key in KEYS:
                assert read(reader, key) == payload_for(key)
            put(reader, "new")
            assert reader.flush(30) and read(reader, "new") == payload_for("new")
        finally:
            reader.close()
            closing.close()
