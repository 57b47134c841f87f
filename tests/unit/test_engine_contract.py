"""The seam's contract (io/engine.py), one suite run against both engines: the Python one
(io/python_engine.py) and the compiled one (io/native.py).  Real files in tmp_path, roots as
descriptors (``safe_fs.root_descriptor``), names as ``disk.layout`` makes them: each engine
must give the same statuses, details and errnos, and write files the other reads."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.engine_contract import (
    BAD_READS,
    BAD_WRITES,
    NS_ID,
    Done,
    buffer_for,
    flip,
    meta_for,
    payload_for,
    plant,
    read_async,
    read_share,
    rel_of,
    temp_files,
    write_now,
    write_share,
)
from support.prerequisites import missing_prerequisite

from lmcache_nvme_backend.disk.format import (
    BLOCK_SIZE,
    HEADER_SIZE,
    TensorMeta,
    decode_header,
    encode_header,
    padded_length,
    payload_checksum,
)
from lmcache_nvme_backend.disk.layout import key_digest
from lmcache_nvme_backend.disk.safe_fs import root_descriptor
from lmcache_nvme_backend.disk.validate import Defect, Expected, judge_chunk
from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io import native
from lmcache_nvme_backend.io.files import read_failure
from lmcache_nvme_backend.io.python_engine import PythonEngine

Make = Callable[..., seam.ChunkEngine]
ENGINES: dict[str, Make] = {"python": PythonEngine, "native": native.NativeEngine}


@pytest.fixture
def make_engine() -> Iterator[Make]:
    """``make_engine(kind, ...)``: an engine of that kind, closed after the test."""
    made: list[seam.ChunkEngine] = []

    def make(kind: str, task_size: int = BLOCK_SIZE, threads: int = 2,
             write_threads: int = 2) -> seam.ChunkEngine:
        if kind == "native" and not native.available():
            missing_prerequisite(native.unavailable_reason())
        made.append(ENGINES[kind](threads, write_threads, task_size))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest, make_engine: Make) -> seam.ChunkEngine:
    return make_engine(request.param)


# -- round trips ----------------------------------------------------------------------------

SIZES = [0, 1, 5000, BLOCK_SIZE, 3 * BLOCK_SIZE + 4097]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("kind", ["aligned", "unaligned"])
@pytest.mark.parametrize("n", SIZES)
def test_what_is_written_reads_back_byte_exact(engine: seam.ChunkEngine, tmp_path: Path,
                                               n: int, kind: str, direct: bool) -> None:
    payload = payload_for(n)
    source = buffer_for(n, kind)[:n]
    source[:] = payload
    written = write_now(engine, [write_share(tmp_path, ["k"], [source], direct=direct,
                                             fsync=2)])
    assert written.statuses == bytes([seam.NEW_NAMESPACE]) and \
        written.details == [(0, seam.NEW_NAMESPACE, 0)]
    data = (tmp_path / rel_of(tmp_path, "k")).read_bytes()
    assert len(data) == HEADER_SIZE + padded_length(n) and set(data[HEADER_SIZE + n:]) <= {0}
    assert judge_chunk(data[:HEADER_SIZE], Expected(key="k", payload_len=n,
                                                    file_size=len(data))).ok
    for read in (engine.read, lambda shares: read_async(engine, shares)):
        dest = buffer_for(n, kind)
        batch = read([read_share(tmp_path, ["k"], [dest], n, direct=direct)])
        assert (batch.statuses, batch.details) == (bytes([seam.OK]), [])
        assert bytes(dest[:n]) == payload


def test_several_shares_in_one_batch_come_back_in_order(engine: seam.ChunkEngine,
                                                        tmp_path: Path) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    keys = [["a0", "a1", "a2"], ["b0", "b1"]]
    payloads = {k: payload_for(9000, seed=i) for i, k in enumerate(keys[0] + keys[1])}
    (roots[1] / "ns" / NS_ID).mkdir(parents=True)  # not new on root b
    written = write_now(engine, [write_share(root, mine, [payloads[k] for k in mine])
                                 for root, mine in zip(roots, keys, strict=True)])
    assert set(written.statuses[:3]) <= {seam.OK, seam.NEW_NAMESPACE}
    assert seam.NEW_NAMESPACE in written.statuses[:3] and written.statuses[3:] == bytes(2)
    dests = [buffer_for(9000, "aligned") for _ in range(6)]
    shares = [read_share(roots[0], ["a0", "gone", "a2"], dests[:3], 9000),
              read_share(roots[1], ["b0", "b1", "a1"], dests[3:], 9000)]
    for batch in (engine.read(shares), read_async(engine, shares)):
        assert batch.statuses == bytes([0, seam.FAILED, 0, 0, 0, seam.FAILED])
        assert batch.details == [(1, errno.ENOENT, None, 0), (5, errno.ENOENT, None, 0)]
        assert [bytes(dests[i][:9000]) for i in (0, 2, 3, 4)] == \
            [payloads[k] for k in ("a0", "a2", "b0", "b1")]


# -- what cannot be served ------------------------------------------------------------------


@pytest.mark.parametrize("wrong,defect", [("key", Defect.WRONG_KEY), ("meta", Defect.WRONG_META),
                                          ("payload", Defect.CHECKSUM)])
def test_what_the_quick_check_refuses_comes_back_to_be_judged(
        engine: seam.ChunkEngine, tmp_path: Path, wrong: str, defect: Defect) -> None:
    n = 2 * BLOCK_SIZE + 10
    write_now(engine, [write_share(tmp_path, ["k"], [payload_for(n)])])
    path = tmp_path / rel_of(tmp_path, "k")
    if wrong == "payload":
        flip(path, HEADER_SIZE + BLOCK_SIZE + 3)
    meta = meta_for(n, "int8" if wrong == "meta" else "uint8")
    share = read_share(tmp_path, ["k"], [buffer_for(n, "aligned")], n, meta=meta,
                       as_keys=["other"] if wrong == "key" else None)
    batch = engine.read([share])
    assert batch.statuses == bytes([seam.JUDGE])
    [(index, err, header, computed)] = batch.details
    assert (index, err, header) == (0, 0, path.read_bytes()[:HEADER_SIZE])
    expected = Expected(key="other" if wrong == "key" else "k", payload_len=n,
                        meta=TensorMeta.from_json(meta))
    verdict = judge_chunk(header, expected, lambda h: h.payload_checksum == computed)
    assert verdict.defect is defect


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
def test_a_version_1_file_is_checked_over_the_whole_payload(engine: seam.ChunkEngine,
                                                            tmp_path: Path, damaged: bool) -> None:
    n = 2 * BLOCK_SIZE + 3
    payload = payload_for(n)
    path = tmp_path / rel_of(tmp_path, "k")
    path.parent.mkdir(parents=True)
    header = encode_header("k", "ns", TensorMeta.from_json(meta_for(n)), n,
                           payload_checksum(payload, version=1), version=1)
    body = bytearray(payload + bytes(padded_length(n) - n))
    body[BLOCK_SIZE + 1] ^= int(damaged)
    path.write_bytes(header + body)
    dest = buffer_for(n, "aligned")
    batch = engine.read([read_share(tmp_path, ["k"], [dest], n)])
    assert bytes(dest[:n]) == body[:n]
    if not damaged:
        assert batch == seam.Batch(bytes([seam.OK]), [])
    else:
        assert batch == seam.Batch(bytes([seam.JUDGE]), [
            (0, 0, header, payload_checksum(bytes(body[:n]), version=1))])


@pytest.mark.timeout(60)  # a FIFO must never block a reader
@pytest.mark.parametrize("what", ["missing", "link", "linked-dir", "fifo", "directory", "short"])
def test_failures_come_back_with_their_errno(engine: seam.ChunkEngine, tmp_path: Path,
                                             what: str) -> None:
    key, errnos, exception = plant(tmp_path, what)
    batch = engine.read([read_share(tmp_path, [key], [buffer_for(8192, "aligned")], 8192)])
    assert batch.statuses == bytes([seam.FAILED])
    [(index, err, header, computed)] = batch.details
    assert (index, header, computed) == (0, None, 0) and err in errnos
    failure = read_failure(tmp_path / rel_of(tmp_path, key), err)
    assert type(failure) is exception and failure.errno == err


# -- writes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("writer,reader", [("python", "native"), ("native", "python")])
def test_what_one_engine_writes_the_other_reads(make_engine: Make, tmp_path: Path,
                                                writer: str, reader: str) -> None:
    keys = [f"k{i}" for i in range(4)]
    sizes = [0, 4097, BLOCK_SIZE, 2 * BLOCK_SIZE + 1]
    shares = [write_share(tmp_path, [k], [payload_for(n)], gpu=[(n, 7)])
              for k, n in zip(keys, sizes, strict=True)]
    written = write_now(make_engine(writer), shares)
    assert all(s in (seam.OK, seam.NEW_NAMESPACE) for s in written.statuses)
    dests = [buffer_for(n, "unaligned") for n in sizes]
    batch = make_engine(reader).read([read_share(tmp_path, [k], [d], n)
                                      for k, d, n in zip(keys, dests, sizes, strict=True)])
    assert (batch.statuses, batch.details) == (bytes(4), [])
    assert [bytes(d[:n]) for d, n in zip(dests, sizes, strict=True)] == \
        [payload_for(n) for n in sizes]


@pytest.mark.parametrize("existing,status", [
    ("", seam.NEW_NAMESPACE), ("ns", seam.NEW_NAMESPACE), (f"ns/{NS_ID}", seam.OK)])
def test_new_namespace_only_when_the_write_made_its_directory(
        engine: seam.ChunkEngine, tmp_path: Path, existing: str, status: int) -> None:
    (tmp_path / existing).mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        first = write_now(engine, [write_share(tmp_path, ["k"], [b"abc"])])
        again = write_now(engine, [write_share(tmp_path, ["other"], [b"def"])])
    finally:
        os.umask(old)
    assert (first.statuses, first.details) == \
        (bytes([status]), [] if status == seam.OK else [(0, status, 0)])
    assert (again.statuses, again.details) == (bytes([seam.OK]), [])
    made = Path(rel_of(tmp_path, "k")).parent
    for depth in range(len(Path(existing).parts) if existing else 0, len(made.parts)):
        assert stat.S_IMODE(tmp_path.joinpath(*made.parts[: depth + 1]).stat().st_mode) == 0o750


@pytest.mark.parametrize("umask", [0o077, 0o022])
@pytest.mark.parametrize("gpu", [None, (1, 2**64 - 1)])
def test_mode_is_exact_and_the_gpu_checksum_lands_in_the_header(
        engine: seam.ChunkEngine, tmp_path: Path, umask: int, gpu: tuple[int, int] | None
        ) -> None:
    old = os.umask(umask)
    try:
        batch = write_now(engine, [write_share(tmp_path, ["k"], [b"x" * 10], mode=0o604,
                                               gpu=None if gpu is None else [gpu])])
    finally:
        os.umask(old)
    assert batch.statuses == bytes([seam.NEW_NAMESPACE])
    path = tmp_path / rel_of(tmp_path, "k")
    assert stat.S_IMODE(path.stat().st_mode) == 0o604
    assert decode_header(path.read_bytes()[:HEADER_SIZE]).gpu_checksum == gpu


def test_victims_go_before_the_first_write_and_links_are_never_followed(
        engine: seam.ChunkEngine, tmp_path: Path) -> None:
    outside = tmp_path / "outside.kv"
    outside.write_bytes(b"not ours")
    victims = [rel_of(tmp_path, v) for v in ("old1", "old2", "linked", "already-gone")]
    for rel in victims[:2]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"evicted")
    (tmp_path / victims[2]).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, tmp_path / victims[2])
    batch = write_now(engine, [write_share(tmp_path, ["new"], [b"n"], victims=tuple(victims))])
    assert batch.statuses[0] in (seam.OK, seam.NEW_NAMESPACE)
    assert not any(os.path.lexists(tmp_path / rel) for rel in victims)
    assert outside.read_bytes() == b"not ours"


@pytest.mark.parametrize("planted_at", ["ns", "ns/NS", "ns/NS/SHARD", "file:ns/NS/SHARD"])
def test_a_write_never_follows_a_link_and_leaves_no_temp(engine: seam.ChunkEngine,
                                                         tmp_path: Path, planted_at: str) -> None:
    """A link (or a file) where a directory of the tree belongs: the write fails with ELOOP
    or ENOTDIR, writes nothing through it and leaves no temp file."""
    shard = Path(rel_of(tmp_path, "k")).parent
    planted = tmp_path / planted_at.removeprefix("file:").replace("NS", NS_ID).replace(
        "SHARD", shard.name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted.parent.mkdir(parents=True, exist_ok=True)
    if planted_at.startswith("file:"):
        planted.write_bytes(b"not a directory")
    else:
        os.symlink(elsewhere, planted)
    batch = write_now(engine, [write_share(tmp_path, ["k"], [b"abc"])])
    assert batch.statuses == bytes([seam.FAILED])
    assert batch.details[0][:2] == (0, seam.FAILED) and \
        batch.details[0][2] in (errno.ELOOP, errno.ENOTDIR)
    assert list(elsewhere.iterdir()) == [] and temp_files(tmp_path) == []


def test_a_failed_write_removes_its_temp_and_a_dead_writers_temp_is_replaced(
        engine: seam.ChunkEngine, tmp_path: Path) -> None:
    shard = (tmp_path / rel_of(tmp_path, "ok")).parent
    shard.mkdir(parents=True)
    (shard / (key_digest("ok") + ".kv.tmp-contract")).write_bytes(b"left by a dead writer")
    too_long = "k" * 5000  # no room in the header: fails after the temp file was made
    batch = write_now(engine, [write_share(tmp_path, ["ok", too_long], [b"abc", b"abc"])])
    assert batch.statuses == bytes([seam.OK, seam.FAILED])
    assert batch.details == [(1, seam.FAILED, errno.EINVAL)]
    assert temp_files(tmp_path) == [] and (tmp_path / rel_of(tmp_path, "ok")).exists()


def test_unlink_removes_files_and_never_follows_a_link(engine: seam.ChunkEngine,
                                                       tmp_path: Path) -> None:
    write_now(engine, [write_share(tmp_path, ["a", "b"], [b"a", b"b"])])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.kv").write_bytes(b"not ours")
    os.symlink(outside, tmp_path / "ns" / NS_ID / "zz")
    fd = root_descriptor(str(tmp_path))
    errors = engine.unlink([(fd, rel_of(tmp_path, "a")), (fd, rel_of(tmp_path, "gone")),
                            (fd, f"ns/{NS_ID}/zz/f.kv"), (fd, rel_of(tmp_path, "b"))])
    assert errors[:2] == [0, errno.ENOENT] and errors[3] == 0
    assert errors[2] in (errno.ELOOP, errno.ENOTDIR)
    assert (outside / "f.kv").exists() and not (tmp_path / rel_of(tmp_path, "a")).exists()
    assert engine.retired_bytes() == 0 and not engine.signal_later(0)


# -- batches, threads and closing ---------------------------------------------------------------


def test_cancel_ends_queued_writes_and_close_finishes_the_rest(make_engine: Make,
                                                               tmp_path: Path) -> None:
    for kind in ENGINES:
        root = tmp_path / kind
        engine = make_engine(kind, write_threads=1)
        done = Done()
        payload = payload_for(BLOCK_SIZE)
        for i in range(20):
            engine.submit_write([write_share(root, [f"c{i}"], [payload], fsync=1)], done(i))
        cancelled = engine.cancel_writes()
        engine.close()
        batches = done.wait_for(20)
        assert sorted(name for name, _ in done.calls) == list(range(20))  # each once
        failed = [i for i in range(20) if batches[i].statuses == bytes([seam.FAILED])]
        assert len(failed) == cancelled > 0
        assert all(batches[i].details == [(0, seam.FAILED, errno.ECANCELED)] for i in failed)
        assert all((root / rel_of(root, f"c{i}")).exists() == (i not in failed)
                   for i in range(20))
        assert engine.cancel_writes() == 0


def test_close_hands_back_every_batch_once_and_then_refuses(engine: seam.ChunkEngine,
                                                            tmp_path: Path) -> None:
    n = BLOCK_SIZE + 1
    write_now(engine, [write_share(tmp_path, ["r"], [payload_for(n)])])
    done = Done()
    for i in range(8):
        engine.submit_read([read_share(tmp_path, ["r"], [buffer_for(n, "aligned")], n)],
                           done(("read", i)))
        engine.submit_write([write_share(tmp_path, [f"w{i}"], [payload_for(n)])],
                            done(("write", i)))
    engine.submit_read([], done("no reads"))
    engine.submit_write([], done("no writes"))
    engine.close()
    batches = done.wait_for(18)
    assert len(done.calls) == 18 and len(batches) == 18
    assert all(threading.get_ident() != ident for _, ident in done.calls)
    assert batches["no reads"] == batches["no writes"] == seam.Batch(b"", [])
    assert all(batches[("read", i)].statuses == bytes([seam.OK]) for i in range(8))
    assert all(batches[("write", i)].statuses == bytes([seam.OK]) for i in range(8))
    with pytest.raises(RuntimeError, match="closed"):
        engine.read([])
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_write([write_share(tmp_path, ["late"], [b"x"])], done("late"))


def test_a_callback_that_raises_kills_no_thread(engine: seam.ChunkEngine, tmp_path: Path
                                               ) -> None:
    def fails(batch: seam.Batch) -> None:
        raise ValueError("a broken callback")

    for i in range(3):
        engine.submit_write([write_share(tmp_path, [f"k{i}"], [b"abc"])], fails)
        engine.submit_read([], fails)
    batch = write_now(engine, [write_share(tmp_path, ["after"], [b"abc"])])
    assert batch.statuses[0] in (seam.OK, seam.NEW_NAMESPACE)
    assert read_async(engine, []) == seam.Batch(b"", [])


def test_buffers_are_let_go_before_a_batch_is_handed_back(engine: seam.ChunkEngine,
                                                          tmp_path: Path) -> None:
    """The owner of a payload or destination may free or resize it in ``on_done`` (or once
    ``read`` returns): the engine holds no view of it any more."""
    n = 3 * 4096 + 5
    source, dest, other = bytearray(payload_for(n)), bytearray(n + 4096), bytearray(n)
    resized: list[object] = []
    submitted, handed_back = threading.Event(), threading.Semaphore(0)

    def resize(buf: bytearray) -> seam.OnDone:
        def on_done(batch: seam.Batch) -> None:
            submitted.wait(10)  # the submitting call's own references are gone
            try:
                buf.extend(b"x")
                resized.append(batch.statuses)
            except BufferError as exc:
                resized.append(exc)
            handed_back.release()
        return on_done

    engine.submit_write([write_share(tmp_path, ["k"], [source])], resize(source))
    submitted.set()
    assert handed_back.acquire(timeout=30)
    assert engine.read([read_share(tmp_path, ["k"], [memoryview(other)], n)]).statuses == \
        bytes([seam.OK])
    other.extend(b"x")
    submitted.clear()
    engine.submit_read([read_share(tmp_path, ["k"], [memoryview(dest)], n)], resize(dest))
    submitted.set()
    assert handed_back.acquire(timeout=30)
    assert resized == [bytes([seam.NEW_NAMESPACE]), bytes([seam.OK])]
    assert dest[:n] == other[:n] == source[:n]


def test_writers_run_at_nice_10(engine: seam.ChunkEngine) -> None:
    ids = engine.writer_thread_ids()
    assert len(ids) == 2 and all(os.getpriority(os.PRIO_PROCESS, tid) == 10 for tid in ids)


# -- malformed batches ---------------------------------------------------------------------------

@pytest.mark.parametrize("after_a_good_share", [False, True], ids=["alone", "second"])
@pytest.mark.parametrize("case", list(BAD_READS))
def test_a_malformed_read_share_is_refused_before_anything_runs(
        engine: seam.ChunkEngine, tmp_path: Path, case: str, after_a_good_share: bool) -> None:
    change, error, message = BAD_READS[case]
    good = read_share(tmp_path, ["a"], [buffer_for(8192, "aligned")], 8192)
    bad = change(read_share(tmp_path, ["b"], [buffer_for(8192, "aligned")], 8192))
    with pytest.raises(error, match=message):
        engine.read([good, bad] if after_a_good_share else [bad])


@pytest.mark.parametrize("case", list(BAD_WRITES))
def test_a_malformed_write_share_is_refused_and_writes_nothing(
        engine: seam.ChunkEngine, tmp_path: Path, case: str) -> None:
    change, error, message = BAD_WRITES[case]
    victim = tmp_path / "victim.kv"
    victim.write_bytes(b"kept")
    share = write_share(tmp_path, ["k"], [b"abc"], victims=("victim.kv",))
    with pytest.raises(error, match=message):
        engine.submit_write([change(share)], lambda batch: None)
    assert victim.exists() and not (tmp_path / "ns").exists()
