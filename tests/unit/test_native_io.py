"""io/native.py and its compiled engine (io/csrc): the same bytes, checks and file rules as
the Python engine, a batch per GIL round trip.

Files are written by one engine and read by the other, in both directions: the two must
agree byte for byte on the format.  Skipped (or failed under CI) where the extension was
not built.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash
from support.mounts import ext4_image
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.disk.format import (
    BLOCK_SIZE,
    HEADER_SIZE,
    FormatError,
    TensorMeta,
    decode_header,
    encode_header,
    padded_length,
    payload_checksum,
)
from lmcache_nvme_backend.disk.layout import (
    LEGACY_SHARD_LEVELS,
    SHARD_LEVELS,
    RootLayout,
    key_digest,
)
from lmcache_nvme_backend.disk.safe_fs import root_descriptor
from lmcache_nvme_backend.disk.validate import Defect, Expected, judge_chunk
from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.io.buffers import AlignedBuffer
from lmcache_nvme_backend.io.native import NativeEngine, ReadItem, WriteItem
from lmcache_nvme_backend.io.posix import PosixIOEngine

if not native.available():
    missing_prerequisite(native.unavailable_reason())

from lmcache_nvme_backend.io import _native  # type: ignore[attr-defined]  # noqa: E402

MIB = 1 << 20
SIZES = [0, 1, 4095, 4096, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 4097]
TASK_SIZES = [8192, BLOCK_SIZE + 4096, 64 * MIB]
REL = "ns/0123456789abcdef/ab/cd/chunk.kv"


def payload_for(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def meta_for(n: int) -> TensorMeta:
    return TensorMeta(shapes=((n,),), dtypes=("uint8",), fmt=1, nbytes=n)


def write_python(root: Path, payload: bytes, key: str = "k", version: int = 2,
                 direct: bool = True) -> Path:
    path = root / REL
    path.parent.mkdir(parents=True, exist_ok=True)
    header = encode_header(key, "ns", meta_for(len(payload)), len(payload),
                           payload_checksum(payload, version), version=version)
    PosixIOEngine(64 * MIB, None).write_chunk(  # type: ignore[arg-type]  # writes need no pool
        path, header, memoryview(payload), direct=direct, mode=0o600, sync_data=False)
    return path


def dest_for(n: int, kind: str) -> memoryview:
    if kind == "aligned":
        return AlignedBuffer(n + 4096).view[: padded_length(n)] if n else memoryview(bytearray())
    return memoryview(bytearray(n + 1))[1:]  # not 4 KiB aligned: staged


def item(root: Path, dest: memoryview, n: int, key: str = "k", direct: bool = True,
         rel: str = REL) -> ReadItem:
    return (root_descriptor(str(root)), rel, dest, n, direct, key.encode(), meta_for(n).to_json())


@pytest.fixture
def engine_for() -> Iterator[object]:
    made: list[NativeEngine] = []

    def make(task_size: int = 64 * MIB, threads: int = 3) -> NativeEngine:
        made.append(NativeEngine(threads, 2, task_size))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


# -- the checksum -------------------------------------------------------------------------


@pytest.mark.parametrize("simd", ["scalar", "sse2", "avx2"])
def test_xxh3_matches_the_xxhash_package_for_every_length(simd: str) -> None:
    in_use = native.simd()
    if not _native.select_simd(simd):
        pytest.skip(f"this CPU or build has no {simd} loop")
    try:
        data = random.Random(1).randbytes(3 * BLOCK_SIZE + 77)
        lengths = [*range(0, 2100), 4088, 65536, BLOCK_SIZE - 1, BLOCK_SIZE, len(data)]
        for n in lengths:
            assert _native.xxh3_64(data[:n]) == xxhash.xxh3_64_intdigest(data[:n]), n
    finally:
        _native.select_simd(in_use)


def test_gc_untrack_stops_tracking_each_object_and_ignores_the_rest() -> None:
    first, second, table = [1], ["x"], {"k": [2]}
    assert gc.is_tracked(first) and gc.is_tracked(table)
    native.gc_untrack(first, second, table, 7, "text", None)
    assert not gc.is_tracked(first) and not gc.is_tracked(second)
    assert not gc.is_tracked(table)
    native.gc_untrack(first)  # twice is fine
    native.gc_untrack()
    table["n"] = [3]  # an untracked dict is tracked again when a container goes in
    assert gc.is_tracked(table) and first == [1] and table["k"] == [2]


@pytest.mark.parametrize("gpu", [None, (7, 2**64 - 1)])
@pytest.mark.parametrize("key,namespace", [("k", "ns"), ("é" * 500, "model@salt"), ("x", "")])
def test_headers_are_byte_identical_to_the_python_encoder(
        key: str, namespace: str, gpu: tuple[int, int] | None) -> None:
    meta = meta_for(123)
    python = encode_header(key, namespace, meta, 123, 99, created_unix_ns=5, gpu_checksum=gpu)
    assert _native.encode_header(key.encode(), namespace.encode(), meta.to_json(), 123, 99, 5,
                                 gpu) == python


def test_a_key_too_long_for_the_header_is_refused_like_the_python_encoder() -> None:
    meta = meta_for(1)
    with pytest.raises(FormatError):
        encode_header("k" * 5000, "ns", meta, 1, 0)
    with pytest.raises(ValueError, match="do not fit"):
        _native.encode_header(b"k" * 5000, b"ns", meta.to_json(), 1, 0, 0, None)


# -- reads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("kind", ["aligned", "unaligned"])
@pytest.mark.parametrize("task_size", TASK_SIZES)
@pytest.mark.parametrize("n", SIZES)
def test_reads_what_the_python_engine_wrote_and_verifies_it(
        engine_for, tmp_path: Path, n: int, task_size: int, kind: str, direct: bool) -> None:
    payload = payload_for(n)
    write_python(tmp_path, payload, direct=direct)
    dest = dest_for(n, kind)
    statuses, details = engine_for(task_size).read([item(tmp_path, dest, n, direct=direct)])
    assert (statuses, details) == (bytes([seam.OK]), [])
    assert bytes(dest[:n]) == payload


def test_a_version_1_file_is_checked_over_the_whole_payload(engine_for, tmp_path: Path
                                                             ) -> None:
    payload = payload_for(3 * BLOCK_SIZE + 5)
    write_python(tmp_path, payload, version=1)
    dest = dest_for(len(payload), "aligned")
    statuses, _ = engine_for(BLOCK_SIZE).read([item(tmp_path, dest, len(payload))])
    assert statuses == bytes([seam.OK]) and bytes(dest[: len(payload)]) == payload


def damage(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("what,defect", [
    ("payload", Defect.CHECKSUM), ("header", Defect.NOT_A_CHUNK), ("key", Defect.WRONG_KEY)])
def test_what_it_cannot_verify_comes_back_for_the_python_validator(
        engine_for, tmp_path: Path, what: str, defect: Defect) -> None:
    n = BLOCK_SIZE + 100
    path = write_python(tmp_path, payload_for(n))
    if what == "payload":
        damage(path, HEADER_SIZE + BLOCK_SIZE + 7)
    elif what == "header":
        damage(path, 60)
    key = "another key" if what == "key" else "k"
    statuses, details = engine_for().read([item(tmp_path, dest_for(n, "aligned"), n, key=key)])
    assert statuses == bytes([seam.JUDGE])
    [(index, error, header, computed)] = details
    assert index == 0 and error == 0 and header == path.read_bytes()[:HEADER_SIZE]
    verdict = judge_chunk(header, Expected(key=key, payload_len=n, meta=meta_for(n)),
                          lambda h: h.payload_checksum == computed)
    assert verdict.defect is defect


def test_failures_come_back_with_their_errno(engine_for, tmp_path: Path) -> None:
    n = 8192
    path = write_python(tmp_path, payload_for(n))
    shard = path.parent
    (shard / "short.kv").write_bytes(path.read_bytes()[: HEADER_SIZE + 4096])
    os.symlink(path, shard / "link.kv")
    os.mkfifo(shard / "fifo.kv")
    (tmp_path / "outside.kv").write_bytes(path.read_bytes())
    names = ["missing.kv", "short.kv", "link.kv", "fifo.kv", "../../../../../outside.kv"]
    items = [item(tmp_path, dest_for(n, "aligned"), n, rel=str(Path(REL).parent / name))
             for name in names]
    statuses, details = engine_for().read(items)
    assert statuses == bytes([seam.FAILED] * len(names))
    errors = {names[i]: err for i, err, header, _ in details if header is None}
    assert errors == {"missing.kv": errno.ENOENT, "short.kv": errno.ENODATA,
                      "link.kv": errno.ELOOP, "fifo.kv": errno.EINVAL,
                      "../../../../../outside.kv": errno.EXDEV}


def test_a_destination_shorter_than_the_payload_is_refused(engine_for, tmp_path: Path
                                                           ) -> None:
    write_python(tmp_path, payload_for(8192))
    with pytest.raises(ValueError, match="holds 4096 bytes"):
        engine_for().read([item(tmp_path, dest_for(4096, "aligned"), 8192)])


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    (None, ("too", "short"), TypeError, r"a read item is \(root_fd, rel, dest.*item 1 is not"),
    (0, "3", TypeError, "integer"),
    (1, b"ns/rel", TypeError, "item field 1 must be str, not bytes"),
    (1, "ns/\0rel", ValueError, "item field 1 holds a NUL character"),
    (2, b"read-only", BufferError, "writable"),
    (3, -1, OverflowError, "negative"),
    (5, "k", TypeError, "item field 5 must be bytes, not str"),
], ids=["shape", "fd", "rel-type", "rel-nul", "dest", "length", "key"])
def test_a_malformed_read_item_is_refused_clearly_and_holds_no_buffer(
        engine_for, tmp_path: Path, field: int | None, value: object,
        error: type[Exception], message: str) -> None:
    write_python(tmp_path, payload_for(4096))
    good = bytearray(8192)
    broken = list(item(tmp_path, memoryview(bytearray(8192)), 4096))
    if field is not None:
        broken[field] = value
    with pytest.raises(error, match=message):
        engine_for().read([item(tmp_path, memoryview(good), 4096),
                           tuple(broken) if field is not None else value])  # type: ignore[list-item]
    good.extend(b"x")  # resizable again: the batch let go of the buffer it had taken


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    (None, (1, 2), TypeError, r"a write item is \(root_fd, dir_rel, .*item 0 is not"),
    (3, None, TypeError, "item field 3 must be str, not NoneType"),
    (4, 7, TypeError, "bytes-like"),
    (7, "{}", TypeError, "item field 7 must be bytes, not str"),
    (10, 1 << 40, OverflowError, "item field 10 does not fit a C int"),
    (13, ["victim"], TypeError, "victims must be a tuple, not list"),
    (8, (1,), TypeError, "gpu_checksum is None or"),
], ids=["shape", "final-name", "payload", "meta", "mode", "victims", "gpu"])
def test_a_malformed_write_item_is_refused_clearly_and_writes_nothing(
        engine_for, tmp_path: Path, field: int | None, value: object,
        error: type[Exception], message: str) -> None:
    view = memoryview(bytearray(payload_for(4096)))
    broken = list(write_item(tmp_path, view))
    if field is not None:
        broken[field] = value
    with pytest.raises(error, match=message):
        engine_for().submit_write([tuple(broken) if field is not None else value],  # type: ignore[list-item]
                                  lambda batch: None)
    del broken
    view.release()  # BufferError if the batch still held the payload
    assert not (tmp_path / "ns").exists()


def test_a_batch_costs_one_gil_release(engine_for, tmp_path: Path) -> None:
    items = []
    for i in range(8):
        rel = f"ns/0123456789abcdef/ab/cd/c{i}.kv"
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        write_python(tmp_path, payload_for(3 * BLOCK_SIZE)).rename(tmp_path / rel)
        items.append(item(tmp_path, dest_for(3 * BLOCK_SIZE, "aligned"), 3 * BLOCK_SIZE,
                          rel=rel))
    engine = engine_for(BLOCK_SIZE)  # 3 pieces per chunk, 24 in the batch
    before = native.counters()
    statuses, _ = engine.read(items)
    after = native.counters()
    assert statuses == bytes([seam.OK] * 8)
    assert after["gil_releases"] - before["gil_releases"] == 1
    assert after["hashed_bytes"] - before["hashed_bytes"] >= 8 * 3 * BLOCK_SIZE


def test_the_checksum_time_is_sampled_and_scaled_to_every_byte_hashed(
        engine_for, tmp_path: Path) -> None:
    items = []
    for i in range(16):
        rel = f"ns/0123456789abcdef/ab/cd/c{i}.kv"
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        write_python(tmp_path, payload_for(BLOCK_SIZE)).rename(tmp_path / rel)
        items.append(item(tmp_path, dest_for(BLOCK_SIZE, "aligned"), BLOCK_SIZE, rel=rel))
    # 16 hash calls on at most two threads (the worker, and the caller, which may take
    # pieces of a blocking read), each timing one call in eight from where its count stands
    engine = engine_for(threads=1)
    before = native.counters()
    statuses, _ = engine.read(items)
    after = native.counters()
    assert statuses == bytes([seam.OK] * 16)
    hashed = after["hashed_bytes"] - before["hashed_bytes"]
    sampled = after["hash_sampled_bytes"] - before["hash_sampled_bytes"]
    assert hashed == 16 * BLOCK_SIZE
    assert sampled in (BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE)
    timed = after["hash_sampled_ns"] - before["hash_sampled_ns"]
    assert timed > 0
    assert native.hash_cpu_ns(before, after) == pytest.approx(timed * hashed / sampled)
    assert native.hash_cpu_ns(after, after) == 0.0


class Done:
    """Collects the batches an engine hands back, by name."""

    def __init__(self) -> None:
        self.batches: dict[object, seam.Batch] = {}
        self.cond = threading.Condition()

    def __call__(self, name: object) -> Callable[[seam.Batch], None]:
        def on_done(batch: seam.Batch) -> None:
            assert threading.current_thread().name == "nvme-io-done"
            with self.cond:
                self.batches[name] = batch
                self.cond.notify_all()
        return on_done

    def wait_for(self, count: int) -> dict[object, seam.Batch]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= count, timeout=30)
            return self.batches


def write_now(engine: NativeEngine, items: list[WriteItem]) -> seam.Batch:
    done = Done()
    engine.submit_write(items, done("write"))
    return done.wait_for(1)["write"]


def test_asynchronous_batches_come_back_on_the_completion_thread(engine_for, tmp_path: Path
                                                                 ) -> None:
    n = 4096
    payload = payload_for(n)
    write_python(tmp_path, payload)
    engine = engine_for()
    dests = [dest_for(n, "aligned") for _ in range(5)]
    done = Done()
    for i, dest in enumerate(dests):
        engine.submit_read([item(tmp_path, dest, n)], done(i))
    engine.submit_read([], done("empty"))
    got = {name: batch.statuses for name, batch in done.wait_for(6).items()}
    assert got == {**{i: bytes([seam.OK]) for i in range(5)}, "empty": b""}
    assert all(bytes(d[:n]) == payload for d in dests)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.read([])


def test_close_finishes_queued_writes_and_cancel_ends_the_rest(engine_for, tmp_path: Path
                                                               ) -> None:
    engine = engine_for()
    done = Done()
    payload = memoryview(payload_for(BLOCK_SIZE))
    for i in range(20):
        engine.submit_write([write_item(tmp_path, payload, name=f"c{i}.kv")], done(i))
    cancelled = engine.cancel_writes()
    engine.close()  # what was not cancelled finishes first
    batches = done.wait_for(20)
    statuses = [batches[i].statuses for i in range(20)]
    assert statuses.count(bytes([seam.FAILED])) == cancelled
    assert all(batches[i].details == [(0, seam.FAILED, errno.ECANCELED)]
               for i in range(20) if statuses[i] == bytes([seam.FAILED]))
    written = [i for i in range(20) if statuses[i] != bytes([seam.FAILED])]
    shard = (tmp_path / REL).parent  # made by the first write, if any ran
    on_disk = sorted(p.name for p in shard.iterdir()) if shard.exists() else []
    assert on_disk == sorted(f"c{i}.kv" for i in written)



def test_waking_sleeping_workers_releases_the_gil_once(tmp_path: Path) -> None:
    """A submission wakes idle workers without the GIL (one release for the batch: the wake
    is a system call); the batch then comes back from ``wait`` with its token."""
    engine = _native.Engine(1, 2, 4 * MIB)
    try:
        engine.thread_ids()  # every worker started,
        time.sleep(0.5)  # and asleep: nothing was submitted
        payload = memoryview(payload_for(BLOCK_SIZE))
        (tmp_path / REL).parent.mkdir(parents=True)  # (a new namespace is another status)
        before = native.counters()
        engine.submit_write([write_item(tmp_path, payload)], "token")
        after = native.counters()
        assert after["gil_releases"] - before["gil_releases"] == 1
        done = engine.wait(30.0)
        assert [(token, statuses) for token, (statuses, _) in done] == \
            [("token", bytes([seam.OK]))]
        assert (tmp_path / REL.rpartition("/")[0] / "chunk.kv").stat().st_size > BLOCK_SIZE
    finally:
        engine.close()


def test_a_worker_already_being_woken_is_not_woken_again_without_the_gil(
        tmp_path: Path) -> None:
    """Right after a submission woke the only writer, the next one finds it woken (or busy
    with a 32 MiB write): its post is made with the GIL kept."""
    engine = _native.Engine(1, 1, 4 * MIB)
    try:
        engine.thread_ids()
        time.sleep(0.5)
        (tmp_path / REL).parent.mkdir(parents=True)
        big = memoryview(payload_for(32 * MIB))
        small = memoryview(payload_for(BLOCK_SIZE))
        before = native.counters()
        engine.submit_write([write_item(tmp_path, big, name="big.kv")], "big")
        middle = native.counters()
        engine.submit_write([write_item(tmp_path, small, name="small.kv")], "small")
        after = native.counters()
        assert middle["wake_releases"] - before["wake_releases"] == 1
        assert after["gil_releases"] - middle["gil_releases"] == 0
        tokens = []
        while len(tokens) < 2:
            tokens += [token for token, _ in engine.wait(30.0)]
        assert sorted(tokens) == ["big", "small"]
    finally:
        engine.close()


def test_finished_batches_are_taken_without_letting_go_of_the_gil(tmp_path: Path) -> None:
    engine = _native.Engine(1, 1, 4 * MIB)
    try:
        (tmp_path / REL).parent.mkdir(parents=True)
        engine.submit_write([write_item(tmp_path, memoryview(payload_for(BLOCK_SIZE)))], "t")
        time.sleep(0.5)  # long done
        before = native.counters()
        done = engine.wait(30.0)
        assert native.counters()["gil_releases"] == before["gil_releases"]
        assert [token for token, _ in done] == ["t"]
    finally:
        engine.close()


def eventfd_count(fd: int) -> int:
    """What the eventfd holds (0 when nothing signalled it); reading resets it."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


