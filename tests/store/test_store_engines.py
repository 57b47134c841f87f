"""Which I/O engine a store runs (``nvme.native_io``), how it says so, and that the Python
engine still serves everything when the native one is not built."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.chunks import NS, meta_for, payload_for, put, read
from support.stores import StoreFactory

from lmcache_nvme_backend.config import NVMeConfigError
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.store.chunk_store import ChunkRead
from lmcache_nvme_backend.store.stats import ReadPath, path_counter, read_latency


def test_the_store_names_its_engine(open_store: StoreFactory, native_io: str) -> None:
    store = open_store()
    if native_io == "on":
        assert store.engine.name == "native"
        assert store.io_engine_name == f"native ({native.simd()} checksums)"
    else:
        assert store.engine.name == "python"
        assert store.io_engine_name == "python (nvme.native_io: off)"


def test_native_io_on_refuses_to_start_without_the_extension(
        open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_native", None)
    with pytest.raises(NVMeConfigError, match="nvme.native_io: on, but the native I/O "
                                              "extension is not built"):
        open_store(native_io="on")
    store = open_store(native_io="auto")  # auto: the Python engine, and the reason why
    assert store.engine.name == "python"
    assert store.io_engine_name.startswith("python, slower: the native I/O extension is not "
                                           "built")
    put(store, "a")
    assert store.flush(10)
    assert read(store, "a") == payload_for("a")


def test_without_the_extension_a_process_serves_through_the_python_engine(
        tmp_path: Path) -> None:
    """As on a machine that had no C compiler at install: the module cannot be imported."""
    script = f"""
import sys
sys.modules["lmcache_nvme_backend.io._native"] = None  # what a failed build leaves
from support.chunks import put, read, payload_for
from support.stores import open_store
store = open_store({str(tmp_path / "cache")!r})
put(store, "a")
assert store.flush(10)
assert read(store, "a") == payload_for("a")
print(store.io_engine_name)
store.close()
import ctypes
from lmcache_nvme_backend.adapters.memory_objects import memory_at
buf = bytearray(b"host memory")  # the adapters' views of memory objects: through ctypes
assert bytes(memory_at(ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)),
                       len(buf))) == b"host memory"
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120, check=True)
    assert out.stdout.strip().startswith("python, slower: the native I/O extension is not "
                                         "built")


def test_a_batch_of_mixed_outcomes_is_judged_chunk_by_chunk(open_store: StoreFactory,
                                                            tmp_path: Path) -> None:
    """Served, missing, damaged and wrong-length chunks in one read call."""
    store = open_store(task_size_mb=0.25)  # several pieces per chunk
    sizes = {"ok": 1 << 20, "gone": 8192, "bad": 3 << 20, "short": 100_000}
    for key, size in sizes.items():
        put(store, key, size)
    assert store.flush(10)
    store.chunk_path("gone", NS).unlink()
    with open(store.chunk_path("bad", NS), "r+b") as f:
        f.seek(4096 + (2 << 20) + 5)
        f.write(b"\xff")
    dests = {key: memoryview(bytearray(size + 4096)) for key, size in sizes.items()}
    reads = [ChunkRead(key, dests[key]) for key in sizes]
    reads.append(ChunkRead("short", memoryview(bytearray(4096))))  # buffer too small
    assert store.read_into(reads) == [True, False, False, True, False]
    assert bytes(dests["ok"][: sizes["ok"]]) == payload_for("ok", sizes["ok"])
    assert bytes(dests["short"][: sizes["short"]]) == payload_for("short", sizes["short"])
    assert store.counter("checksum_failures") == 1
    assert store.counter("quarantined_files") == 1
    assert not store.contains("gone") and not store.contains("bad")
    assert store.counter("read_chunks") == 2
    # one read call: its served and failed chunks, bytes and latency counted once each
    served_bytes = sizes["ok"] + sizes["short"]
    assert store.counter("read_bytes") == served_bytes
    assert store.counter("read_failures") == 3
    assert store.counter(path_counter(ReadPath.POSIX, "chunks")) == 2
    assert store.counter(path_counter(ReadPath.POSIX, "bytes")) == served_bytes
    assert store.histograms()[read_latency(ReadPath.POSIX)].count == 1


def test_a_call_of_one_layout_is_one_share_and_each_chunk_judged_at_its_place(
        open_store: StoreFactory, native_io: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The common call (every chunk indexed in one namespace and layout on one root) goes to
    the engine as one share: a vanished, a damaged and a planted file among served
    chunks are each judged at their own place in the call."""
    store = open_store(task_size_mb=0.25)
    size = 600_000
    meta = meta_for(size)  # one object, as the adapters keep one per layout
    keys = ["ok0", "gone", "bad", "ok1", "other"]
    for key in keys:
        store.submit(key, NS, meta, memoryview(payload_for(key, size)), release=lambda: None)
    assert store.flush(10)
    store.chunk_path("gone", NS).unlink()
    with open(store.chunk_path("bad", NS), "r+b") as f:
        f.seek(4096 + 300_000)
        f.write(b"\xff")
    shutil.copyfile(store.chunk_path("ok0", NS), store.chunk_path("other", NS))
    shares: list[int] = []
    real = store.engine.read
    monkeypatch.setattr(store.engine, "read",
                        lambda batch: (shares.extend(len(s[5]) for s in batch), real(batch))[1])
    dests = [memoryview(bytearray(size)) for _ in keys]
    assert store.read_into([ChunkRead(k, d) for k, d in zip(keys, dests, strict=True)]) == \
        [True, False, False, True, False]
    assert shares == [5]
    assert bytes(dests[0]) == payload_for("ok0", size)
    assert bytes(dests[3]) == payload_for("ok1", size)
    assert store.counter("checksum_failures") == 1 and store.counter("quarantined_files") == 2
    assert store.counter("read_failures") == 3 and store.counter("read_bytes") == 2 * size
    assert [store.contains(k) for k in keys] == [True, False, False, True, False]

