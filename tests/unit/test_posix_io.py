"""io/posix.py on a real filesystem: chunk files written and read in pieces (what the Python
engine is built from), bytes on disk, headers, buffers, O_DIRECT.  How a batch of chunks
fares is tests/unit/test_engine_contract.py."""

from __future__ import annotations

import errno
import gc
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_nvme_backend.disk.format import HEADER_SIZE, TensorMeta, encode_header, padded_length
from lmcache_nvme_backend.disk.safe_fs import create_in
from lmcache_nvme_backend.io import buffers as buffers_mod
from lmcache_nvme_backend.io import posix as posix_io
from lmcache_nvme_backend.io.buffers import AlignedBuffer, is_aligned
from lmcache_nvme_backend.io.files import open_for_read
from lmcache_nvme_backend.io.posix import (
    NotAChunkFile,
    ShortFileError,
    probe_direct_io,
    read_chunk,
    read_header,
    write_chunk,
)

TASK_SIZE = 8192
MIB = 1 << 20
SIZES = [1, 4095, 4096, 4097, 3 * MIB + 17]
GUARD = 0xA5


def payload_for(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes with no zero runs, so padding and offsets errors always show."""
    data = bytearray(random.Random(n * 1000 + seed).randbytes(n))
    data[::251] = b"\x01" * len(data[::251])
    return bytes(data)


def header_for(n: int, key: str = "k") -> bytes:
    meta = TensorMeta(shapes=((n,),), dtypes=("uint8",), fmt=1, nbytes=n)
    return encode_header(key, "ns", meta, n, 0x0123456789ABCDEF, created_unix_ns=1)


@pytest.fixture
def buffers() -> Iterator[Callable[[int], AlignedBuffer]]:
    """Aligned buffers that are closed after the test."""
    made: list[AlignedBuffer] = []

    def make(size: int) -> AlignedBuffer:
        buf = AlignedBuffer(size)
        made.append(buf)
        return buf

    yield make
    gc.collect()  # request errors keep tracebacks (and so views of these buffers) in cycles
    for buf in made:
        buf.close()


Dest = tuple[memoryview, Callable[[], None]]


@pytest.fixture
def make_dest(buffers: Callable[[int], AlignedBuffer]) -> Callable[[str, int], Dest]:
    """A destination of the given kind, plus a check that no byte outside it was touched."""

    def make(kind: str, n: int) -> Dest:
        if kind == "unaligned":
            backing = bytearray([GUARD]) * (n + 2)
            view = memoryview(backing)[1 : n + 1]
            assert not is_aligned(view)

            def check() -> None:
                assert backing[0] == GUARD and backing[-1] == GUARD

            return view, check
        buf = buffers(n + 4096)
        buf.view[:] = bytes([GUARD]) * len(buf.view)
        if kind == "aligned_padded":
            return buf.view[: padded_length(n)], lambda: None
        assert kind == "aligned_exact"

        def check_exact() -> None:
            assert bytes(buf.view[n:]) == bytes([GUARD]) * (len(buf.view) - n)

        return buf.view[:n], check_exact

    return make


def create(path: Path, direct: bool, mode: int = 0o600) -> int:
    """A new chunk file in ``path``'s directory, as the Python engine creates its temp files."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return create_in(dir_fd, path.name, mode, os.O_WRONLY | (os.O_DIRECT if direct else 0))
    finally:
        os.close(dir_fd)


def write(path: Path, payload: bytes, direct: bool, source: memoryview | None = None,
          mode: int = 0o600) -> bytes:
    header = header_for(len(payload), key=path.name)
    fd = create(path, direct, mode)
    try:
        write_chunk(fd, header, source if source is not None else memoryview(payload), direct,
                    TASK_SIZE)
    finally:
        os.close(fd)
    return header


def read_back(path: Path, n: int, dest: memoryview, direct: bool) -> bytes:
    """Read a chunk file into ``dest``, as a Python engine reader does; its header."""
    fd, size = open_for_read(path, direct)
    try:
        return read_chunk(fd, size, dest, n, direct, TASK_SIZE, str(path))
    finally:
        os.close(fd)


def assert_file_bytes(path: Path, header: bytes, payload: bytes) -> None:
    raw = path.read_bytes()
    assert len(raw) == HEADER_SIZE + padded_length(len(payload))
    assert raw[:HEADER_SIZE] == header
    assert raw[HEADER_SIZE : HEADER_SIZE + len(payload)] == payload
    assert raw[HEADER_SIZE + len(payload) :] == bytes(padded_length(len(payload)) - len(payload))


# -- writes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("source", ["bytes", "aligned", "unaligned"])
@pytest.mark.parametrize("n", SIZES)
def test_write_produces_documented_file(tmp_path: Path,
                                        buffers: Callable[[int], AlignedBuffer], direct: bool,
                                        source: str, n: int) -> None:
    payload = payload_for(n)
    if source == "aligned":
        buf = buffers(n)
        buf.view[:n] = payload
        view = buf.view[:n]
    elif source == "unaligned":
        view = memoryview(bytearray(b"\x00" + payload))[1:]
    else:
        view = memoryview(payload)
    path = tmp_path / "c.kv"
    header = write(path, payload, direct, view)
    assert_file_bytes(path, header, payload)
    assert os.stat(path).st_size == HEADER_SIZE + padded_length(n)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_write_applies_mode(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "m.kv"
    old = os.umask(0)
    try:
        write(path, b"abc", direct, mode=0o640)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o640


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_write_refuses_existing_file(tmp_path: Path,
                                     direct: bool) -> None:
    path = tmp_path / "x.kv"
    header = write(path, payload_for(100), direct)
    with pytest.raises(FileExistsError):
        write(path, payload_for(200, seed=1), direct)
    assert_file_bytes(path, header, payload_for(100))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("target_exists", [True, False])
def test_write_does_not_follow_symlink(tmp_path: Path, direct: bool,
                                       target_exists: bool) -> None:
    target = tmp_path / "victim"
    if target_exists:
        target.write_bytes(b"precious")
    link = tmp_path / "l.kv"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        write(link, payload_for(10), direct)
    assert link.is_symlink()
    if target_exists:
        assert target.read_bytes() == b"precious"
    else:
        assert not target.exists()


# -- reads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("dest_kind", ["aligned_padded", "aligned_exact", "unaligned"])
@pytest.mark.parametrize("n", SIZES)
def test_round_trip(tmp_path: Path, make_dest, direct: bool,
                    dest_kind: str, n: int) -> None:
    payload = payload_for(n)
    path = tmp_path / "r.kv"
    header = write(path, payload, direct)
    dest, untouched_outside = make_dest(dest_kind, n)
    assert read_back(path, n, dest, direct) == header
    assert bytes(dest[:n]) == payload
    untouched_outside()


@pytest.mark.parametrize(("write_direct", "read_direct"), [(True, False), (False, True)])
def test_direct_and_buffered_files_are_interchangeable(tmp_path: Path,
                                                       make_dest, write_direct: bool,
                                                       read_direct: bool) -> None:
    payload = payload_for(3 * 4096 + 5)
    path = tmp_path / "i.kv"
    header = write(path, payload, write_direct)
    dest, _ = make_dest("aligned_exact", len(payload))
    assert read_back(path, len(payload), dest, read_direct) == header
    assert bytes(dest) == payload


@pytest.mark.parametrize("dest_kind", ["aligned_exact", "unaligned"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_large_payload_moves_in_task_size_pieces(tmp_path: Path, make_dest, direct: bool,
                                                   dest_kind: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call moves at most ``task_size`` payload bytes (the header with the first), in
    file order, both ways."""
    n = 3 * MIB + 17
    calls: list[tuple[int, int]] = []  # (offset, bytes)
    real = {"preadv": os.preadv, "pwritev": os.pwritev}
    for name in real:
        def spy(fd: int, bufs: list, offset: int, name: str = name) -> int:
            calls.append((offset, sum(len(memoryview(b)) for b in bufs)))
            return real[name](fd, bufs, offset)

        monkeypatch.setattr(posix_io.os, name, spy)
    path = tmp_path / "l.kv"
    header = write(path, payload_for(n), direct)
    dest, _ = make_dest(dest_kind, n)
    assert read_back(path, n, dest, direct) == header and bytes(dest) == payload_for(n)
    starts = [i for i, (offset, _) in enumerate(calls) if offset == 0]
    assert len(starts) == 2  # the write, then the read
    for phase in (calls[: starts[1]], calls[starts[1] :]):
        assert phase[0][1] <= HEADER_SIZE + TASK_SIZE
        assert all(size <= TASK_SIZE for _, size in phase[1:])
        assert all(at + size == after
                   for (at, size), (after, _) in zip(phase, phase[1:], strict=False))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("keep", ["half_payload", "header_only", "partial_header", "empty",
                                  "one_byte_short"])
def test_a_truncated_file_is_short(tmp_path: Path, make_dest,
                                   direct: bool, keep: str) -> None:
    n = 5 * 4096 + 7
    sizes = {"half_payload": HEADER_SIZE + n // 2, "header_only": HEADER_SIZE,
             "partial_header": 100, "empty": 0,
             "one_byte_short": HEADER_SIZE + (padded_length(n) if direct else n) - 1}
    path = tmp_path / "t.kv"
    write(path, payload_for(n), direct)
    os.truncate(path, sizes[keep])
    with pytest.raises(ShortFileError):
        read_back(path, n, make_dest("aligned_padded", n)[0], direct)


def test_buffered_read_accepts_file_without_padding(tmp_path: Path,
                                                    make_dest) -> None:
    n = 4097
    path = tmp_path / "np.kv"
    header = write(path, payload_for(n), direct=False)
    os.truncate(path, HEADER_SIZE + n)
    dest, _ = make_dest("unaligned", n)
    assert read_back(path, n, dest, direct=False) == header
    assert bytes(dest) == payload_for(n)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_does_not_follow_symlink(tmp_path: Path, make_dest,
                                      direct: bool) -> None:
    real = tmp_path / "real.kv"
    write(real, payload_for(100), direct)
    link = tmp_path / "link.kv"
    link.symlink_to(real)
    dest, _ = make_dest("unaligned", 100)
    with pytest.raises(NotAChunkFile) as raised:
        read_back(link, 100, dest, direct)
    assert raised.value.errno == errno.ELOOP
    assert bytes(dest) == bytes([GUARD]) * 100
    with pytest.raises(NotAChunkFile):
        read_header(link, direct)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_header(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "h.kv"
    header = write(path, payload_for(4097), direct)
    assert read_header(path, direct) == (header, HEADER_SIZE + 8192)


def test_read_header_of_short_file(tmp_path: Path) -> None:
    path = tmp_path / "s.kv"
    path.write_bytes(b"LMCNVME\x00" + bytes(100))
    with pytest.raises(ShortFileError):
        read_header(path, direct=False)


# -- buffers and O_DIRECT probing -------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4096, 4097])
def test_aligned_buffer(size: int) -> None:
    buf = AlignedBuffer(size)
    try:
        assert is_aligned(buf.view)
        assert len(buf.view) == buf.size == max(4096, padded_length(size))
        assert not is_aligned(buf.view[1:])
    finally:
        buf.close()


def test_large_buffer_starts_on_a_huge_page(tmp_path: Path) -> None:
    size = 2 * MIB + 4096
    buf = AlignedBuffer(size)
    try:
        assert buffers_mod.buffer_address(buf.view) % buffers_mod.HUGE_PAGE == 0
        assert len(buf.view) == buf.size == size
        buf.view[:] = b"\x5a" * size
        assert bytes(buf.view[-3:]) == b"\x5a" * 3
    finally:
        buf.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_header_travels_with_the_first_piece(tmp_path: Path,
                                             make_dest, direct: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """One vectored call carries header + first payload piece, in both directions."""
    n = 2 * TASK_SIZE + 100
    payload = payload_for(n)
    calls: list[tuple[str, int, int]] = []
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def spy_pwritev(fd: int, bufs: list, offset: int) -> int:
        calls.append(("write", offset, len(bufs)))
        return real_pwritev(fd, bufs, offset)

    def spy_preadv(fd: int, bufs: list, offset: int) -> int:
        calls.append(("read", offset, len(bufs)))
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(posix_io.os, "pwritev", spy_pwritev)
    monkeypatch.setattr(posix_io.os, "preadv", spy_preadv)
    path = tmp_path / "v.kv"
    source, _ = make_dest("aligned_padded", n)
    source[:n] = payload
    header = write(path, payload, direct, source=source[:n])
    dest, _ = make_dest("aligned_padded", n)
    assert read_back(path, n, dest, direct) == header and bytes(dest[:n]) == payload
    assert ("write", 0, 2) in calls
    assert ("read", 0, 2) in calls
    assert not any(offset == 0 and nbufs == 1 for _, offset, nbufs in calls)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_partial_transfers_are_resumed(tmp_path: Path, make_dest,
                                       direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may move fewer bytes than asked; every byte still lands in place."""
    n = 3 * TASK_SIZE + 7
    payload = payload_for(n)
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def first_buffer_and_a_page(bufs: list) -> list:
        return [bufs[0], memoryview(bufs[1])[:4096]] if len(bufs) > 1 else bufs

    monkeypatch.setattr(posix_io.os, "pwritev", lambda fd, bufs, offset: real_pwritev(
        fd, first_buffer_and_a_page(bufs), offset))
    monkeypatch.setattr(posix_io.os, "preadv", lambda fd, bufs, offset: real_preadv(
        fd, first_buffer_and_a_page(bufs), offset))
    path = tmp_path / "p.kv"
    header = write(path, payload, direct)
    dest, _ = make_dest("aligned_padded", n)
    assert read_back(path, n, dest, direct) == header and bytes(dest[:n]) == payload


def test_probe_direct_io_on_ext4_tmp_path(tmp_path: Path) -> None:
    assert probe_direct_io(tmp_path) is True
    assert probe_direct_io(tmp_path) is True  # repeatable from the same thread
    assert list(tmp_path.iterdir()) == []


def _kernel_accepts_o_direct(directory: Path) -> bool:
    fd = -1
    try:
        fd = os.open(directory / "raw-check", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        (directory / "raw-check").unlink(missing_ok=True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d)


def test_probe_direct_io_on_tmpfs_matches_kernel(shm_dir: Path) -> None:
    # tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since; the probe must agree.
    expected = _kernel_accepts_o_direct(shm_dir)
    assert probe_direct_io(shm_dir) is expected


def test_probe_direct_io_reports_einval_as_unsupported(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(posix_io.os, "open", refuse_direct)
    assert probe_direct_io(tmp_path) is False


def test_probe_direct_io_propagates_other_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        probe_direct_io(tmp_path / "absent")


def test_probe_direct_io_leaves_no_file_when_kernel_creates_then_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def create_then_refuse(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kwargs))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(posix_io.os, "open", create_then_refuse)
    assert probe_direct_io(tmp_path) is False
    assert probe_direct_io(tmp_path) is False
    assert list(tmp_path.iterdir()) == []
