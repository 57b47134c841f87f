"""Directory layout of one cache root: where each chunk file lives.

::

    <root>/LMCNVME                       marker: this directory is a cache root
    <root>/index/manifest.json           LRU order and tensor metadata (see manifest.py)
    <root>/quarantine/<d32>.<unix_ns>.bad  files that failed validation, kept for inspection
    <root>/ns/<ns16>/NAMESPACE           the namespace's readable name
    <root>/ns/<ns16>/<aa>/<d32>.kv       one chunk file (aa = d32[0:2])
    <root>/ns/<ns16>/<aa>/<bb>/<d32>.kv  the same in a root made by 0.2 or earlier (bb = d32[2:4])
    <root>/ns/.forgotten-<ns16>-<host>-<pid>-<ns>  a namespace ``lmcache-nvme forget`` renamed
                                         away and is deleting (nothing else reads it)

Every component below the root is derived from a hash (``ns16`` of the namespace, ``d32``
of the full key), never from a user string.  A root made now has one level of 256 shard
directories per namespace, one made by 0.2 or earlier two (the marker says).  Temporary
files share the final file's directory (so ``rename`` is atomic), with a per-writer suffix.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .format import text_bytes, texts_bytes
from .safe_fs import exists_beneath, kind_of, read_small_file, scandir_beneath

MARKER_NAME = "LMCNVME"
CHUNK_SUFFIX = ".kv"
TEMP_INFIX = ".tmp-"
# A temporary file older than this is abandoned, whoever wrote it.
STALE_TEMP_S = 3600.0
# A key digest (a chunk file's name without ".kv") and a namespace id, as the tree names them.
DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")
NS_ID_RE = re.compile(r"^[0-9a-f]{16}$")
_SHARD_RE = re.compile(r"^[0-9a-f]{2}$")
#: Shard directory levels of a root this version makes, and of one made before the marker
#: said (``LMCNVME`` without a ``shard_levels`` line).
SHARD_LEVELS = 1
LEGACY_SHARD_LEVELS = 2
_MARKER_LEVELS_RE = re.compile(r"^shard_levels (\S+)$", re.MULTILINE)
# The last components of a path in a shard directory: ns/<ns16>/<aa>/<name> (one level),
# ns/<ns16>/<aa>/<bb>/<name> (two); neither tail can be read as the other.
_TREE_TAIL_RES = {
    levels: re.compile(r"^ns/[0-9a-f]{16}/" + r"[0-9a-f]{2}/" * levels + r"[^/]+$")
    for levels in (LEGACY_SHARD_LEVELS, SHARD_LEVELS)}
_HOST = socket.gethostname().replace(".", "_").replace("-", "_")[:32] or "host"


def key_digest(key: str) -> str:
    """Stable 128-bit digest of a full cache key; names the chunk file."""
    return digest_of_key_bytes(text_bytes(key))


#: ``digest_of_key_bytes(key)``: ``key_digest`` of a key already encoded
#: (``format.text_bytes``); the hash function itself (every chunk stored asks).
digest_of_key_bytes: Callable[[bytes], str] = xxhash.xxh3_128_hexdigest


def key_digests(keys: Sequence[str]) -> list[str]:
    """``key_digest`` of each key, without a Python call per key."""
    return list(map(digest_of_key_bytes, texts_bytes(keys)))


#: A namespace bound to a build of the model's weights: ``<model>[@salt]#<build>``
#: (``adapters/model_build.py``); a build is an automatic digest or an operator's revision.
BUILD_SEP = "#"
BUILD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def split_build(namespace: str) -> tuple[str, str | None]:
    """``(model[@salt], build)`` of a namespace; build None for one bound to no build."""
    base, sep, build = namespace.rpartition(BUILD_SEP)
    return (base, build) if sep and base and BUILD_RE.fullmatch(build) else (namespace, None)


#: A namespace directory ``lmcache-nvme forget`` renamed away (one step a running store
#: notices) and deletes; not a namespace id, so every walk of the tree passes it by.  It is
#: left empty for ``FORGOTTEN_KEEP_S`` so that its inode is not reused by a namespace
#: directory made again (how a running store tells that its directory was replaced).
FORGOTTEN_PREFIX = ".forgotten-"
FORGOTTEN_KEEP_S = 60.0


@functools.lru_cache(maxsize=4096)
def namespace_id(namespace: str) -> str:
    """Stable 64-bit digest of a namespace (model name); names its directory."""
    return xxhash.xxh3_64_hexdigest(text_bytes(namespace))


@dataclass(frozen=True)
class ChunkLocation:
    """A chunk file found in a root."""

    namespace_id: str
    digest: str
    shard_dir: str  # its directory's path, one string shared by the directory's files
    stat: os.stat_result  # lstat, taken while the directory was being listed

    @property
    def path(self) -> Path:
        """The file (built when asked: a restart walks millions and needs no paths)."""
        return Path(f"{self.shard_dir}/{self.digest}{CHUNK_SUFFIX}")


@dataclass(frozen=True)
class TempFile:
    """A writer's temporary file (or a directory a ``forget`` renamed away), with the host
    and pid its name gives."""

    path: Path
    host: str
    pid: int

    def is_stale(self, max_age_s: float = STALE_TEMP_S, now: float | None = None) -> bool:
        """Whether the writer is gone: a dead process on this host, or older than
        ``max_age_s`` (a file that vanished meanwhile is not)."""
        if self.host == this_host() and self.pid > 0 and not pid_alive(self.pid):
            return self.path.exists()
        try:
            age = (time.time() if now is None else now) - self.path.lstat().st_mtime
        except OSError:
            return False
        return age > max_age_s


def marker_text(shard_levels: int) -> bytes:
    """What the ``LMCNVME`` marker of a new root says."""
    return (f"lmcache-nvme-backend cache root, chunk format 1\n"
            f"shard_levels {shard_levels}\n").encode()


def shard_levels_of(root: Path) -> int:
    """The shard directory levels of the tree at ``root``: its marker's (no such line: two),
    without a marker the tree's; ``ValueError`` for a layout this version does not know."""
    try:
        text = read_small_file(root, MARKER_NAME, 4096).decode("utf-8", "replace")
    except (OSError, ValueError):  # none (a new root), or not a readable regular file
        return _shard_levels_in_tree(root)
    found = _MARKER_LEVELS_RE.search(text)
    if found is None:
        return LEGACY_SHARD_LEVELS
    if found.group(1) not in ("1", "2"):
        raise ValueError(
            f"{root / MARKER_NAME} says shard_levels {found.group(1)}, a layout this version "
            "of lmcache-nvme-backend does not know (1 or 2): a newer version made this cache "
            "directory. Upgrade lmcache-nvme-backend, or point nvme.path at another directory.")
    return int(found.group(1))