@pytest.fixture
def eventfds() -> Iterator[list[int]]:
    made = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(3)]
    yield made
    for fd in made:
        os.close(fd)


def test_wait_signals_eventfds_in_the_release_it_makes(tmp_path: Path,
                                                       eventfds: list[int]) -> None:
    """The eventfds handed to ``wait`` are signalled in one GIL release, which also waits
    (or takes what finished meanwhile)."""
    engine = _native.Engine(1, 1, 4 * MIB)
    try:
        before = native.counters()
        assert engine.wait(0.01, (eventfds[0], eventfds[1])) == []  # nothing finished
        assert native.counters()["gil_releases"] - before["gil_releases"] == 1
        assert [eventfd_count(fd) for fd in eventfds] == [1, 1, 0]
        (tmp_path / REL).parent.mkdir(parents=True)
        engine.submit_write([write_item(tmp_path, memoryview(payload_for(BLOCK_SIZE)))], "t")
        time.sleep(0.5)  # long done
        before = native.counters()
        assert [token for token, _ in engine.wait(30.0, (eventfds[2],))] == ["t"]
        assert native.counters()["gil_releases"] - before["gil_releases"] == 1
        assert [eventfd_count(fd) for fd in eventfds] == [0, 0, 1]
        with pytest.raises(ValueError, match="at most 16 eventfds"):
            engine.wait(0.01, (eventfds[0],) * 17)
        with pytest.raises(ValueError, match="not a file descriptor"):
            engine.wait(0.01, (-1,))
        with pytest.raises(TypeError):
            engine.wait(0.01, [eventfds[0]])  # a tuple, as NativeEngine passes it
        assert [eventfd_count(fd) for fd in eventfds] == [0, 0, 0]  # refused: none written
    finally:
        engine.close()
    assert engine.wait(0.01, (eventfds[0],)) is None  # closed, and still signalled
    assert eventfd_count(eventfds[0]) == 1


