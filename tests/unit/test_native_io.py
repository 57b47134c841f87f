"""io/native.py and its compiled engine (io/csrc): the same bytes, checks and file rules as
the Python engine, a batch per GIL round trip.

Every batch is a list of shares (``io/engine.py``): the engine makes each chunk's file
names from its digest and the share's naming, and numbers the chunks share by share.
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
from collections.abc import Callable, Iterator, Sequence
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
    CHUNK_SUFFIX,
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
from lmcache_nvme_backend.io.native import NativeEngine

if not native.available():
    missing_prerequisite(native.unavailable_reason())

from lmcache_nvme_backend.io import _native  # type: ignore[attr-defined]  # noqa: E402

MIB = 1 << 20
SIZES = [0, 1, 4095, 4096, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 4097]
TASK_SIZES = [8192, BLOCK_SIZE + 4096, 64 * MIB]
NS_ID = "0123456789abcdef"
TEMP_SUFFIX = ".tmp-test"


def payload_for(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def meta_for(n: int) -> TensorMeta:
    return TensorMeta(shapes=((n,),), dtypes=("uint8",), fmt=1, nbytes=n)


def chunk_path(root: Path, key: str = "k", levels: int = SHARD_LEVELS) -> Path:
    """Where the layout puts ``key``'s chunk (as the engine names it from the digest)."""
    return root / RootLayout(root, levels).chunk_rel(NS_ID, key_digest(key))


def write_python(root: Path, payload: bytes, key: str = "k", version: int = 2) -> Path:
    """A chunk file as ``disk.format`` lays it out (header, payload, zero padding)."""
    path = chunk_path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = encode_header(key, "ns", meta_for(len(payload)), len(payload),
                           payload_checksum(payload, version), version=version)
    path.write_bytes(header + payload + bytes(padded_length(len(payload)) - len(payload)))
    return path


def dest_for(n: int, kind: str) -> memoryview:
    if kind == "aligned":
        return AlignedBuffer(n + 4096).view[: padded_length(n)] if n else memoryview(bytearray())
    return memoryview(bytearray(n + 1))[1:]  # not 4 KiB aligned: staged


def read_share(root: Path, dests: list[memoryview], n: int, keys: Sequence[str] = ("k",), *,
               direct: bool = True, levels: int = SHARD_LEVELS) -> seam.ReadShare:
    """The chunks of ``keys`` beneath ``root``, read into ``dests`` (``n`` bytes each)."""
    return (root_descriptor(str(root)), RootLayout(root, levels).chunk_naming(NS_ID), direct, n,
            meta_for(n).to_json(), [key_digest(k) for k in keys], dests,
            [k.encode() for k in keys])


def write_share(root: Path, payloads: list[memoryview], keys: Sequence[str] = ("k",), *,
                digests: list[str] | None = None, direct: bool = True, mode: int = 0o640,
                fsync_level: int = 0, victims: tuple[str, ...] = (),
                gpu: list[tuple[int, int]] | None = None, levels: int = SHARD_LEVELS
                ) -> seam.WriteShare:
    """The chunks of ``keys`` (named from ``digests``, by default the keys' digests) beneath
    ``root``, namespace ``ns``, each payload's layout ``meta_for`` its length."""
    return (root_descriptor(str(root)), RootLayout(root, levels).write_naming(NS_ID, TEMP_SUFFIX),
            b"ns", meta_for(len(payloads[0])).to_json(), direct, mode, 0o750, fsync_level,
            victims, digests or [key_digest(k) for k in keys], payloads,
            [k.encode() for k in keys], gpu)


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
    write_python(tmp_path, payload)
    dest = dest_for(n, kind)
    statuses, details = engine_for(task_size).read([read_share(tmp_path, [dest], n,
                                                               direct=direct)])
    assert (statuses, details) == (bytes([seam.OK]), [])
    assert bytes(dest[:n]) == payload


def test_a_version_1_file_is_checked_over_the_whole_payload(engine_for, tmp_path: Path
                                                             ) -> None:
    payload = payload_for(3 * BLOCK_SIZE + 5)
    write_python(tmp_path, payload, version=1)
    dest = dest_for(len(payload), "aligned")
    statuses, _ = engine_for(BLOCK_SIZE).read([read_share(tmp_path, [dest], len(payload))])
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
    key = "k"
    if what == "payload":
        damage(path, HEADER_SIZE + BLOCK_SIZE + 7)
    elif what == "header":
        damage(path, 60)
    else:  # another key's path holds k's chunk
        key = "another key"
        moved = chunk_path(tmp_path, key)
        moved.parent.mkdir(parents=True, exist_ok=True)
        path = path.rename(moved)
    statuses, details = engine_for().read([read_share(tmp_path, [dest_for(n, "aligned")], n,
                                                      [key])])
    assert statuses == bytes([seam.JUDGE])
    [(index, error, header, computed)] = details
    assert index == 0 and error == 0 and header == path.read_bytes()[:HEADER_SIZE]
    verdict = judge_chunk(header, Expected(key=key, payload_len=n, meta=meta_for(n)),
                          lambda h: h.payload_checksum == computed)
    assert verdict.defect is defect


