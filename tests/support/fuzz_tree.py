"""Mutations of a real cache tree for tests/robustness/test_robustness_fuzz.py.

Each mutation is what a careless or hostile local user (or a failing disk) can do to the
tree: damage a payload, a header or its metadata JSON, the manifest; replace a file by a
FIFO, a link, a directory or a device; link a directory out of the tree; change modes;
swap files; plant temp files.  A mutation says which keys it touches: every other chunk
is intact and must keep serving.  Links point into ``outside``, which nothing may change.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lmcache_nvme_backend.disk.format import HEADER_SIZE
from lmcache_nvme_backend.disk.layout import this_host
from lmcache_nvme_backend.disk.manifest import MANIFEST_NAME

from .hostile import CRAFTED_METAS, chunk_path, crafted_header

ALL = "*"  # a mutation that touches every key


@dataclass
class Tree:
    """A cache tree under mutation: its root, the keys stored in it, the outside world."""

    root: Path
    keys: list[str]
    outside: Path
    rng: random.Random
    fifos: list[Path] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    applied: list[str] = field(default_factory=list)

    def path(self, key: str) -> Path:
        return chunk_path(self.root, key)

    def key(self) -> str:
        return self.rng.choice(self.keys)

    def touch(self, *keys: str) -> None:
        self.touched.update(keys)

    def replace(self, p: Path, make: Callable[[Path], None]) -> None:
        """Remove whatever is at ``p`` (never following it) and make something new there."""
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p)
        make(p)

    def mkfifo(self, p: Path) -> None:
        os.mkfifo(p)
        self.fifos.append(p)

    def outside_target(self) -> Path:
        """An existing outside file, an outside directory, or a name that does not exist."""
        return self.rng.choice([self.outside / "victim", self.outside / "dir",
                                self.outside / "copy.kv", self.outside / "dangling"])


def _flip(p: Path, start: int, end: int, rng: random.Random) -> None:
    data = bytearray(p.read_bytes())
    if end > start and len(data) > start:
        i = rng.randrange(start, min(end, len(data)))
        data[i] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))


def payload_flip(t: Tree) -> None:
    k = t.key()
    if t.path(k).is_file():
        _flip(t.path(k), HEADER_SIZE, t.path(k).stat().st_size, t.rng)
        t.touch(k)


def header_flip(t: Tree) -> None:
    k = t.key()
    if t.path(k).is_file():
        _flip(t.path(k), 0, HEADER_SIZE, t.rng)
        t.touch(k)


def crafted_meta(t: Tree) -> None:
    """The metadata JSON replaced by one a real chunk never holds, the header resealed."""
    k = t.key()
    p = t.path(k)
    if p.is_file() and p.stat().st_size > HEADER_SIZE:
        data = p.read_bytes()
        meta = CRAFTED_METAS[t.rng.choice(sorted(CRAFTED_METAS))]
        p.write_bytes(crafted_header(k, meta, data[HEADER_SIZE:]) + data[HEADER_SIZE:])
        t.touch(k)


def truncate(t: Tree) -> None:
    k = t.key()
    p = t.path(k)
    if p.is_file():
        with open(p, "r+b") as f:
            f.truncate(t.rng.randrange(0, p.stat().st_size))
        t.touch(k)


def extend(t: Tree) -> None:
    k = t.key()
    p = t.path(k)
    if p.is_file():
        with open(p, "ab") as f:
            f.write(os.urandom(t.rng.choice([1, 4096, 10_000])))
        t.touch(k)


def fifo(t: Tree) -> None:
    k = t.key()
    t.replace(t.path(k), t.mkfifo)
    t.touch(k)


def link(t: Tree) -> None:
    k = t.key()
    target = t.outside_target()
    t.replace(t.path(k), lambda p: os.symlink(target, p))
    t.touch(k)


def directory(t: Tree) -> None:
    k = t.key()
    t.replace(t.path(k), lambda p: p.mkdir())
    t.touch(k)


def device(t: Tree) -> None:
    """A character device (like /dev/null) at a chunk path; needs root, else a FIFO."""
    k = t.key()

    def make(p: Path) -> None:
        try:
            os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            t.mkfifo(p)

    t.replace(t.path(k), make)
    t.touch(k)


def shard_link(t: Tree) -> None:
    """A shard directory linked out of the tree (to a directory holding a copy of a chunk)."""
    k = t.key()
    shard = t.path(k).parent
    if shard.is_symlink() or not shard.is_dir():
        return
    t.touch(*[key for key in t.keys if t.path(key).parent == shard])
    t.replace(shard, lambda p: os.symlink(t.outside / "shard", p))


def namespace_link(t: Tree) -> None:
    ns_dir = t.path(t.keys[0]).parents[2]
    t.replace(ns_dir, lambda p: os.symlink(t.outside / "dir", p))
    t.touch(ALL)


def special_dir(t: Tree) -> None:
    """quarantine/, index/ or ns/<ns>/NAMESPACE replaced by a link, FIFO or file."""
    name = t.rng.choice(["quarantine", "index", "NAMESPACE"])
    p = t.root / name if name != "NAMESPACE" else t.path(t.keys[0]).parents[2] / name
    kind = t.rng.choice(["link", "fifo", "file"])
    target = t.outside_target()
    t.replace(p, {"link": lambda q: os.symlink(target, q), "fifo": t.mkfifo,
                  "file": lambda q: q.write_bytes(b"junk")}[kind])


def marker(t: Tree) -> None:
    kind = t.rng.choice(["link", "fifo", "gone"])
    target = t.outside_target()
    t.replace(t.root / "LMCNVME", {"link": lambda q: os.symlink(target, q), "fifo": t.mkfifo,
                                   "gone": lambda q: None}[kind])


MANIFESTS = ["[]", "null", "42", '"x"', "{}", '{"version": 1}', "[" * 5000 + "]" * 5000,
             '{"version": 1, "metas": [{"shapes": [[1e999]]}], "entries": [[1, 2, 3, 4, 0]]}',
             '{"version": 1, "metas": [], "entries": [["%s", "%s", 1, NaN, -1]]}']


def manifest(t: Tree) -> None:
    p = t.root / "index" / MANIFEST_NAME
    if not (t.root / "index").is_dir() or (t.root / "index").is_symlink():
        return
    how = t.rng.choice(["shape", "sizes", "metas", "bytes", "fifo", "link", "flip"])
    if how in ("sizes", "metas", "flip") and not p.is_file():
        how = "shape"
    if how == "shape":
        text = t.rng.choice(MANIFESTS)
        t.replace(p, lambda q: q.write_text(text.replace("%s", "0" * 16)))
    elif how == "sizes":  # understated / overstated sizes, recency shuffled
        doc = json.loads(p.read_text())
        for row in doc.get("entries", []):
            row[2] = t.rng.choice([0, 1, row[2] * 1000, -5])
            row[3] = t.rng.randrange(0, 2**63)
        p.write_text(json.dumps(doc))
    elif how == "metas":  # valid-looking metadata that is not the files'
        doc = json.loads(p.read_text())
        doc["metas"] = [{"shapes": [[8]], "dtypes": ["uint8"], "fmt": 1, "nbytes": 8}] * 3
        for row in doc.get("entries", []):
            row[4] = t.rng.choice([0, 1, 2])
        p.write_text(json.dumps(doc))
    elif how == "bytes":
        t.replace(p, lambda q: q.write_bytes(os.urandom(t.rng.randrange(1, 5000))))
    elif how == "fifo":
        t.replace(p, t.mkfifo)
    elif how == "link":
        target = t.outside_target()
        t.replace(p, lambda q: os.symlink(target, q))
    else:
        _flip(p, 0, p.stat().st_size, t.rng)


def modes(t: Tree) -> None:
    k = t.key()
    p = t.path(k)
    if p.is_file() and not p.is_symlink():
        p.chmod(t.rng.choice([0o000, 0o200, 0o777, 0o4755]))
        if os.geteuid() != 0:
            t.touch(k)


def swap(t: Tree) -> None:
    a, b = t.rng.sample(t.keys, 2)
    pa, pb = t.path(a), t.path(b)
    if pa.is_file() and pb.is_file() and not pa.is_symlink() and not pb.is_symlink():
        tmp = pa.with_name("swap")
        os.rename(pa, tmp)
        os.rename(pb, pa)
        os.rename(tmp, pb)
        t.touch(a, b)


def temp_files(t: Tree) -> None:
    """Temp files of dead writers, and temp names linked out of the tree."""
    p = t.path(t.key())
    if not p.parent.is_dir() or p.parent.is_symlink():
        return
    dead = 2**22 - 3
    (p.parent / f"{p.name}.tmp-{this_host()}-{dead}-1").write_bytes(b"partial")
    index = t.root / "index"
    if index.is_dir() and not index.is_symlink():
        os.symlink(t.outside_target(), index / f".{MANIFEST_NAME}.tmp-{this_host()}-{dead}")
        os.symlink(t.outside_target(), index / f".{MANIFEST_NAME}.tmp-{this_host()}-"
                   f"{os.getpid()}")


def stray_special(t: Tree) -> None:
    """Special files at chunk names of keys nobody stored."""
    p = chunk_path(t.root, f"nobody-{t.rng.randrange(10**6)}")
    p.parent.mkdir(parents=True, exist_ok=True)
    t.rng.choice([t.mkfifo, lambda q: os.symlink(t.outside_target(), q),
                  lambda q: q.mkdir()])(p)


MUTATIONS: list[Callable[[Tree], None]] = [
    payload_flip, header_flip, crafted_meta, truncate, extend, fifo, link, directory, device,
    shard_link, namespace_link, special_dir, marker, manifest, modes, swap, temp_files,
    stray_special,
]


def make_outside(outside: Path, sample_chunk: bytes) -> None:
    """What the links point at: a file, a directory, a valid chunk copy, a shard's copy."""
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    (outside / "victim").chmod(0o644)
    (outside / "dir").mkdir()
    (outside / "dir" / "keep").write_bytes(b"keep")
    (outside / "copy.kv").write_bytes(sample_chunk)
    (outside / "shard").mkdir()