def test_a_callback_signals_its_eventfd_when_the_completer_waits_again(
        engine_for, tmp_path: Path, eventfds: list[int]) -> None:
    engine = engine_for()
    assert not engine.signal_later(eventfds[0])  # not on the completion thread
    deferred: list[tuple[bool, bool, int]] = []
    done = threading.Event()

    def on_done(batch: seam.Batch) -> None:
        deferred.append((engine.signal_later(eventfds[0]), engine.signal_later(eventfds[0]),
                         eventfd_count(eventfds[0])))  # not yet written
        done.set()

    (tmp_path / REL).parent.mkdir(parents=True)
    engine.submit_write([write_item(tmp_path, memoryview(payload_for(BLOCK_SIZE)))], on_done)
    assert done.wait(30)
    deadline = time.monotonic() + 30
    while (count := eventfd_count(eventfds[0])) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deferred == [(True, True, 0)] and count == 1  # once, however often it was asked


# -- writes ----------------------------------------------------------------------------------


def write_item(root: Path, payload: memoryview, *, key: str = "k", direct: bool = True,
               mode: int = 0o640, gpu: tuple[int, int] | None = None, fsync_level: int = 0,
               name: str = "chunk.kv", victims: tuple[str, ...] = ()) -> WriteItem:
    shard = REL.rpartition("/")[0]
    return (root_descriptor(str(root)), shard, f"{name}.tmp-test", name, payload, key.encode(),
            b"ns", meta_for(len(payload)).to_json(), gpu, direct, mode, 0o750, fsync_level,
            victims)