def test_failures_come_back_with_their_errno(engine_for, tmp_path: Path) -> None:
    """Each chunk of a batch of two shares fails at its place: missing, short, a link, a
    fifo, and (the second share, whose naming leads out of the root) outside the root."""
    n = 8192
    root = tmp_path / "root"
    good = write_python(root, payload_for(n))
    keys = ["missing", "short", "link", "fifo"]
    for key in keys:
        chunk_path(root, key).parent.mkdir(parents=True, exist_ok=True)
    chunk_path(root, "short").write_bytes(good.read_bytes()[: HEADER_SIZE + 4096])
    os.symlink(good, chunk_path(root, "link"))
    os.mkfifo(chunk_path(root, "fifo"))
    inside = read_share(root, [dest_for(n, "aligned") for _ in keys], n, keys)
    escaping = read_share(root, [dest_for(n, "aligned")], n, ["outside"])
    escaping = escaping[:1] + (("../", SHARD_LEVELS, CHUNK_SUFFIX),) + escaping[2:]
    digest = key_digest("outside")
    (tmp_path / digest[:2]).mkdir()
    (tmp_path / digest[:2] / f"{digest}{CHUNK_SUFFIX}").write_bytes(good.read_bytes())
    statuses, details = engine_for().read([inside, escaping])
    names = [*keys, "outside"]
    assert statuses == bytes([seam.FAILED] * len(names))
    errors = {names[i]: err for i, err, header, _ in details if header is None}
    assert errors == {"missing": errno.ENOENT, "short": errno.ENODATA, "link": errno.ELOOP,
                      "fifo": errno.EINVAL, "outside": errno.EXDEV}


def test_a_destination_shorter_than_the_payload_is_refused(engine_for, tmp_path: Path
                                                           ) -> None:
    write_python(tmp_path, payload_for(8192))
    with pytest.raises(ValueError, match="share 0: destination 0 holds 4096 bytes"):
        engine_for().read([read_share(tmp_path, [dest_for(4096, "aligned")], 8192)])


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda s: (1, 2), TypeError, r"share 1 is not a tuple of 8 \(a read share\)"),
    (lambda s: ("3",) + s[1:], TypeError, "share 1: root_fd must be an int .*, not str"),
    (lambda s: (1 << 40,) + s[1:], OverflowError, "share 1: root_fd is out of range"),
    (lambda s: s[:1] + (("ns/x/", 3, ".kv"),) + s[2:], ValueError,
     "share 1: shard_levels must be 1 or 2, not 3"),
    (lambda s: s[:1] + (("ns/x/", 1),) + s[2:], TypeError, r"share 1: naming is \(shard_prefix"),
    (lambda s: s[:1] + ((b"ns/x/", 1, ".kv"),) + s[2:], TypeError, "share 1: naming is"),
    (lambda s: s[:1] + (("ns/x\0/", 1, ".kv"),) + s[2:], ValueError,
     "share 1: naming holds a NUL character"),
    (lambda s: s[:3] + (-1,) + s[4:], OverflowError, "share 1: payload_len is out of range"),
    (lambda s: s[:4] + ("{}",) + s[5:], TypeError, "share 1: meta must be bytes, not str"),
    (lambda s: s[:5] + (["a" * 32, "xyz"],) + s[6:], ValueError, "not lowercase hex"),
    (lambda s: s[:5] + ([7, "b" * 32],) + s[6:], TypeError, "share 1: digest 0 must be str"),
    (lambda s: s[:7] + (s[7][:1],), TypeError,
     "share 1: digests, dests and keys must be lists of one length"),
    (lambda s: s[:5] + (tuple(s[5]),) + s[6:], TypeError, "lists of one length"),
    (lambda s: s[:7] + ([b"k", "k"],), TypeError, "share 1: key 1 must be bytes, not str"),
    (lambda s: s[:3] + (1 << 20,) + s[4:], ValueError, "share 1: destination 0 holds"),
    (lambda s: s[:6] + ([memoryview(b"ro" * 5000)] * 2,) + s[7:], BufferError, "not writable"),
], ids=["shape", "fd-type", "fd-range", "levels", "naming", "naming-bytes", "naming-nul",
        "length", "meta", "digest", "digest-type", "lengths", "tuple-column", "key", "dest",
        "read-only"])
def test_a_malformed_read_share_is_refused_clearly_and_holds_no_buffer(
        engine_for, tmp_path: Path, change: Callable[[tuple], object], error: type[Exception],
        message: str) -> None:
    good = bytearray(9000)
    first = read_share(tmp_path, [memoryview(good)], 9000, ["a"])
    share = read_share(tmp_path, [dest_for(9000, "aligned") for _ in range(2)], 9000, ["a", "b"])
    with pytest.raises(error, match=message):
        engine_for().read([first, change(share)])  # type: ignore[list-item]
    del first
    good.extend(b"x")  # resizable again: the batch let go of the buffer it had taken


