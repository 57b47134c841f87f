"""Chunks, shares and completions for the engine contract suite (tests/unit/
test_engine_contract.py): real files beneath a root named as ``disk.layout`` names them,
batches as the seam's shapes (io/engine.py)."""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

from lmcache_nvme_backend.disk.format import HEADER_SIZE, TensorMeta
from lmcache_nvme_backend.disk.layout import RootLayout, key_digest
from lmcache_nvme_backend.disk.safe_fs import NotAChunkFile, root_descriptor
from lmcache_nvme_backend.io import engine as seam
from lmcache_nvme_backend.io.buffers import AlignedBuffer
from lmcache_nvme_backend.io.files import ShortFileError

NS_ID = "0123456789abcdef"


def meta_for(n: int, dtype: str = "uint8") -> bytes:
    return TensorMeta(shapes=((n,),), dtypes=(dtype,), fmt=1, nbytes=n).to_json()


def payload_for(n: int, seed: int = 0) -> bytes:
    return random.Random(n * 7 + seed).randbytes(n)


def buffer_for(n: int, kind: str) -> memoryview:
    if kind == "aligned":
        return AlignedBuffer(n + 4096).view
    return memoryview(bytearray(n + 1))[1:]  # not 4 KiB aligned: staged


def rel_of(root: Path, key: str) -> str:
    return RootLayout(root).chunk_rel(NS_ID, key_digest(key))


def write_share(root: Path, keys: list[str], payloads: list[memoryview | bytes], *,
                direct: bool = True, mode: int = 0o640, fsync: int = 0,
                victims: tuple[str, ...] = (), gpu: list[tuple[int, int]] | None = None,
                meta: bytes | None = None) -> seam.WriteShare:
    root.mkdir(parents=True, exist_ok=True)
    return (root_descriptor(str(root)), RootLayout(root).write_naming(NS_ID, ".tmp-contract"),
            b"ns", meta if meta is not None else meta_for(len(payloads[0])), direct, mode,
            0o750, fsync, victims, [key_digest(k) for k in keys],
            [memoryview(p) for p in payloads], [k.encode() for k in keys], gpu)


def read_share(root: Path, keys: list[str], dests: list[memoryview], n: int, *,
               direct: bool = True, meta: bytes | None = None,
               as_keys: list[str] | None = None) -> seam.ReadShare:
    return (root_descriptor(str(root)), RootLayout(root).chunk_naming(NS_ID), direct, n,
            meta if meta is not None else meta_for(n), [key_digest(k) for k in keys], dests,
            [k.encode() for k in as_keys or keys])


class Done:
    """Collects the batches an engine hands back, by name, with how often and where."""

    def __init__(self) -> None:
        self.batches: dict[object, seam.Batch] = {}
        self.calls: list[tuple[object, int]] = []  # (name, thread ident)
        self.cond = threading.Condition()

    def __call__(self, name: object) -> seam.OnDone:
        def on_done(batch: seam.Batch) -> None:
            with self.cond:
                self.calls.append((name, threading.get_ident()))
                self.batches[name] = batch
                self.cond.notify_all()
        return on_done

    def wait_for(self, count: int) -> dict[object, seam.Batch]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= count, timeout=60)
            return self.batches


def write_now(engine: seam.ChunkEngine, shares: list[seam.WriteShare]) -> seam.Batch:
    done = Done()
    engine.submit_write(shares, done("w"))
    return done.wait_for(1)["w"]


def read_async(engine: seam.ChunkEngine, shares: list[seam.ReadShare]) -> seam.Batch:
    done = Done()
    engine.submit_read(shares, done("r"))
    return done.wait_for(1)["r"]


def plant(tmp_path: Path, what: str) -> tuple[str, tuple[int, ...], type[OSError]]:
    """Something at key ``what``'s chunk path that is no chunk file: (its key, the errnos an
    engine may give, the exception ``read_failure`` makes of them)."""
    path = tmp_path / rel_of(tmp_path, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "link":
        (tmp_path / "real.kv").write_bytes(b"x" * 3 * HEADER_SIZE)
        os.symlink(tmp_path / "real.kv", path)
        return what, (errno.ELOOP,), NotAChunkFile
    if what == "linked-dir":
        os.rmdir(path.parent)
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", path.parent)
        return what, (errno.ELOOP, errno.ENOTDIR), NotAChunkFile
    if what == "fifo":
        os.mkfifo(path)
        return what, (errno.EINVAL,), NotAChunkFile
    if what == "directory":
        path.mkdir()
        return what, (errno.EINVAL,), NotAChunkFile
    if what == "short":
        path.write_bytes(b"\0" * (HEADER_SIZE + 4096))
        return what, (errno.ENODATA,), ShortFileError
    return what, (errno.ENOENT,), FileNotFoundError  # missing


def flip(path: Path, offset: int) -> None:
    """Damage one bit of a file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def temp_files(tree: Path) -> list[Path]:
    return [p for p in tree.rglob("*") if ".tmp-" in p.name]


# -- malformed shares: (change of a good share, the error, its message) -----------------------

BAD_READS: dict[str, tuple[Callable[[tuple], tuple], type[Exception], str]] = {
    "upper-hex": (lambda s: s[:5] + ([s[5][0].upper()],) + s[6:], ValueError, "lowercase hex"),
    "levels": (lambda s: s[:1] + (("ns/x/", 3, ".kv"),) + s[2:], ValueError, "shard_levels"),
    "lengths": (lambda s: s[:7] + ([],), TypeError, "one length"),
    "short-dest": (lambda s: s[:3] + (1 << 20,) + s[4:], ValueError, "holds"),
    "read-only": (lambda s: s[:6] + ([memoryview(bytes(8192))],) + s[7:], BufferError,
                  "writable"),
}
BAD_WRITES: dict[str, tuple[Callable[[tuple], tuple], type[Exception], str]] = {
    "upper-hex": (lambda s: s[:9] + ([s[9][0].upper()],) + s[10:], ValueError, "lowercase hex"),
    "levels": (lambda s: s[:1] + (("ns/x/", 3, ".kv", ".t"),) + s[2:], ValueError,
               "shard_levels"),
    "no-chunks": (lambda s: s[:9] + ([], [], [], None), ValueError, "no chunks"),
    "no-chunks-gpu": (lambda s: s[:9] + ([], [], [], []), ValueError, "no chunks"),
}
