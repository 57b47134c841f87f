"""What a hostile local user plants in a cache tree, and how tests check that nothing outside
the tree changed: crafted headers (valid header checksum, arbitrary metadata JSON), special
files, snapshots of a directory, the CLI run in-process, a FIFO read guard."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

from lmcache_nvme_backend.cli import main as cli_main
from lmcache_nvme_backend.disk.format import HEADER_SIZE, MAGIC, padded_length
from lmcache_nvme_backend.disk.layout import RootLayout, key_digest, namespace_id

from .chunks import NS

# docs/format.md: magic, version, header_size, flags, payload_len, payload_checksum,
# created_unix_ns, key_len, namespace_len, meta_len; the header checksum at 4088
_FIXED = struct.Struct("<8sHHIQQQHHH")
_CHECKSUM_OFFSET = 4088


def chunk_path(root: Path, key: str, ns: str = NS) -> Path:
    return RootLayout(root).chunk_path(namespace_id(ns), key_digest(key))


def crafted_header(key: str, meta_json: bytes, payload: bytes, ns: str = NS,
                   payload_len: int | None = None) -> bytes:
    """A header whose header checksum is valid (a careful forger) holding ``meta_json``."""
    key_b, ns_b = key.encode(), ns.encode()
    n = len(payload) if payload_len is None else payload_len
    body = _FIXED.pack(MAGIC, 1, HEADER_SIZE, 0, n, xxhash.xxh3_64_intdigest(payload), 1,
                       len(key_b), len(ns_b), len(meta_json)) + key_b + ns_b + meta_json
    assert len(body) <= _CHECKSUM_OFFSET, "crafted strings do not fit a header"
    body += bytes(_CHECKSUM_OFFSET - len(body))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def plant_crafted_chunk(root: Path, key: str, meta_json: bytes, payload: bytes,
                        ns: str = NS) -> Path:
    """A chunk file at ``key``'s name with a crafted header and a well-padded payload."""
    path = chunk_path(root, key, ns)
    path.parent.mkdir(parents=True, exist_ok=True)
    pad = bytes(padded_length(len(payload)) - len(payload))
    path.write_bytes(crafted_header(key, meta_json, payload, ns) + payload + pad)
    return path


# metadata JSON a real chunk never holds (each with a valid header checksum)
CRAFTED_METAS: dict[str, bytes] = {
    "infinite": b'{"shapes":[[1e999]],"dtypes":["uint8"],"fmt":1,"nbytes":4096}',
    "nan": b'{"shapes":[[NaN]],"dtypes":["uint8"],"fmt":1,"nbytes":4096}',
    "infinity-literal": b'{"shapes":[[4096]],"dtypes":["uint8"],"fmt":Infinity,"nbytes":4096}',
    "huge-int": b'{"shapes":[[' + b"9" * 400 + b']],"dtypes":["uint8"],"fmt":1,"nbytes":4096}',
    "huge-fmt": b'{"shapes":[[4096]],"dtypes":["uint8"],"fmt":' + b"9" * 300 + b',"nbytes":4096}',
    "deep": b'{"shapes":' + b"[" * 1500 + b"]" * 1500 + b',"dtypes":["uint8"],"fmt":1,'
            b'"nbytes":4096}',
    "deep-dtype": b'{"shapes":[[4096]],"dtypes":' + b"[" * 1200 + b"]" * 1200 + b',"fmt":1,'
                  b'"nbytes":4096}',
    "fractional": b'{"shapes":[[4096.5]],"dtypes":["uint8"],"fmt":1,"nbytes":4096}',
    "negative": b'{"shapes":[[-4096]],"dtypes":["uint8"],"fmt":1,"nbytes":4096}',
    "bool-size": b'{"shapes":[[true]],"dtypes":["uint8"],"fmt":1,"nbytes":4096}',
    "giant-allocation": b'{"shapes":[[68719476736,68719476736]],"dtypes":["float32"],'
                        b'"fmt":1,"nbytes":4096}',
    "not-a-dtype": b'{"shapes":[[4096]],"dtypes":["../../etc"],"fmt":1,"nbytes":4096}',
    "array": b'[[4096],["uint8"],1,4096]',
    "null": b"null",
    "string-shapes": b'{"shapes":"4096","dtypes":["uint8"],"fmt":1,"nbytes":4096}',
}


def snapshot(directory: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``directory`` (links not followed): kind, mode, size, content hash."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            digest = ""
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            out[str(p.relative_to(directory))] = (stat.S_IFMT(st.st_mode),
                                                  stat.S_IMODE(st.st_mode), st.st_size, digest)
    return out


def run_cli(*args: str | Path) -> tuple[int, str, str]:
    """``lmcache-nvme ARGS`` in this process (an exception escaping it fails the test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli_main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def unblock_fifo(path: Path) -> None:
    """Open a FIFO's write end, so that a reader blocked opening it returns."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@contextlib.contextmanager
def fifo_guard(fifos: list[Path]) -> Iterator[None]:
    """Whatever happens in the block, readers blocked on these FIFOs are released after it."""
    try:
        yield
    finally:
        for p in fifos:
            unblock_fifo(p)


def finishes(fn: Callable[[], Any], timeout_s: float = 10.0) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread: (whether it returned within ``timeout_s``, its result or
    the exception it raised)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # reported to the caller
            box.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return (not t.is_alive(), box[0] if box else None)