def test_a_batch_costs_one_gil_release(engine_for, tmp_path: Path) -> None:
    """Eight chunks in two shares (two roots), three pieces each: one release for all."""
    shares = []
    for r in range(2):
        root, keys = tmp_path / f"root{r}", [f"c{r}{i}" for i in range(4)]
        for key in keys:
            write_python(root, payload_for(3 * BLOCK_SIZE), key=key)
        shares.append(read_share(root, [dest_for(3 * BLOCK_SIZE, "aligned") for _ in keys],
                                 3 * BLOCK_SIZE, keys))
    engine = engine_for(BLOCK_SIZE)  # 3 pieces per chunk, 24 in the batch
    before = native.counters()
    statuses, _ = engine.read(shares)
    after = native.counters()
    assert statuses == bytes([seam.OK] * 8)
    assert after["gil_releases"] - before["gil_releases"] == 1
    assert after["hashed_bytes"] - before["hashed_bytes"] >= 8 * 3 * BLOCK_SIZE


def test_the_checksum_time_is_sampled_and_scaled_to_every_byte_hashed(
        engine_for, tmp_path: Path) -> None:
    keys = [f"c{i}" for i in range(16)]
    for key in keys:
        write_python(tmp_path, payload_for(BLOCK_SIZE), key=key)
    share = read_share(tmp_path, [dest_for(BLOCK_SIZE, "aligned") for _ in keys], BLOCK_SIZE,
                       keys)
    # 16 hash calls on at most two threads (the worker, and the caller, which may take
    # pieces of a blocking read), each timing one call in eight from where its count stands
    engine = engine_for(threads=1)
    before = native.counters()
    statuses, _ = engine.read([share])
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


def write_now(engine: NativeEngine, shares: list[seam.WriteShare]) -> seam.Batch:
    done = Done()
    engine.submit_write(shares, done("write"))
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
        engine.submit_read([read_share(tmp_path, [dest], n)], done(i))
    engine.submit_read([], done("empty"))
    engine.submit_read([read_share(tmp_path, [], n, [])], done("empty share"))
    got = {name: batch.statuses for name, batch in done.wait_for(7).items()}
    assert got == {**{i: bytes([seam.OK]) for i in range(5)}, "empty": b"", "empty share": b""}
    assert all(bytes(d[:n]) == payload for d in dests)
    # named in the kernel too, so that its CPU is told apart from its host's threads
    assert "nvme-io-done" in {(task / "comm").read_text().strip()
                              for task in Path("/proc/self/task").iterdir()}
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.read([])


def test_close_finishes_queued_writes_and_cancel_ends_the_rest(engine_for, tmp_path: Path
                                                               ) -> None:
    engine = engine_for()
    done = Done()
    payload = memoryview(payload_for(BLOCK_SIZE))
    for i in range(20):
        engine.submit_write([write_share(tmp_path, [payload], [f"c{i}"])], done(i))
    cancelled = engine.cancel_writes()
    engine.close()  # what was not cancelled finishes first
    batches = done.wait_for(20)
    statuses = [batches[i].statuses for i in range(20)]
    assert statuses.count(bytes([seam.FAILED])) == cancelled
    assert all(batches[i].details == [(0, seam.FAILED, errno.ECANCELED)]
               for i in range(20) if statuses[i] == bytes([seam.FAILED]))
    written = [i for i in range(20) if statuses[i] != bytes([seam.FAILED])]
    on_disk = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk == sorted(chunk_path(tmp_path, f"c{i}") for i in written)


def test_waking_sleeping_workers_releases_the_gil_once(tmp_path: Path) -> None:
    """A submission wakes idle workers without the GIL (one release for the batch: the wake
    is a system call); the batch then comes back from ``wait`` with its token."""
    engine = _native.Engine(1, 2, 4 * MIB)
    try:
        engine.thread_ids()  # every worker started,
        time.sleep(0.5)  # and asleep: nothing was submitted
        payload = memoryview(payload_for(BLOCK_SIZE))
        chunk_path(tmp_path).parent.mkdir(parents=True)  # (a new namespace is another status)
        before = native.counters()
        engine.submit_shares([write_share(tmp_path, [payload])], "token")
        after = native.counters()
        assert after["gil_releases"] - before["gil_releases"] == 1
        done = engine.wait(30.0)
        assert [(token, statuses) for token, (statuses, _) in done] == \
            [("token", bytes([seam.OK]))]
        assert chunk_path(tmp_path).stat().st_size > BLOCK_SIZE
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
        (tmp_path / "ns" / NS_ID).mkdir(parents=True)
        big = memoryview(payload_for(32 * MIB))
        small = memoryview(payload_for(BLOCK_SIZE))
        before = native.counters()
        engine.submit_shares([write_share(tmp_path, [big], ["big"])], "big")
        middle = native.counters()
        engine.submit_shares([write_share(tmp_path, [small], ["small"])], "small")
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
        chunk_path(tmp_path).parent.mkdir(parents=True)
        engine.submit_shares([write_share(tmp_path, [memoryview(payload_for(BLOCK_SIZE))])],
                             "t")
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
        chunk_path(tmp_path).parent.mkdir(parents=True)
        engine.submit_shares([write_share(tmp_path, [memoryview(payload_for(BLOCK_SIZE))])],
                             "t")
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

    chunk_path(tmp_path).parent.mkdir(parents=True)
    engine.submit_write([write_share(tmp_path, [memoryview(payload_for(BLOCK_SIZE))])], on_done)
    assert done.wait(30)
    deadline = time.monotonic() + 30
    while (count := eventfd_count(eventfds[0])) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deferred == [(True, True, 0)] and count == 1  # once, however often it was asked