def assert_whole_chunk_file(path: Path, payload: bytes) -> None:
    """``path`` holds ``payload`` whole, zero padded to 4 KiB, under a header whose checksum
    is the payload's and which validates as key ``k``."""
    n = len(payload)
    data = path.read_bytes()
    assert len(data) == HEADER_SIZE + padded_length(n)
    assert data[HEADER_SIZE:HEADER_SIZE + n] == payload
    assert set(data[HEADER_SIZE + n:]) <= {0}
    assert decode_header(data[:HEADER_SIZE]).payload_checksum == payload_checksum(payload)
    assert judge_chunk(data[:HEADER_SIZE], Expected(key="k", payload_len=n, meta=meta_for(n),
                                                    file_size=len(data))).ok


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("kind", ["aligned", "unaligned"])
@pytest.mark.parametrize("task_size", [8192, 2 * MIB])
@pytest.mark.parametrize("n", SIZES)
def test_writes_files_the_python_engine_reads_and_validates(
        engine_for, tmp_path: Path, n: int, task_size: int, kind: str, direct: bool) -> None:
    payload = payload_for(n)
    source = dest_for(n, kind)
    source[:n] = payload
    (tmp_path / REL).parent.mkdir(parents=True)
    statuses, details = write_now(engine_for(task_size),
                                  [write_item(tmp_path, source[:n], direct=direct,
                                              fsync_level=2)])
    assert (statuses, details) == (bytes([seam.OK]), [])
    assert_whole_chunk_file(tmp_path / REL, payload)
    assert sorted(p.name for p in (tmp_path / REL).parent.iterdir()) == ["chunk.kv"]


