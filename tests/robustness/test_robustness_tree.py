"""Hostile trees: crafted metadata, special files and links planted at the names the store
uses, damaged manifests, umask 000, leftovers of killed writers, and the edges of the store's
life (a zero-byte chunk and flush, a read after close).  Each test is one class of finding
of docs/robustness.md ("Hostile trees"): nothing raises, nothing blocks, nothing outside the
cache root changes, and what is intact keeps serving."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from support.chunks import NS, meta_for, payload_for, put, read
from support.hostile import (
    CRAFTED_METAS,
    chunk_path,
    fifo_guard,
    finishes,
    plant_crafted_chunk,
    run_cli,
    snapshot,
)
from support.io_faults import before_each_write
from support.stores import StoreFactory

from lmcache_nvme_backend.disk.layout import key_digest, namespace_id, this_host
from lmcache_nvme_backend.disk.manifest import MANIFEST_NAME
from lmcache_nvme_backend.store import roots as roots_mod

pytestmark = pytest.mark.timeout(60)

SIZE = 8192 + 77


def _stored(open_store: StoreFactory, root: Path, keys: list[str], **params: object) -> None:
    store = open_store(root, **params)
    for key in keys:
        put(store, key, SIZE)
    assert store.flush(10)
    store.close()


# -- header metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CRAFTED_METAS)
def test_crafted_metadata_is_a_quarantined_miss_never_an_exception(
        tmp_path: Path, case: str, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    _stored(open_store, root, ["intact"])
    bad = plant_crafted_chunk(root, "crafted", CRAFTED_METAS[case], bytes(4096))
    store = open_store(root)
    assert store.lookup("crafted", NS)  # indexed from the directory listing
    assert store.tensor_meta("crafted") is None  # judged on first touch
    assert read(store, "crafted", 4096) is None
    assert not store.lookup("crafted", NS)
    assert store.counter("invalid_files") == 1 and store.counter("quarantined_files") == 1
    assert not bad.exists()
    assert read(store, "intact", SIZE) == payload_for("intact", SIZE)
    # the same file indexed by a shared-mode member (from the listing): judged on read
    plant_crafted_chunk(root, "crafted-2", CRAFTED_METAS[case], bytes(4096))
    shared = open_store(tmp_path / "cache", shared=True)
    assert shared.tensor_meta("crafted-2") is None
    assert read(shared, "crafted-2", 4096) is None
    assert not shared.lookup("crafted-2", NS)
    # verify reports it as bad instead of crashing
    plant_crafted_chunk(root, "crafted-3", CRAFTED_METAS[case], bytes(4096))
    status, out, err = run_cli("verify", root)
    assert status == 1 and "BAD" in out and "Traceback" not in err


# -- special files at chunk paths ----------------------------------------------------------------


def test_a_fifo_at_a_chunk_path_never_blocks_a_read(tmp_path: Path,
                                                    open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    store = open_store(root)
    put(store, "fifo", SIZE)
    put(store, "header-only", SIZE)
    assert store.flush(10)
    fifos = [chunk_path(root, "fifo"), chunk_path(root, "header-only")]
    for p in fifos:
        p.unlink()
        os.mkfifo(p)
    with fifo_guard(fifos):
        done, result = finishes(lambda: read(store, "fifo", SIZE), 10)
        assert done, "a read of a FIFO blocked"
        assert result is None
        reopened = open_store(root)  # recovered without metadata: the header is read first
        done, result = finishes(lambda: reopened.tensor_meta("header-only"), 10)
        assert done and result is None
    assert store.counter("special_files") == 1 and not store.contains("fifo")
    assert all(info.healthy for info in store.describe_roots())


def test_links_directories_and_fifos_at_chunk_paths_are_misses_not_drive_errors(
        tmp_path: Path, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target.kv").write_bytes(b"x" * 8192)
    store = open_store(root)
    keys = ["link", "dir", "fifo", "intact"]
    for key in keys:
        put(store, key, SIZE)
    assert store.flush(10)
    planted = [chunk_path(root, k) for k in keys[:3]]
    for p in planted:
        p.unlink()
    os.symlink(outside / "target.kv", planted[0])
    planted[1].mkdir()
    os.mkfifo(planted[2])
    before = snapshot(outside)
    with fifo_guard(planted[2:]):
        for key in keys[:3]:
            assert read(store, key, SIZE) is None
    # three in a row (ROOT_ERROR_LIMIT) would have taken the path out of service
    assert roots_mod.ROOT_ERROR_LIMIT <= 3
    assert all(info.healthy for info in store.describe_roots())
    assert store.counter("special_files") == 3
    assert not any(store.contains(k) for k in keys[:3])
    assert read(store, "intact", SIZE) == payload_for("intact", SIZE)
    put(store, "after", SIZE)
    assert store.flush(10) and read(store, "after", SIZE) == payload_for("after", SIZE)
    assert snapshot(outside) == before
    # verify reports what it skipped (exit 1), never reads or follows it
    with fifo_guard(planted[2:]):
        status, out, err = run_cli("verify", root)
    assert status == 1, out + err
    assert out.count("SKIPPED") == 3 and "symbolic link" in out and "FIFO" in out
    status, out, _ = run_cli("inspect", root)
    assert status == 0 and out.count("skipped ") == 3


# -- the manifest is advice -------------------------------------------------------------------


DAMAGED_MANIFESTS = {
    "list": "[]", "null": "null", "number": "42", "string": '"manifest"',
    "non-finite": '{"version": 1, "metas": [], "entries": [["%s", "%s", NaN, Infinity, -1]]}',
    "rows-of-junk": '{"version": 1, "metas": [7, null, {"shapes": 1}], "entries": '
                    '[1, null, [], ["x"], [1,2,3,4,5], ["%s", "%s", -5, "t", 9]]}',
    "deep": "[" * 100_000 + "]" * 100_000,
    "huge-number": '{"version": 1, "metas": [], "entries": [["%s", "%s", 1' + "0" * 5000
                   + ', 1, -1]]}',
}


@pytest.mark.parametrize("case", DAMAGED_MANIFESTS)
def test_a_damaged_manifest_never_stops_the_store_or_the_tools(
        tmp_path: Path, case: str, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    keys = [f"k{i}" for i in range(3)]
    _stored(open_store, root, keys)
    text = DAMAGED_MANIFESTS[case]
    if "%s" in text:
        store = open_store(root)
        entry = store.entry("k0")
        assert entry is not None
        text = text % (entry.digest, entry.ns_id)
    (root / "index" / MANIFEST_NAME).write_text(text)
    store = open_store(root)
    for key in keys:
        assert read(store, key, SIZE) == payload_for(key, SIZE)
    for command in ("inspect", "verify"):
        status, out, err = run_cli(command, root)
        assert status == 0 and "Traceback" not in err, (command, out, err)


def test_a_manifest_that_understates_sizes_is_not_trusted(tmp_path: Path,
                                                          open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    keys = [f"k{i}" for i in range(20)]
    _stored(open_store, root, keys)
    path = root / "index" / MANIFEST_NAME
    doc = json.loads(path.read_text())
    for row in doc["entries"]:
        row[2] = 1  # each chunk claims one byte
    path.write_text(json.dumps(doc))
    file_size = chunk_path(root, "k0").stat().st_size
    budget = 5 * file_size
    store = open_store(root, max_size_gb=budget / 2**30)
    assert store.usage()["used_bytes"] <= budget
    on_disk = sum(p.stat().st_size for p in (root / "ns").rglob("*.kv"))
    assert on_disk <= budget, f"{on_disk} bytes on disk for a budget of {budget}"
    assert store.usage()["entries"] == 5


# -- links planted for writes ---------------------------------------------------------------------


PLANTS = ["manifest-temp", "namespace-marker", "root-marker", "shard-dir", "namespace-dir",
          "quarantine-dir", "index-dir"]


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_links_are_never_followed(tmp_path: Path, plant: str,
                                          open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    _stored(open_store, root, ["old"])
    marker = (root / "LMCNVME").read_bytes()  # put back as it was (it says the layout)
    new_ns_dir = root / "ns" / namespace_id("other-model")
    shard = root / "ns" / namespace_id(NS) / key_digest("fresh")[:2]  # the first level
    (root / "LMCNVME").unlink()
    marker_link = root / "LMCNVME"
    links = {
        "manifest-temp": (root / "index" / f".{MANIFEST_NAME}.tmp-{this_host()}-{os.getpid()}",
                          victim),
        "namespace-marker": (new_ns_dir / "NAMESPACE", outside / "created-by-namespace"),
        "root-marker": (marker_link, outside / "created-by-marker"),
        "shard-dir": (shard, outside),
        "namespace-dir": (new_ns_dir, outside),
        "quarantine-dir": (root / "quarantine", outside),
        "index-dir": (root / "index", outside),
    }
    link, target = links[plant]
    if plant == "namespace-marker":
        new_ns_dir.mkdir(parents=True)
    if link.is_dir() and not link.is_symlink():
        for p in sorted(link.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        link.rmdir()
    os.symlink(target, link)
    if plant == "manifest-temp":  # the name earlier versions used, too
        os.symlink(victim, root / "index" / f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    if plant != "root-marker" and not marker_link.exists():
        (root / "LMCNVME").write_bytes(marker)
    before = snapshot(outside)
    old_umask = os.umask(0)
    try:
        store = open_store(root, manifest_interval_s=0)
        put(store, "fresh", SIZE)
        store.submit("fresh-2", "other-model", meta_for(SIZE),
                     memoryview(payload_for("fresh-2", SIZE)), release=lambda: None)
        assert store.flush(10)
        # a bad file goes to quarantine (or is deleted), never outside
        bad = chunk_path(root, "old")
        bad.write_bytes(b"\0" * bad.stat().st_size)
        assert read(store, "old", SIZE) is None
        store.close()
    finally:
        os.umask(old_umask)
    assert snapshot(outside) == before, "something outside the cache root changed"
    assert victim.read_bytes() == b"precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    status, out, err = run_cli("verify", root, "--quarantine")
    assert "Traceback" not in err
    status, out, err = run_cli("gc", root, "--max-size-gb", "0", "--temp", "--purge-quarantine")
    # a linked marker is not a marker: the tools refuse the directory, naming the marker
    assert status == (1 if plant == "root-marker" else 0) and "Traceback" not in err
    assert snapshot(outside) == before, "a tool changed something outside the cache root"


def test_a_planted_probe_name_does_not_stop_the_start(tmp_path: Path,
                                                      open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    for name in (f".odirect-probe-{os.getpid()}-{threading.get_ident()}",):
        os.symlink(tmp_path / "nowhere", root / name)
    store = open_store(root)
    put(store, "a", SIZE)
    assert store.flush(10) and read(store, "a", SIZE) == payload_for("a", SIZE)
    assert not (tmp_path / "nowhere").exists()


# -- modes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("file_mode", [None, 0o640])
def test_directory_and_marker_modes_follow_file_mode_whatever_the_umask(
        tmp_path: Path, file_mode: int | None, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    old_umask = os.umask(0)
    try:
        store = open_store(root, file_mode=None if file_mode is None else oct(file_mode))
        put(store, "a", SIZE)
        assert store.flush(10)
        store.close()
    finally:
        os.umask(old_umask)
    fmode = 0o600 if file_mode is None else file_mode
    dmode = 0o700 if file_mode is None else 0o750
    for p in [root, *root.rglob("*")]:
        want = dmode if p.is_dir() else fmode
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


# -- leftovers and edges ------------------------------------------------------------------------


def _dead_pid() -> int:
    pid = 2**22 - 7
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_manifest_temp_files_of_dead_writers_are_removed_at_start(
        tmp_path: Path, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    _stored(open_store, root, ["a"])
    dead = _dead_pid()
    index = root / "index"
    stale = [index / f".{MANIFEST_NAME}.tmp-{dead}",  # earlier versions' name
             index / f".{MANIFEST_NAME}.tmp-{this_host()}-{dead}"]
    live = index / f".{MANIFEST_NAME}.tmp-{this_host()}-{os.getppid()}"
    for p in [*stale, live]:
        p.write_text("{}")
    store = open_store(root)
    assert not any(p.exists() for p in stale)
    assert live.exists()
    assert store.counter("removed_temp_files") == 2
    assert read(store, "a", SIZE) == payload_for("a", SIZE)


def test_a_short_file_another_member_published_is_a_quarantined_miss(
        tmp_path: Path, open_store: StoreFactory) -> None:
    root = tmp_path / "cache"
    writer = open_store(root, shared=True)
    reader = open_store(root, shared=True)
    put(writer, "short", SIZE)
    assert writer.flush(10)
    path = chunk_path(root, "short")
    with open(path, "r+b") as f:
        f.truncate(100)  # shorter than a header
    reader.refresh_shared()  # the writer's journal: the chunk is indexed here now
    assert reader.lookup("short", NS)
    assert read(reader, "short", SIZE) is None
    assert not reader.lookup("short", NS)
    assert not path.exists()
    assert reader.counter("invalid_files") == 1 and reader.counter("quarantined_files") == 1


def test_flush_waits_for_a_zero_byte_chunk(tmp_path: Path, open_store: StoreFactory) -> None:
    store = open_store(tmp_path / "cache")
    calls: list[int] = []

    def slow_write() -> None:
        calls.append(1)
        time.sleep(0.3)

    before_each_write(store, slow_write)
    put(store, "empty", 0)
    assert store.flush(10)
    assert calls == [1], "the write the flush waited for went through the slowed path"
    assert store.contains("empty")
    assert read(store, "empty", 0) == b""


def test_a_read_after_close_is_a_miss(tmp_path: Path, open_store: StoreFactory) -> None:
    store = open_store(tmp_path / "cache")
    put(store, "a", SIZE)
    put(store, "b", SIZE)
    assert store.flush(10)
    store.close()
    assert read(store, "a", SIZE) is None
    assert store.read_into([]) == []