# -- writes ----------------------------------------------------------------------------------


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
    path = chunk_path(tmp_path)
    path.parent.mkdir(parents=True)
    statuses, details = write_now(engine_for(task_size),
                                  [write_share(tmp_path, [source[:n]], direct=direct,
                                               fsync_level=2)])
    assert (statuses, details) == (bytes([seam.OK]), [])
    assert_whole_chunk_file(path, payload)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


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
    chunk_path(tmp_path).parent.mkdir(parents=True)
    before = native.counters()["overlapped_writes"]
    statuses, details = write_now(engine_for(task_size),
                                  [write_share(tmp_path, [source[:n]], direct=direct)])
    assert (statuses, details) == (bytes([seam.OK]), [])
    assert native.counters()["overlapped_writes"] - before == int(overlapped)
    assert_whole_chunk_file(chunk_path(tmp_path), payload)


def in_one_shard(count: int, prefix: str = "ab") -> list[str]:
    """Digests of ``count`` chunks whose files share one shard directory (``prefix``)."""
    return [f"{prefix}{i:030x}" for i in range(count)]


def test_an_overlapped_write_with_no_room_fails_whole_and_leaves_nothing(
        engine_for, tmp_path: Path) -> None:
    """Two-block chunks into a small ext4 until it is full: each chunk is published whole
    or fails with ENOSPC (its blocks cannot be allocated); no temp file is left and every
    published file validates."""
    with ext4_image(tmp_path / "fs", 16, journal=True) as fs:
        n = 2 * BLOCK_SIZE
        source = dest_for(n, "aligned")
        source[:n] = payload_for(n)
        digests = in_one_shard(12)
        shard = fs / "ns" / NS_ID / "ab"
        shard.mkdir(parents=True)
        engine = engine_for()
        before = native.counters()["overlapped_writes"]
        results = [write_now(engine, [write_share(fs, [source[:n]], digests=[digest])])
                   for digest in digests]  # 24 MiB into 16 MiB
        written = [i for i, r in enumerate(results) if r.statuses == bytes([seam.OK])]
        assert written and len(written) < len(results)
        assert all(r.details == [(0, seam.FAILED, errno.ENOSPC)]
                   for i, r in enumerate(results) if i not in written)
        assert native.counters()["overlapped_writes"] - before >= len(written)
        assert sorted(p.name for p in shard.iterdir()) == \
            sorted(f"{digests[i]}{CHUNK_SUFFIX}" for i in written)
        for i in written:
            assert_whole_chunk_file(shard / f"{digests[i]}{CHUNK_SUFFIX}", payload_for(n))


@pytest.mark.parametrize("umask", [0o077, 0o022, 0o000],
                         ids=["chmod-needed", "umask-leaves-it", "no-umask"])
def test_mode_is_exact_and_gpu_checksums_recorded(engine_for, tmp_path: Path,
                                                  umask: int) -> None:
    """Each chunk's GPU checksum (a share's last column) goes into its header; a share
    without them (None) in the same batch writes headers without one."""
    (tmp_path / "ns" / NS_ID).mkdir(parents=True)
    old = os.umask(umask)
    try:
        payload = memoryview(b"x" * 10)
        batch = write_now(engine_for(), [
            write_share(tmp_path, [payload] * 2, ["k", "k2"], mode=0o640,
                        gpu=[(1, 2), (2**64 - 1, 0)]),
            write_share(tmp_path, [payload], ["k3"])])
    finally:
        os.umask(old)
    assert batch.statuses == bytes([seam.OK] * 3)
    path = chunk_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [decode_header(chunk_path(tmp_path, key).read_bytes()[:HEADER_SIZE]).gpu_checksum
            for key in ("k", "k2", "k3")] == [(1, 2), (2**64 - 1, 0), None]


@pytest.mark.parametrize("existing,status", [
    (0, seam.NEW_NAMESPACE), (1, seam.NEW_NAMESPACE), (2, seam.OK), (3, seam.OK)],
    ids=["nothing", "ns", "namespace", "first-level"])