def _shard_levels_in_tree(root: Path) -> int:
    """The levels a marker-less tree's files sit at (``SHARD_LEVELS`` when it holds none)."""
    layout = RootLayout(root)  # one level: each ns/<ns16>/<aa> once
    for ns in layout.iter_namespace_ids():
        for _shard, rel, _leaf in layout._walk_shards(ns):
            for entry in scandir_beneath(root, rel):
                if _SHARD_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                    return LEGACY_SHARD_LEVELS
                if entry.name.endswith(CHUNK_SUFFIX) or TEMP_INFIX in entry.name:
                    return SHARD_LEVELS
    return SHARD_LEVELS


class RootLayout:
    """Path arithmetic and directory walking for one cache root."""

    def __init__(self, root: Path, shard_levels: int = SHARD_LEVELS) -> None:
        if shard_levels not in (SHARD_LEVELS, LEGACY_SHARD_LEVELS):
            raise ValueError(f"shard_levels must be 1 or 2, not {shard_levels}")
        self.root = root
        self.shard_levels = shard_levels
        self._one_level = shard_levels == 1
        self.root_str = str(root)  # the key of its kept descriptor (safe_fs.root_descriptor)
        self.index_dir = root / "index"
        self.quarantine_dir = root / "quarantine"
        self.namespaces_dir = root / "ns"
        self._root_prefix = str(root).rstrip("/") + "/"

    @classmethod
    def of(cls, root: Path) -> RootLayout:
        """The layout of the tree at ``root`` as it is (``shard_levels_of``)."""
        return cls(root, shard_levels_of(root))

    def chunk_path(self, ns_id: str, digest: str) -> Path:
        # one format and one parse: four ``/`` joins cost more on every read
        return Path(self._root_prefix + self.chunk_rel(ns_id, digest))

    def has_chunk(self, ns_id: str, digest: str) -> bool:
        """Whether the chunk file is there now (another member may have removed it)."""
        return exists_beneath(self.root, self.chunk_rel(ns_id, digest))

    def chunk_rel(self, ns_id: str, digest: str) -> str:
        """The chunk file's path relative to the root (as ``safe_fs`` takes it)."""
        if self._one_level:
            return f"ns/{ns_id}/{digest[0:2]}/{digest}{CHUNK_SUFFIX}"
        return f"ns/{ns_id}/{digest[0:2]}/{digest[2:4]}/{digest}{CHUNK_SUFFIX}"

    def shard_rel(self, ns_id: str, digest: str) -> str:
        """The chunk's shard directory relative to the root (as ``safe_fs`` takes it)."""
        if self._one_level:
            return f"ns/{ns_id}/{digest[0:2]}"
        return f"ns/{ns_id}/{digest[0:2]}/{digest[2:4]}"

    def chunk_naming(self, ns_id: str) -> tuple[str, int, str]:
        """``chunk_rel`` as the engines apply it to each digest (``io.engine.ChunkNaming``)."""
        return f"ns/{ns_id}/", self.shard_levels, CHUNK_SUFFIX

    def write_naming(self, ns_id: str, temp_suffix: str) -> tuple[str, int, str, str]:
        """``chunk_naming`` and the writer's temp suffix (``io.engine.WriteNaming``)."""
        return (*self.chunk_naming(ns_id), temp_suffix)

    def chunk_rels(self, entries: Iterable[Any]) -> tuple[str, ...]:
        """``chunk_rel`` of each of ``entries`` (anything with ``ns_id`` and ``digest``)."""
        return tuple([self.chunk_rel(entry.ns_id, entry.digest) for entry in entries])

    def temp_path(self, final: Path) -> Path:
        """A temporary name unique to this host, process and thread."""
        return final.with_name(temp_name(final.name))

    def quarantine_path(self, digest: str) -> Path:
        """Where a chunk file that failed validation is moved (a unique name per move)."""
        return self.quarantine_dir / f"{digest}.{time.time_ns()}.bad"

    def namespace_name_file(self, ns_id: str) -> Path:
        return self.namespaces_dir / ns_id / "NAMESPACE"

    def relative(self, path: Path) -> str:
        """``path`` relative to the root, as the ``safe_fs`` functions take it."""
        text = str(path)
        if text.startswith(self._root_prefix):  # every path the store builds: no parsing
            return text[len(self._root_prefix):]
        return path.relative_to(self.root).as_posix()

    def iter_namespace_ids(self) -> Iterator[str]:
        for entry in _scandir_dirs(self.root, "ns"):
            if NS_ID_RE.match(entry.name):
                yield entry.name

    def forgotten_rel(self, ns_id: str) -> str:
        """A unique name for ``forget`` to rename namespace ``ns_id``'s directory to."""
        return f"ns/{FORGOTTEN_PREFIX}{ns_id}-{_HOST}-{os.getpid()}-{time.time_ns()}"

    def iter_forgotten(self) -> Iterator[TempFile]:
        """The namespace directories a ``forget`` renamed and has not finished deleting."""
        for entry in _scandir_dirs(self.root, "ns"):
            if entry.name.startswith(FORGOTTEN_PREFIX):
                parts = entry.name[len(FORGOTTEN_PREFIX):].split("-")
                pid = int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else -1
                host = parts[1] if len(parts) == 4 else ""
                yield TempFile(self.namespaces_dir / entry.name, host, pid)

    def namespace_names(self) -> dict[str, str]:
        """Readable name of every namespace directory (its NAMESPACE file; "" if unreadable)."""
        names: dict[str, str] = {}
        for ns_id in self.iter_namespace_ids():
            try:  # never through a link, never waiting on a FIFO
                raw = read_small_file(self.root, f"ns/{ns_id}/NAMESPACE", 4096)
                names[ns_id] = raw.decode("utf-8", "replace").rstrip("\n")
            except (OSError, ValueError):
                names[ns_id] = ""
        return names

    def iter_tree_dirs(self) -> Iterator[str]:
        """Every directory below ``ns/`` relative to the root, parents first (no links)."""
        for ns in self.iter_namespace_ids():
            yield f"ns/{ns}"
            yield from (rel for _shard, rel, _leaf in self._walk_shards(ns))

    def _walk_shards(self, ns: str) -> Iterator[tuple[str, str, bool]]:
        """(hex prefix, relative path, whether it holds chunk files) of each shard
        directory of namespace ``ns``, parents first."""
        for shard1 in _scandir_dirs(self.root, f"ns/{ns}"):
            if not _SHARD_RE.match(shard1.name):
                continue
            rel1 = f"ns/{ns}/{shard1.name}"
            yield shard1.name, rel1, self._one_level
            if self._one_level:
                continue
            for shard2 in _scandir_dirs(self.root, rel1):
                if _SHARD_RE.match(shard2.name):
                    yield shard1.name + shard2.name, f"{rel1}/{shard2.name}", True

    def iter_chunks(self, ns_id: str | None = None) -> Iterator[ChunkLocation]:
        """Every well-named regular chunk file with its ``lstat`` (no links)."""
        return (f for f in self._iter_files(ns_id) if isinstance(f, ChunkLocation))

    def iter_special_entries(self, ns_id: str | None = None) -> Iterator[tuple[Path, str]]:
        """(path, kind) of every entry at a chunk file's name that is not a regular file."""
        for _ns, shard, rel in self._iter_shard_dirs(ns_id):
            for entry in scandir_beneath(self.root, rel):
                name = entry.name
                if _chunk_digest(name, shard) is None or entry.is_file(follow_symlinks=False):
                    continue
                try:
                    kind = kind_of(entry.stat(follow_symlinks=False).st_mode)
                except OSError:
                    continue
                yield Path(f"{self._root_prefix}{rel}/{name}"), kind

    def iter_temp_files(self) -> Iterator[TempFile]:
        """Temporary files of any writer (see ``temp_path``)."""
        return (f for f in self._iter_files(None) if isinstance(f, TempFile))

    def scan(self) -> tuple[list[ChunkLocation], list[TempFile]]:
        """``iter_chunks`` and ``iter_temp_files`` in one walk of the tree."""
        chunks: list[ChunkLocation] = []
        temps: list[TempFile] = []
        for found in self._iter_files(None):
            if isinstance(found, ChunkLocation):
                chunks.append(found)
            else:
                temps.append(found)
        return chunks, temps

    def _iter_files(self, ns_id: str | None) -> Iterator[ChunkLocation | TempFile]:
        """The chunk files and writers' temp files of the shard directories, in one walk."""
        for ns, shard, rel in self._iter_shard_dirs(ns_id):
            shard_dir = self._root_prefix + rel
            for entry in scandir_beneath(self.root, rel):
                found = _chunk_at(ns, shard, shard_dir, entry) or self._temp_at(rel, entry)
                if found is not None:
                    yield found

    def _temp_at(self, rel: str, entry: os.DirEntry[str]) -> TempFile | None:
        """The temporary file an entry of shard directory ``rel`` is (None: not one)."""
        _, sep, owner = entry.name.partition(TEMP_INFIX)
        if not sep or not entry.is_file(follow_symlinks=False):
            return None
        parts = owner.split("-")
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
        return TempFile(Path(f"{self._root_prefix}{rel}/{entry.name}"), parts[0], pid)

    def _iter_shard_dirs(self, ns_id: str | None) -> Iterator[tuple[str, str, str]]:
        """(namespace id, hex shard prefix, relative path) of each directory that holds
        chunk files; a planted link never takes the walk outside the tree."""
        if ns_id is not None and not NS_ID_RE.match(ns_id):
            raise ValueError(f"'{ns_id}' is not a namespace id (16 hex digits)")
        ns_ids = [ns for ns in self.iter_namespace_ids() if ns_id is None or ns == ns_id]
        for ns in ns_ids:
            for shard, rel, leaf in self._walk_shards(ns):
                if leaf:
                    yield ns, shard, rel