@pytest.mark.parametrize("n,task_size,direct,kind,overlapped", [
    (2 * BLOCK_SIZE, 64 * MIB, True, "aligned", True),  # two groups of one block
    (3 * BLOCK_SIZE + 4096, 64 * MIB, True, "aligned", True),  # the last group short
    (33 * BLOCK_SIZE + 8192, 64 * MIB, True, "aligned", True),  # groups of nine blocks
    (BLOCK_SIZE, 64 * MIB, True, "aligned", False),  # one block: nothing to overlap
    (2 * BLOCK_SIZE, BLOCK_SIZE + 4096, True, "aligned", False),  # piece by piece
    (2 * BLOCK_SIZE + 100, 64 * MIB, True, "aligned", False),  # a staged tail
    (2 * BLOCK_SIZE, 64 * MIB, True, "unaligned", False),
    (2 * BLOCK_SIZE, 64 * MIB, False, "aligned", False)])
def test_a_chunk_of_several_blocks_is_written_while_it_is_hashed(
        engine_for, tmp_path: Path, n: int, task_size: int, direct: bool, kind: str,
        overlapped: bool) -> None:
    """O_DIRECT, aligned, whole 4 KiB pages, more than one block and one piece: the groups
    go out (last first, the header with the first) as their digests are known; the file is
    the same format, whole, and validates.  Anything else takes the one-call path."""
    payload = payload_for(n)
    source = dest_for(n, kind)
    source[:n] = payload
    (tmp_path / REL).parent.mkdir(parents=True)
    before = native.counters()["overlapped_writes"]
    statuses, details = write_now(engine_for(task_size),
                                  [write_item(tmp_path, source[:n], direct=direct)])
    assert (statuses, details) == (bytes([seam.OK]), [])
    assert native.counters()["overlapped_writes"] - before == int(overlapped)
    assert_whole_chunk_file(tmp_path / REL, payload)


def test_an_overlapped_write_with_no_room_fails_whole_and_leaves_nothing(
        engine_for, tmp_path: Path) -> None:
    """Two-block chunks into a small ext4 until it is full: each chunk is published whole
    or fails with ENOSPC (its blocks cannot be allocated); no temp file is left and every
    published file validates."""
    with ext4_image(tmp_path / "fs", 16, journal=True) as fs:
        n = 2 * BLOCK_SIZE
        source = dest_for(n, "aligned")
        source[:n] = payload_for(n)
        (fs / REL).parent.mkdir(parents=True)
        engine = engine_for()
        before = native.counters()["overlapped_writes"]
        results = [write_now(engine, [write_item(fs, source[:n], name=f"c{i}.kv")])
                   for i in range(12)]  # 24 MiB into 16 MiB
        written = [i for i, r in enumerate(results) if r.statuses == bytes([seam.OK])]
        assert written and len(written) < len(results)
        assert all(r.details == [(0, seam.FAILED, errno.ENOSPC)]
                   for i, r in enumerate(results) if i not in written)
        assert native.counters()["overlapped_writes"] - before >= len(written)
        shard = (fs / REL).parent
        assert sorted(p.name for p in shard.iterdir()) == sorted(f"c{i}.kv" for i in written)
        for i in written:
            assert_whole_chunk_file(shard / f"c{i}.kv", payload_for(n))


@pytest.mark.parametrize("umask", [0o077, 0o022, 0o000],
                         ids=["chmod-needed", "umask-leaves-it", "no-umask"])
def test_mode_is_exact_and_gpu_checksum_recorded(engine_for, tmp_path: Path, umask: int) -> None:
    (tmp_path / REL).parent.mkdir(parents=True)
    old = os.umask(umask)
    try:
        write_now(engine_for(), [write_item(tmp_path, memoryview(b"x" * 10), mode=0o640,
                                            gpu=(1, 2))])
    finally:
        os.umask(old)
    path = tmp_path / REL
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert decode_header(path.read_bytes()[:HEADER_SIZE]).gpu_checksum == (1, 2)


@pytest.mark.parametrize("existing,status", [
    ("", seam.NEW_NAMESPACE), ("ns", seam.NEW_NAMESPACE),
    ("ns/0123456789abcdef", seam.OK), ("ns/0123456789abcdef/ab", seam.OK)])
def test_missing_shard_directories_are_made_with_exactly_their_mode(
        engine_for, tmp_path: Path, existing: str, status: int) -> None:
    if existing:
        (tmp_path / existing).mkdir(parents=True)
    old = os.umask(0o077)
    try:
        statuses, details = write_now(engine_for(), [write_item(tmp_path, memoryview(b"abc"))])
    finally:
        os.umask(old)
    assert statuses == bytes([status])
    assert details == ([] if status == seam.OK else [(0, status, 0)])
    made = Path(REL).parent
    for depth in range(len(Path(existing).parts) if existing else 0, len(made.parts)):
        directory = tmp_path.joinpath(*made.parts[: depth + 1])
        assert stat.S_IMODE(directory.stat().st_mode) == 0o750, directory
    assert (tmp_path / REL).read_bytes()[HEADER_SIZE:HEADER_SIZE + 3] == b"abc"