def test_missing_shard_directories_are_made_with_exactly_their_mode(
        engine_for, tmp_path: Path, existing: int, status: int) -> None:
    made = Path(RootLayout(tmp_path, LEGACY_SHARD_LEVELS).shard_rel(NS_ID, key_digest("k")))
    if existing:
        tmp_path.joinpath(*made.parts[:existing]).mkdir(parents=True)
    old = os.umask(0o077)
    try:
        statuses, details = write_now(engine_for(), [
            write_share(tmp_path, [memoryview(b"abc")], levels=LEGACY_SHARD_LEVELS)])
    finally:
        os.umask(old)
    assert statuses == bytes([status])
    assert details == ([] if status == seam.OK else [(0, status, 0)])
    for depth in range(existing, len(made.parts)):
        directory = tmp_path.joinpath(*made.parts[: depth + 1])
        assert stat.S_IMODE(directory.stat().st_mode) == 0o750, directory
    path = chunk_path(tmp_path, levels=LEGACY_SHARD_LEVELS)
    assert path.read_bytes()[HEADER_SIZE:HEADER_SIZE + 3] == b"abc"


def test_writers_racing_to_make_one_new_shard_all_publish(engine_for, tmp_path: Path) -> None:
    """Both writer threads make the same missing leaf at once (one ``mkdirat`` wins, the other
    opens what it made): every chunk is published and the leaf has exactly its mode."""
    engine = engine_for()
    payload = memoryview(payload_for(BLOCK_SIZE))
    digests = in_one_shard(8, "abcd")
    for round_ in range(20):
        root = tmp_path / f"root{round_}"
        (root / "ns" / NS_ID / "ab").mkdir(parents=True)  # the first level, not ``cd``
        share = write_share(root, [payload] * 8, [f"k{i}" for i in range(8)], digests=digests,
                            levels=LEGACY_SHARD_LEVELS)
        old = os.umask(0o077)
        try:
            batch = write_now(engine, [share])
        finally:
            os.umask(old)
        assert batch.statuses == bytes([seam.OK] * 8), batch.details
        leaf = root / "ns" / NS_ID / "ab" / "cd"
        assert stat.S_IMODE(leaf.stat().st_mode) == 0o750
        assert sorted(p.name for p in leaf.iterdir()) == sorted(d + CHUNK_SUFFIX for d in digests)