def split_tree_path(path: Path | str) -> tuple[str, str] | None:
    """(cache root, path below it) of a file in a shard directory of either layout
    (``<root>/ns/<ns16>/<aa>[/<bb>]/<name>``); None for any other path."""
    text = os.fspath(path)
    for levels, tail_re in _TREE_TAIL_RES.items():
        parts = text.rsplit("/", 3 + levels)
        if len(parts) == 4 + levels and parts[0]:
            tail = "/".join(parts[1:])
            if tail_re.match(tail):
                return parts[0], tail
    return None


#: The writer number in the temp names of removed chunk files the native engine keeps for
#: reuse (``nvme.recycle_mb``); its writers write under number 0.
RETIRED_FILES_WRITER = 1


def temp_name(final_name: str, writer: int | None = None) -> str:
    """A temporary name beside ``final_name``, unique to this host, process and writer
    (the calling thread, or ``writer``: 0 for all of the native engine's writers)."""
    tid = threading.get_ident() if writer is None else writer
    return f"{final_name}{TEMP_INFIX}{_HOST}-{os.getpid()}-{tid}"


def this_host() -> str:
    """The host tag written into temporary file names."""
    return _HOST


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _scandir_dirs(root: Path, rel: str) -> Iterator[os.DirEntry[str]]:
    """Real subdirectories of ``root / rel`` (links skipped); missing or unreadable: none."""
    return (e for e in scandir_beneath(root, rel) if e.is_dir(follow_symlinks=False))


def _chunk_at(ns: str, shard: str, shard_dir: str, entry: os.DirEntry[str]
              ) -> ChunkLocation | None:
    """The chunk file a directory entry is (None: not a well-named regular chunk file)."""
    digest = _chunk_digest(entry.name, shard)
    if digest is None:
        return None
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    return ChunkLocation(ns, digest, shard_dir, st) if stat.S_ISREG(st.st_mode) else None


def _chunk_digest(name: str, shard: str) -> str | None:
    """The digest a directory entry's name gives a chunk file in ``shard`` (None: not one)."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    digest = name[: -len(CHUNK_SUFFIX)]
    return digest if DIGEST_RE.match(digest) and digest.startswith(shard) else None