def test_writers_racing_to_make_one_new_shard_all_publish(engine_for, tmp_path: Path) -> None:
    """Both writer threads make the same missing leaf at once (one ``mkdirat`` wins, the other
    opens what it made): every chunk is published and the leaf has exactly its mode."""
    engine = engine_for()
    payload = memoryview(payload_for(BLOCK_SIZE))
    for round_ in range(20):
        root = tmp_path / f"root{round_}"
        (root / REL).parent.parent.mkdir(parents=True)  # the namespace's ``ab``, not ``cd``
        items = [write_item(root, payload, key=f"k{i}", name=f"c{i}.kv") for i in range(8)]
        old = os.umask(0o077)
        try:
            batch = write_now(engine, items)
        finally:
            os.umask(old)
        assert batch.statuses == bytes([seam.OK] * 8), batch.details
        leaf = (root / REL).parent
        assert stat.S_IMODE(leaf.stat().st_mode) == 0o750
        assert sorted(p.name for p in leaf.iterdir()) == sorted(f"c{i}.kv" for i in range(8))


def test_a_stale_temp_file_is_replaced(engine_for, tmp_path: Path) -> None:
    shard = (tmp_path / REL).parent
    shard.mkdir(parents=True)
    (shard / "chunk.kv.tmp-test").write_bytes(b"left by a dead writer")
    assert write_now(engine_for(), [write_item(tmp_path, memoryview(b"abc"))]).statuses == \
        bytes([seam.OK])
    assert sorted(p.name for p in shard.iterdir()) == ["chunk.kv"]


def test_a_write_removes_its_victims_first(engine_for, tmp_path: Path) -> None:
    shard = (tmp_path / REL).parent
    shard.mkdir(parents=True)
    for name in ("old1.kv", "old2.kv"):
        (shard / name).write_bytes(b"evicted")
    victims = (f"{shard.relative_to(tmp_path)}/old1.kv", f"{shard.relative_to(tmp_path)}/old2.kv",
               f"{shard.relative_to(tmp_path)}/already-gone.kv")
    batch = write_now(engine_for(), [write_item(tmp_path, memoryview(b"new"), victims=victims)])
    assert batch.statuses == bytes([seam.OK])
    assert sorted(p.name for p in shard.iterdir()) == ["chunk.kv"]


# -- a store task's writes as shares ---------------------------------------------------------


def share_for(root: Path, layout: RootLayout, keys: list[str], payloads: list[memoryview], *,
              victims: tuple[str, ...] = (), ns_id: str = "0123456789abcdef"
              ) -> seam.WriteShare:
    return (root_descriptor(str(root)), layout.write_naming(ns_id, ".tmp-test"), b"ns",
            meta_for(len(payloads[0])).to_json(), True, 0o640, 0o750, 0,
            victims, [key_digest(k) for k in keys], payloads, [k.encode() for k in keys])


def write_shares_now(engine: NativeEngine, shares: list[seam.WriteShare]) -> seam.Batch:
    done = Done()
    engine.submit_shares(shares, done("shares"))
    return done.wait_for(1)["shares"]


@pytest.mark.parametrize("levels", [SHARD_LEVELS, LEGACY_SHARD_LEVELS])
def test_shares_put_each_chunk_where_the_layout_names_it(engine_for, tmp_path: Path,
                                                         levels: int) -> None:
    """Two roots' shares of one task: each chunk at ``chunk_rel`` of its digest (the names
    the engine made from the digest and the root's naming), whole and valid, no temp left;
    each share's victims gone before its writes."""
    roots = [tmp_path / "a", tmp_path / "b"]
    layouts = [RootLayout(root, levels) for root in roots]
    keys = [[f"a{i}" for i in range(5)], [f"b{i}" for i in range(3)]]
    payloads = {k: random.Random(k).randbytes(5000) for k in keys[0] + keys[1]}
    victim = layouts[1].chunk_rel("0123456789abcdef", key_digest("old"))
    (roots[1] / victim).parent.mkdir(parents=True)
    (roots[1] / victim).write_bytes(b"evicted")
    for root in roots:
        root.mkdir(exist_ok=True)
    shares = [share_for(root, layout, mine, [memoryview(payloads[k]) for k in mine],
                        victims=(victim,) if root == roots[1] else ())
              for root, layout, mine in zip(roots, layouts, keys, strict=True)]
    batch = write_shares_now(engine_for(), shares)
    assert len(batch.statuses) == 8  # published, and the namespace made on root a
    assert set(batch.statuses) <= {seam.OK, seam.NEW_NAMESPACE}
    assert seam.NEW_NAMESPACE in batch.statuses[:5]
    assert not (roots[1] / victim).exists()
    for root, layout, mine in zip(roots, layouts, keys, strict=True):
        for k in mine:
            path = root / layout.chunk_rel("0123456789abcdef", key_digest(k))
            data = path.read_bytes()
            n = len(payloads[k])
            assert data[HEADER_SIZE:HEADER_SIZE + n] == payloads[k]
            assert judge_chunk(data[:HEADER_SIZE], Expected(key=k, payload_len=n,
                                                            meta=meta_for(n),
                                                            file_size=len(data))).ok
            assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_failed_chunk_of_a_share_is_reported_at_its_place_in_the_batch(
        engine_for, tmp_path: Path) -> None:
    layout = RootLayout(tmp_path)
    keys = ["k0", "k1", "k2"]
    blocked = tmp_path / layout.shard_rel("0123456789abcdef", key_digest("k2"))
    blocked.parent.mkdir(parents=True)
    blocked.write_bytes(b"a file where the shard directory goes")
    share = share_for(tmp_path, layout, keys, [memoryview(b"abc")] * 3)
    batch = write_shares_now(engine_for(), [share])
    assert batch.statuses[2] == seam.FAILED and batch.details[-1][:2] == (2, seam.FAILED)
    assert all((tmp_path / layout.chunk_rel("0123456789abcdef", key_digest(k))).exists()
               for k in keys[:2])


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda s: (1, 2), TypeError, "share 0 is not a tuple of 12"),
    (lambda s: s[:9] + (["a" * 32, "xyz"],) + s[10:], ValueError, "not lowercase hex"),
    (lambda s: s[:9] + (["A" * 32, "b" * 32],) + s[10:], ValueError, "not lowercase hex"),
    (lambda s: s[:9] + ([7, "b" * 32],) + s[10:], TypeError, "a digest must be str"),
    (lambda s: s[:11] + (s[11][:1],), TypeError, "lists of one length"),
    (lambda s: s[:11] + ([b"k", "k"],), TypeError, "key 1 must be bytes"),
    (lambda s: s[:1] + (("ns/x/", 3, ".kv", ".tmp"),) + s[2:], ValueError, "shard_levels"),
    (lambda s: s[:1] + (("ns/x/", 1),) + s[2:], TypeError, "naming is"),
    (lambda s: s[:1] + (("ns/x\0/", 1, ".kv", ".tmp"),) + s[2:], ValueError, "NUL"),
    (lambda s: s[:1] + (("ns/x/", 1, ".kv", ".tmp\0"),) + s[2:], ValueError, "NUL"),
    (lambda s: s[:8] + (["v"],) + s[9:], TypeError, "victims must be a tuple, not list"),
    (lambda s: s[:9] + ([], [], []), ValueError, "share 0 has no chunks"),
], ids=["shape", "short-digest", "upper-digest", "digest-type", "lengths", "key-type",
        "levels", "naming", "nul-prefix", "nul-suffix", "victims", "empty"])