def test_a_stale_temp_file_is_replaced(engine_for, tmp_path: Path) -> None:
    path = chunk_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.with_name(path.name + TEMP_SUFFIX).write_bytes(b"left by a dead writer")
    assert write_now(engine_for(), [write_share(tmp_path, [memoryview(b"abc")])]).statuses == \
        bytes([seam.OK])
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_write_removes_its_victims_first(engine_for, tmp_path: Path) -> None:
    path = chunk_path(tmp_path)
    shard = path.parent
    shard.mkdir(parents=True)
    for name in ("old1.kv", "old2.kv"):
        (shard / name).write_bytes(b"evicted")
    rel = shard.relative_to(tmp_path)
    victims = (f"{rel}/old1.kv", f"{rel}/old2.kv", f"{rel}/already-gone.kv")
    batch = write_now(engine_for(), [write_share(tmp_path, [memoryview(b"new")],
                                                 victims=victims)])
    assert batch.statuses == bytes([seam.OK])
    assert [p.name for p in shard.iterdir()] == [path.name]


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
    victim = layouts[1].chunk_rel(NS_ID, key_digest("old"))
    (roots[1] / victim).parent.mkdir(parents=True)
    (roots[1] / victim).write_bytes(b"evicted")
    for root in roots:
        root.mkdir(exist_ok=True)
    shares = [write_share(root, [memoryview(payloads[k]) for k in mine], mine, levels=levels,
                          victims=(victim,) if root == roots[1] else ())
              for root, mine in zip(roots, keys, strict=True)]
    batch = write_now(engine_for(), shares)
    assert len(batch.statuses) == 8  # published, and the namespace made on root a
    assert set(batch.statuses) <= {seam.OK, seam.NEW_NAMESPACE}
    assert seam.NEW_NAMESPACE in batch.statuses[:5]
    assert not (roots[1] / victim).exists()
    for root, layout, mine in zip(roots, layouts, keys, strict=True):
        for k in mine:
            path = root / layout.chunk_rel(NS_ID, key_digest(k))
            data = path.read_bytes()
            n = len(payloads[k])
            assert data[HEADER_SIZE:HEADER_SIZE + n] == payloads[k]
            assert judge_chunk(data[:HEADER_SIZE], Expected(key=k, payload_len=n,
                                                            meta=meta_for(n),
                                                            file_size=len(data))).ok
            assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_failed_chunk_of_a_share_is_reported_at_its_place_in_the_batch(
        engine_for, tmp_path: Path) -> None:
    """The chunks of a batch are numbered share by share: the third chunk of the second
    share is chunk 4."""
    layout = RootLayout(tmp_path)
    blocked = tmp_path / layout.shard_rel(NS_ID, key_digest("k2"))
    blocked.parent.mkdir(parents=True)
    blocked.write_bytes(b"a file where the shard directory goes")
    first = write_share(tmp_path, [memoryview(b"abc")] * 2, ["j0", "j1"])
    second = write_share(tmp_path, [memoryview(b"abc")] * 3, ["k0", "k1", "k2"])
    batch = write_now(engine_for(), [first, second])
    assert batch.statuses[4] == seam.FAILED and batch.details[-1][:2] == (4, seam.FAILED)
    assert set(batch.statuses[:4]) <= {seam.OK, seam.NEW_NAMESPACE}
    assert all(chunk_path(tmp_path, k).exists() for k in ["j0", "j1", "k0", "k1"])


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda s: (1, 2), TypeError, r"share 1 is not a tuple of 13 \(a write share\)"),
    (lambda s: s[:12], TypeError, "share 1 is not a tuple of 13"),
    (lambda s: s[:9] + (["a" * 32, "xyz"],) + s[10:], ValueError, "not lowercase hex"),
    (lambda s: s[:9] + (["A" * 32, "b" * 32],) + s[10:], ValueError, "not lowercase hex"),
    (lambda s: s[:9] + ([7, "b" * 32],) + s[10:], TypeError, "share 1: digest 0 must be str"),
    (lambda s: s[:11] + (s[11][:1],) + s[12:], TypeError,
     "share 1: digests, payloads and keys must be lists of one length"),
    (lambda s: s[:11] + ([b"k", "k"],) + s[12:], TypeError, "share 1: key 1 must be bytes"),
    (lambda s: s[:10] + ([s[10][0], 7],) + s[11:], TypeError, "bytes-like"),
    (lambda s: s[:2] + ("ns",) + s[3:], TypeError, "share 1: namespace must be bytes, not str"),
    (lambda s: s[:3] + ("{}",) + s[4:], TypeError, "share 1: meta must be bytes, not str"),
    (lambda s: s[:5] + (1 << 40,) + s[6:], OverflowError, "share 1: mode is out of range"),
    (lambda s: s[:7] + ("0",) + s[8:], TypeError, "share 1: fsync_level must be an int"),
    (lambda s: s[:1] + (("ns/x/", 3, ".kv", ".tmp"),) + s[2:], ValueError, "shard_levels"),
    (lambda s: s[:1] + (("ns/x/", 1, ".kv"),) + s[2:], TypeError,
     r"share 1: naming is \(shard_prefix, shard_levels, final_suffix, temp_suffix\)"),
    (lambda s: s[:1] + (("ns/x\0/", 1, ".kv", ".tmp"),) + s[2:], ValueError, "NUL"),
    (lambda s: s[:1] + (("ns/x/", 1, ".kv", ".tmp\0"),) + s[2:], ValueError, "NUL"),
    (lambda s: s[:8] + (["v"],) + s[9:], TypeError, "share 1: victims must be a tuple, not list"),
    (lambda s: s[:8] + (("ns/v\0",),) + s[9:], ValueError, "share 1: victim 0 is not a path"),
    (lambda s: s[:8] + ((b"ns/v",),) + s[9:], ValueError, "share 1: victim 0 is not a path"),
    (lambda s: s[:9] + ([], [], []) + s[12:], ValueError, "share 1 has no chunks"),
    (lambda s: s[:12] + ((1, 2),), TypeError,
     "share 1: gpu_checksums must be None or a list, not tuple"),
    (lambda s: s[:12] + ([(1, 2)],), ValueError,
     "share 1: gpu_checksums holds 1 pairs for 2 chunks"),
    (lambda s: s[:12] + ([(1, 2), (3,)],), TypeError,
     r"share 1: gpu_checksums\[1\] must be an \(a, b\) tuple of ints"),
    (lambda s: s[:12] + ([(1, 2), [3, 4]],), TypeError, r"gpu_checksums\[1\] must be an \(a, b\)"),
    (lambda s: s[:12] + ([(1, 2), (-1, 0)],), ValueError,
     r"share 1: gpu_checksums\[1\] must hold unsigned 64-bit ints"),
    (lambda s: s[:12] + ([(1, 2), (0, 2**64)],), ValueError, r"gpu_checksums\[1\] must hold"),
], ids=["shape", "twelve", "short-digest", "upper-digest", "digest-type", "lengths", "key-type",
        "payload", "namespace", "meta", "mode", "fsync", "levels", "naming", "nul-prefix",
        "nul-suffix", "victims", "victim-nul", "victim-type", "empty", "gpu-type", "gpu-count",
        "gpu-pair", "gpu-list", "gpu-negative", "gpu-range"])
def test_a_malformed_write_share_is_refused_clearly_and_writes_nothing(
        engine_for, tmp_path: Path, change: Callable[[tuple], object], error: type[Exception],
        message: str) -> None:
    views = [memoryview(bytearray(b"abc")) for _ in range(3)]
    first = write_share(tmp_path, views[:1], ["first"], gpu=[(1, 2)])
    share = write_share(tmp_path, views[1:], ["k0", "k1"])
    with pytest.raises(error, match=message):
        engine_for().submit_write([first, change(share)],  # type: ignore[list-item]
                                  lambda batch: None)
    del first, share
    for view in views:
        view.release()  # BufferError if the batch still held a payload
    assert not (tmp_path / "ns").exists()


