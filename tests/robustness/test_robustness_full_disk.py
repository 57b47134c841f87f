"""A store started on a full filesystem (no free block, or no free inode): it opens, serves
what it holds, drops writes with a counted reason and one log line, and resumes writing
once space frees.  ``verify`` and ``inspect`` run there and write nothing."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from support.chunks import NS, payload_for, put, read
from support.hostile import run_cli, snapshot
from support.mounts import fill_bytes, fill_inodes, tmpfs
from support.stores import StoreFactory

pytestmark = pytest.mark.timeout(120)

SIZE = 256 * 1024 + 5
KEYS = [f"old-{i}" for i in range(3)]


@pytest.mark.parametrize("full_of", ["bytes", "inodes"])
def test_store_starts_on_a_full_filesystem_serves_and_resumes_writes(
        tmp_path: Path, full_of: str, open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    with tmpfs(tmp_path / "mnt", "4m" if full_of == "bytes" else "64m",
               inodes=None if full_of == "bytes" else 64) as mnt:
        root = mnt / "cache"
        store = open_store(root)
        for key in KEYS:
            put(store, key, SIZE)
        assert store.flush(10)
        store.close()
        fillers = [fill_bytes(mnt)] if full_of == "bytes" else fill_inodes(mnt / "fill")
        st = os.statvfs(mnt)
        assert (st.f_bavail if full_of == "bytes" else st.f_favail) == 0

        # the tools run on the full filesystem and write nothing
        before = snapshot(root)
        for command in ("verify", "inspect"):
            status, out, err = run_cli(command, root)
            assert status == 0, (command, out, err)
        assert snapshot(root) == before

        package_log.clear()
        package_log.set_level(logging.INFO, logger="lmcache_nvme_backend")
        store = open_store(root)
        assert store.healthy()
        for key in KEYS:  # pinned, as LMCache pins what it is about to retrieve
            assert store.lookup(key, NS, pin=True)
            assert read(store, key, SIZE) == payload_for(key, SIZE)
        for i in range(3):
            put(store, f"new-{i}", SIZE)
            assert store.flush(10)
        assert not any(store.contains(f"new-{i}") for i in range(3))
        assert store.counter("capacity_drops") == 3
        assert store.counter("write_failures") == 0
        full_lines = {id(r): r for r in package_log.records if "is full" in r.getMessage()}
        assert len(full_lines) == 1, [r.getMessage() for r in full_lines.values()]
        assert all(info.healthy for info in store.describe_roots())

        for p in fillers:  # space frees
            p.unlink()
        put(store, "after", SIZE)
        assert store.flush(10)
        assert read(store, "after", SIZE) == payload_for("after", SIZE)
        for key in KEYS:
            assert read(store, key, SIZE) == payload_for(key, SIZE)
        assert any("writes resume" in r.getMessage() for r in package_log.records)
        store.close()
        shutil.rmtree(root)


def test_a_filesystem_that_fills_again_soon_after_is_one_full_episode(
        tmp_path: Path, open_store: StoreFactory,
        package_log: pytest.LogCaptureFixture) -> None:
    """Space freed and taken again at once (as evictions race other writers on a shared
    directory) is one episode: one "is full" line and one "writes resume", not one each
    per dropped write."""
    package_log.set_level(logging.INFO, logger="lmcache_nvme_backend")
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        store = open_store(mnt / "cache")
        for i in range(3):
            filler = fill_bytes(mnt)
            put(store, f"dropped-{i}", SIZE)
            assert store.flush(10)
            filler.unlink()
            put(store, f"stored-{i}", SIZE)
            assert store.flush(10)
            assert store.lookup(f"stored-{i}", NS, pin=True)  # never a victim
        assert store.counter("capacity_drops") == 3
        assert not any(store.contains(f"dropped-{i}") for i in range(3))
        messages = [r.getMessage() for r in {id(r): r for r in package_log.records}.values()]
        assert sum("is full" in m for m in messages) == 1, messages
        assert sum("writes resume" in m for m in messages) == 1, messages
        store.close()