def test_a_malformed_share_is_refused_clearly_and_writes_nothing(
        engine_for, tmp_path: Path, change: Callable[[tuple], object], error: type[Exception],
        message: str) -> None:
    views = [memoryview(bytearray(b"abc")) for _ in range(2)]
    share = share_for(tmp_path, RootLayout(tmp_path), ["k0", "k1"], views)
    with pytest.raises(error, match=message):
        engine_for().submit_shares([change(share)], lambda batch: None)  # type: ignore[list-item]
    del share
    for view in views:
        view.release()  # BufferError if the batch still held a payload
    assert not (tmp_path / "ns").exists()


@pytest.mark.parametrize("planted_at", ["ns/0123456789abcdef/ab/cd", "ns/0123456789abcdef/ab",
                                        "ns/0123456789abcdef"])
def test_a_link_in_the_tree_is_never_followed_by_a_write(engine_for, tmp_path: Path,
                                                         planted_at: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / planted_at).parent.mkdir(parents=True)
    os.symlink(elsewhere, tmp_path / planted_at)
    statuses, details = write_now(engine_for(), [write_item(tmp_path, memoryview(b"abc"))])
    assert statuses == bytes([seam.FAILED]) and details[0][2] in (errno.ELOOP,
                                                                    errno.ENOTDIR)
    assert list(elsewhere.iterdir()) == []


# -- a read call's chunks as one share --------------------------------------------------------


def read_share_for(root: Path, layout: RootLayout, keys: list[str], dests: list[memoryview],
                   payload_len: int, ns_id: str = "0123456789abcdef") -> seam.ReadShare:
    return (root_descriptor(str(root)), layout.chunk_naming(ns_id), True, payload_len,
            meta_for(payload_len).to_json(), [key_digest(k) for k in keys], dests,
            [k.encode() for k in keys])


@pytest.mark.parametrize("levels", [SHARD_LEVELS, LEGACY_SHARD_LEVELS])
@pytest.mark.parametrize("wait", [True, False], ids=["read_share", "submit_read_share"])
def test_a_read_share_finds_each_chunk_where_the_layout_names_it(
        engine_for, tmp_path: Path, levels: int, wait: bool) -> None:
    """Chunks written where ``chunk_rel`` names them come back whole through one share (the
    engine made each path from the digest and the root's naming), one missing file failed
    at its place with ENOENT, a buffer that is not 4 KiB aligned filled all the same."""
    layout = RootLayout(tmp_path, levels)
    keys = [f"r{i}" for i in range(5)]
    payloads = [random.Random(k).randbytes(BLOCK_SIZE + 4097) for k in keys]
    engine = engine_for(task_size=BLOCK_SIZE)  # several pieces per chunk
    written = write_shares_now(engine, [share_for(tmp_path, layout, keys,
                                                  [memoryview(p) for p in payloads])])
    assert set(written.statuses) <= {seam.OK, seam.NEW_NAMESPACE}
    n = len(payloads[0])
    dests = [dest_for(n, "aligned" if i % 2 else "staged") for i in range(6)]
    share = read_share_for(tmp_path, layout, [*keys, "never-written"], dests, n)
    if wait:
        batch = engine.read_share(share)
    else:
        done = Done()
        engine.submit_read_share(share, done("read"))
        batch = done.wait_for(1)["read"]
    assert bytes(batch.statuses) == bytes([seam.OK] * 5 + [seam.FAILED])
    assert [d[:2] for d in batch.details] == [(5, errno.ENOENT)]
    assert [bytes(dest[:n]) for dest in dests[:5]] == payloads