def test_a_write_batch_keeps_its_columns_as_they_were_submitted(engine_for, tmp_path: Path
                                                                 ) -> None:
    """A caller that reuses its lists once it submitted changes nothing of the batch: the
    engine copied each share's columns, and the keys its writers put in the headers stay
    alive until the batch is done."""
    (tmp_path / "ns" / NS_ID).mkdir(parents=True)
    keys = [f"key {i} " * 40 for i in range(8)]
    payloads = [random.Random(i).randbytes(BLOCK_SIZE) for i in range(8)]
    digests, views, encoded = ([key_digest(k) for k in keys], [memoryview(p) for p in payloads],
                               [k.encode() for k in keys])
    share = write_share(tmp_path, views, keys)
    share = share[:9] + (digests, views, encoded) + share[12:]
    done = Done()
    engine_for().submit_write([share], done("write"))
    for column in (digests, views, encoded):
        column.clear()
    del share
    gc.collect()
    assert done.wait_for(1)["write"].statuses == bytes([seam.OK] * 8)
    for key, payload in zip(keys, payloads, strict=True):
        data = chunk_path(tmp_path, key).read_bytes()
        n = len(payload)
        assert data[HEADER_SIZE:HEADER_SIZE + n] == payload
        assert judge_chunk(data[:HEADER_SIZE], Expected(key=key, payload_len=n, meta=meta_for(n),
                                                        file_size=len(data))).ok


def test_a_read_share_changed_while_its_batch_is_made_is_read_as_it_was(
        engine_for, tmp_path: Path) -> None:
    """Python code that runs while the engine reads a share's fields (here the fd's
    ``__index__``) and empties its lists cannot reach the batch: its columns were copied."""
    n = 8192
    keys = [f"c{i}" for i in range(4)]
    for key in keys:
        write_python(tmp_path, payload_for(n), key=key)
    dests = [dest_for(n, "aligned") for _ in keys]
    share = read_share(tmp_path, list(dests), n, keys)
    fd = share[0]

    class EmptiesTheLists:
        def __index__(self) -> int:
            for column in share[5:]:
                column.clear()
            return fd

    batch = engine_for().read([(EmptiesTheLists(), *share[1:])])
    assert batch == (bytes([seam.OK] * 4), [])
    assert all(bytes(dest[:n]) == payload_for(n) for dest in dests)


@pytest.mark.parametrize("depth", [3, 2, 1], ids=["leaf", "first-level", "namespace"])
def test_a_link_in_the_tree_is_never_followed_by_a_write(engine_for, tmp_path: Path,
                                                         depth: int) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    made = Path(RootLayout(tmp_path, LEGACY_SHARD_LEVELS).shard_rel(NS_ID, key_digest("k")))
    planted = tmp_path.joinpath(*made.parts[:depth])
    planted.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(elsewhere, planted)
    statuses, details = write_now(engine_for(), [
        write_share(tmp_path, [memoryview(b"abc")], levels=LEGACY_SHARD_LEVELS)])
    assert statuses == bytes([seam.FAILED]) and details[0][2] in (errno.ELOOP, errno.ENOTDIR)
    assert list(elsewhere.iterdir()) == []


# -- a read call's chunks as shares ----------------------------------------------------------


@pytest.mark.parametrize("levels", [SHARD_LEVELS, LEGACY_SHARD_LEVELS])
@pytest.mark.parametrize("wait", [True, False], ids=["read", "submit_read"])
def test_a_read_share_finds_each_chunk_where_the_layout_names_it(
        engine_for, tmp_path: Path, levels: int, wait: bool) -> None:
    """Chunks written where ``chunk_rel`` names them come back whole through one share (the
    engine made each path from the digest and the root's naming), one missing file failed
    at its place with ENOENT, a buffer that is not 4 KiB aligned filled all the same."""
    keys = [f"r{i}" for i in range(5)]
    payloads = [random.Random(k).randbytes(BLOCK_SIZE + 4097) for k in keys]
    engine = engine_for(task_size=BLOCK_SIZE)  # several pieces per chunk
    written = write_now(engine, [write_share(tmp_path, [memoryview(p) for p in payloads], keys,
                                             levels=levels)])
    assert set(written.statuses) <= {seam.OK, seam.NEW_NAMESPACE}
    n = len(payloads[0])
    dests = [dest_for(n, "aligned" if i % 2 else "staged") for i in range(6)]
    share = read_share(tmp_path, dests, n, [*keys, "never-written"], levels=levels)
    if wait:
        batch = engine.read([share])
    else:
        done = Done()
        engine.submit_read([share], done("read"))
        batch = done.wait_for(1)["read"]
    assert bytes(batch.statuses) == bytes([seam.OK] * 5 + [seam.FAILED])
    assert [d[:2] for d in batch.details] == [(5, errno.ENOENT)]
    assert [bytes(dest[:n]) for dest in dests[:5]] == payloads