def test_a_read_share_checks_each_key_and_its_metadata(engine_for, tmp_path: Path) -> None:
    """A file at a chunk's path that holds another key (or was written with other
    metadata) is not served: the engine hands it back to be judged."""
    layout = RootLayout(tmp_path)
    engine = engine_for()
    payload = memoryview(b"x" * 9000)
    write_shares_now(engine, [share_for(tmp_path, layout, ["a", "b"], [payload, payload])])
    a_path = tmp_path / layout.chunk_rel("0123456789abcdef", key_digest("a"))
    b_path = tmp_path / layout.chunk_rel("0123456789abcdef", key_digest("b"))
    b_path.write_bytes(a_path.read_bytes())  # b's path now holds a's chunk
    dests = [dest_for(9000, "aligned") for _ in range(2)]
    batch = engine.read_share(read_share_for(tmp_path, layout, ["a", "b"], dests, 9000))
    assert batch.statuses[0] == seam.OK and batch.statuses[1] == seam.JUDGE
    other = read_share_for(tmp_path, layout, ["a"], dests[:1], 9000)
    other = other[:4] + (meta_for(4500).to_json(),) + other[5:]  # the right key, other layout
    assert engine.read_share(other).statuses[0] == seam.JUDGE


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda s: (1, 2), TypeError, "a read share is a tuple of 8"),
    (lambda s: s[:1] + (("ns/x/", 3, ".kv"),) + s[2:], ValueError, "shard_levels"),
    (lambda s: s[:1] + (("ns/x/", 1),) + s[2:], TypeError, "naming is"),
    (lambda s: s[:1] + (("ns/x\0/", 1, ".kv"),) + s[2:], ValueError, "NUL"),
    (lambda s: s[:5] + (["a" * 32, "xyz"],) + s[6:], ValueError, "not lowercase hex"),
    (lambda s: s[:5] + ([7, "b" * 32],) + s[6:], TypeError, "digest 0 must be str"),
    (lambda s: s[:7] + (s[7][:1],), TypeError, "lists of one length"),
    (lambda s: s[:7] + ([b"k", "k"],), TypeError, "key 1 must be bytes"),
    (lambda s: s[:3] + (1 << 20,) + s[4:], ValueError, "destination 0 holds"),
    (lambda s: s[:6] + ([memoryview(b"ro" * 5000)] * 2,) + s[7:], BufferError, "not writable"),
])
def test_a_malformed_read_share_is_refused_clearly(engine_for, tmp_path: Path,
                                                   change: Callable[[tuple], tuple],
                                                   error: type[Exception],
                                                   message: str) -> None:
    share = read_share_for(tmp_path, RootLayout(tmp_path), ["a", "b"],
                           [dest_for(9000, "aligned") for _ in range(2)], 9000)
    engine = engine_for()
    with pytest.raises(error, match=message):
        engine.read_share(change(share))


def test_writes_submitted_from_several_threads_at_once(engine_for, tmp_path: Path) -> None:
    engine = engine_for()
    (tmp_path / REL).parent.mkdir(parents=True)
    payloads = {f"k{i}": payload_for(BLOCK_SIZE + i) for i in range(8)}

    def write(key: str) -> None:
        item = write_item(tmp_path, memoryview(payloads[key]), key=key, name=f"{key}.kv")
        assert write_now(engine, [item]).statuses == bytes([seam.OK])

    threads = [threading.Thread(target=write, args=(k,)) for k in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, payload in payloads.items():
        data = (tmp_path / REL).parent.joinpath(f"{key}.kv").read_bytes()
        assert data[HEADER_SIZE:HEADER_SIZE + len(payload)] == payload


def test_a_finished_read_never_hands_back_a_batch_allocated_after_it(
        engine_for, tmp_path: Path) -> None:
    """A worker that ends the last request of a synchronous read must not touch that batch
    again: ``read()`` returns and frees it at once, and the next batch (here a write) is
    often allocated in the same memory; taken for the read, it came back finished before its
    write ran (FAILED, errno 0) and was freed under the writer (a crash)."""
    n = 4096
    write_python(tmp_path, payload_for(n))
    engine = engine_for(threads=2)
    dests = [dest_for(n, "aligned") for _ in range(3)]
    payload = memoryview(payload_for(1))
    done = Done()
    rounds = 3000
    for i in range(rounds):
        assert engine.read([item(tmp_path, d, n) for d in dests]).statuses == \
            bytes([seam.OK]) * 3
        engine.submit_write([write_item(tmp_path, payload, name=f"w{i}.kv")], done(i))
    batches = done.wait_for(rounds)
    assert {i: b.details for i, b in batches.items() if b.statuses != bytes([seam.OK])} == {}
    written = (tmp_path / REL).parent
    assert all(written.joinpath(f"w{i}.kv").stat().st_size == HEADER_SIZE + 4096
               for i in range(rounds))


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_batch_submitted_while_the_engine_closes_is_refused_or_handed_back(
        tmp_path: Path, kind: str) -> None:
    """A submitter that found the engine open may push its batch only after ``close()`` let
    every worker go, if it lets go of the GIL in between (here: an item whose fd is read
    through Python code that closes the engine).  Such a batch ran on no thread and never came
    back: ``wait()`` never said the engine was drained, so closing a store hung.  It is now
    refused (the engine is closed) or run and handed back."""
    n = 4096
    write_python(tmp_path, payload_for(n))
    engine = _native.Engine(1, 1, 64 * MIB)
    fd = root_descriptor(str(tmp_path))

    class ClosesTheEngine:
        def __index__(self) -> int:
            engine.close()
            return fd

    closing = ClosesTheEngine()
    dest = dest_for(n, "aligned")
    if kind == "read":
        items: list[tuple[object, ...]] = [(closing, *item(tmp_path, dest, n)[1:])]
        submit = engine.submit_read
    else:
        items = [(closing, *write_item(tmp_path, memoryview(payload_for(n)), name="late.kv")[1:])]
        submit = engine.submit_write
    try:
        submit(items, "late")
        submitted = True
    except RuntimeError as exc:
        assert "closed" in str(exc)
        submitted = False
    handed_back = []
    for _ in range(50):  # up to ~10 s
        if (done := engine.wait(0.2)) is None:
            break
        handed_back += done
    else:
        pytest.fail("wait() never reported the closed engine drained: a batch was lost")
    assert [(token, statuses) for token, (statuses, _) in handed_back] == \
        ([("late", bytes([seam.OK]))] if submitted else [])