@pytest.mark.parametrize("wait", [True, False], ids=["read", "submit_read"])
def test_the_chunks_of_several_read_shares_are_numbered_across_the_batch(
        engine_for, tmp_path: Path, wait: bool) -> None:
    """Three shares (two roots, one layout each, and an empty share between): their chunks
    come back share by share, each failure or verdict at its place in the batch."""
    roots = [tmp_path / "a", tmp_path / "b"]
    levels = [SHARD_LEVELS, LEGACY_SHARD_LEVELS]
    keys = [["a0", "a1"], ["b0", "b1"]]
    engine = engine_for()
    for root, level, mine in zip(roots, levels, keys, strict=True):
        root.mkdir()
        payloads = [memoryview(random.Random(k).randbytes(9000)) for k in mine]
        write_now(engine, [write_share(root, payloads, mine, levels=level)])
    b1 = chunk_path(roots[1], "b1", LEGACY_SHARD_LEVELS)
    b1.write_bytes(chunk_path(roots[1], "b0", LEGACY_SHARD_LEVELS).read_bytes())  # b0's chunk
    dests = [dest_for(9000, "aligned") for _ in range(5)]
    shares = [read_share(roots[0], dests[:3], 9000, ["a0", "missing", "a1"]),
              read_share(roots[1], [], 9000, []),
              read_share(roots[1], dests[3:], 9000, ["b0", "b1"], levels=LEGACY_SHARD_LEVELS)]
    if wait:
        batch = engine.read(shares)
    else:
        done = Done()
        engine.submit_read(shares, done("read"))
        batch = done.wait_for(1)["read"]
    assert batch.statuses == bytes([seam.OK, seam.FAILED, seam.OK, seam.OK, seam.JUDGE])
    assert [d[:2] for d in batch.details] == [(1, errno.ENOENT), (4, 0)]
    assert [bytes(dests[i][:9000]) for i in (0, 2, 3)] == \
        [random.Random(k).randbytes(9000) for k in ("a0", "a1", "b0")]


def test_a_read_share_checks_each_key_and_its_metadata(engine_for, tmp_path: Path) -> None:
    """A file at a chunk's path that holds another key (or was written with other
    metadata) is not served: the engine hands it back to be judged."""
    engine = engine_for()
    payload = memoryview(b"x" * 9000)
    write_now(engine, [write_share(tmp_path, [payload, payload], ["a", "b"])])
    chunk_path(tmp_path, "b").write_bytes(chunk_path(tmp_path, "a").read_bytes())
    dests = [dest_for(9000, "aligned") for _ in range(2)]
    batch = engine.read([read_share(tmp_path, dests, 9000, ["a", "b"])])
    assert batch.statuses[0] == seam.OK and batch.statuses[1] == seam.JUDGE
    other = read_share(tmp_path, dests[:1], 9000, ["a"])
    other = other[:4] + (meta_for(4500).to_json(),) + other[5:]  # the right key, other layout
    assert engine.read([other]).statuses[0] == seam.JUDGE


def test_writes_submitted_from_several_threads_at_once(engine_for, tmp_path: Path) -> None:
    engine = engine_for()
    (tmp_path / "ns" / NS_ID).mkdir(parents=True)
    payloads = {f"k{i}": payload_for(BLOCK_SIZE + i) for i in range(8)}

    def write(key: str) -> None:
        share = write_share(tmp_path, [memoryview(payloads[key])], [key])
        assert write_now(engine, [share]).statuses == bytes([seam.OK])

    threads = [threading.Thread(target=write, args=(k,)) for k in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, payload in payloads.items():
        data = chunk_path(tmp_path, key).read_bytes()
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
        assert engine.read([read_share(tmp_path, dests, n, ["k"] * 3)]).statuses == \
            bytes([seam.OK]) * 3
        engine.submit_write([write_share(tmp_path, [payload], [f"w{i}"])], done(i))
    batches = done.wait_for(rounds)
    assert {i: b.details for i, b in batches.items() if b.statuses != bytes([seam.OK])} == {}
    assert all(chunk_path(tmp_path, f"w{i}").stat().st_size == HEADER_SIZE + 4096
               for i in range(rounds))


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_batch_submitted_while_the_engine_closes_is_refused_or_handed_back(
        tmp_path: Path, kind: str) -> None:
    """A submitter that found the engine open may push its batch only after ``close()`` let
    every worker go, if it lets go of the GIL in between (here: a share whose fd is read
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
    if kind == "read":
        shares: list[tuple[object, ...]] = [
            (closing, *read_share(tmp_path, [dest_for(n, "aligned")], n)[1:])]
        submit = engine.submit_read_shares
    else:
        shares = [(closing, *write_share(tmp_path, [memoryview(payload_for(n))], ["late"])[1:])]
        submit = engine.submit_shares
    try:
        submit(shares, "late")
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
