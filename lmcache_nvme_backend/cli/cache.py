"""Offline view of a cache root, shared by ``inspect``, ``verify``, ``gc`` and ``forget``.

Listing only reads the tree, so it is safe while a server uses the directory (a file that
vanished meanwhile is "already gone"); nothing is reached through a link, no FIFO is waited
on, and a damaged manifest is ignored.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..disk.layout import (
    CHUNK_SUFFIX,
    DIGEST_RE,
    FORGOTTEN_KEEP_S,
    MARKER_NAME,
    NS_ID_RE,
    STALE_TEMP_S,
    RootLayout,
    namespace_id,
    split_build,
    split_tree_path,
)
from ..disk.manifest import ManifestRecord, load_manifest
from ..disk.safe_fs import (
    lstat_beneath,
    remove_tree_beneath,
    rename_beneath,
    scandir_beneath,
    unlink_beneath,
)
from ..store.recovery import manifest_limit
from .common import CLIError


@dataclass
class Dropped:
    """What deleting a namespace's directory removed: chunk files and their bytes, and
    whether the whole tree is gone (``where`` names what is left otherwise)."""

    chunks: int = 0
    bytes: int = 0
    complete: bool = True
    where: str = ""

    def count(self, rel: str, st: os.stat_result) -> None:
        """A removed file: counted when it is a chunk file (``<d32>.kv``, regular)."""
        name = rel.rpartition("/")[2]
        if name.endswith(CHUNK_SUFFIX) and DIGEST_RE.match(name[: -len(CHUNK_SUFFIX)]) \
                and stat.S_ISREG(st.st_mode):
            self.chunks += 1
            self.bytes += st.st_size

    def to_json(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "bytes": self.bytes, "complete": self.complete,
                "left": self.where or None}


@dataclass(frozen=True)
class CacheFile:
    """One chunk file as listed: where, how big, and when it was last used."""

    ns_id: str
    digest: str
    path: Path
    size: int
    mtime_ns: int
    last_access_ns: int
    in_manifest: bool
    ino: int
    dev: int


class CacheRoot:
    """One cache directory (one ``nvme.path``)."""

    def __init__(self, path: Path) -> None:
        path = path.absolute()
        if not path.is_dir():
            raise CLIError(f"'{path}' is not a directory")
        try:
            marker_mode = os.lstat(path / MARKER_NAME).st_mode
        except OSError:
            marker_mode = 0
        if not stat.S_ISREG(marker_mode):
            raise CLIError(f"'{path}' is not an LMCache NVMe cache root (no {MARKER_NAME} "
                           "file); give the directory configured as nvme.path")
        self.path = path
        try:
            self.layout = RootLayout.of(path)
        except ValueError as exc:  # a newer version's layout
            raise CLIError(str(exc)) from None
        self._manifest: dict[str, ManifestRecord] | None = None

    def manifest(self, chunk_files: int) -> dict[str, ManifestRecord]:
        """Records of the persisted index snapshot (empty when missing, unreadable, or far
        larger than a manifest of ``chunk_files`` chunk files can be)."""
        if self._manifest is None:
            self._manifest = load_manifest(self.layout.index_dir,
                                           max_bytes=manifest_limit(chunk_files))
        return self._manifest

    def resolve_namespace(self, name_or_id: str) -> str:
        """A namespace's directory id from its readable name or its 16-hex id."""
        names = self.layout.namespace_names()
        if NS_ID_RE.match(name_or_id) and name_or_id in names:
            return name_or_id
        ns_id = namespace_id(name_or_id)
        if ns_id in names:
            return ns_id
        known = ", ".join(f"{n or '?'} ({i})" for i, n in sorted(names.items())) or "none"
        raise CLIError(f"no namespace '{name_or_id}' in {self.path}; namespaces here: {known}")

    def drop_namespace(self, ns_id: str) -> Dropped:
        """Rename the namespace's directory away in one step (a running store then drops its
        chunks), then empty it, never through a link (it stays: ``FORGOTTEN_KEEP_S``)."""
        rel = self.layout.forgotten_rel(ns_id)
        try:
            rename_beneath(self.path, f"ns/{ns_id}", rel)
        except FileNotFoundError:  # gone meanwhile (another forget)
            return Dropped()
        except OSError as exc:
            raise CLIError(f"cannot rename {self.layout.namespaces_dir / ns_id}: "
                           f"{exc.strerror or exc}") from None
        return self.remove_renamed(rel, keep_top=True)

    def remove_renamed(self, rel: str, keep_top: bool = False) -> Dropped:
        """Delete a renamed namespace directory (``rel``), counting its chunk files."""
        dropped = Dropped()
        dropped.complete = remove_tree_beneath(self.path, rel, dropped.count,
                                               keep_top=keep_top)
        if not dropped.complete:
            dropped.where = str(self.path / rel)
        return dropped

    def remove_forgotten(self, max_age_s: float = STALE_TEMP_S) -> Dropped:
        """Delete what earlier ``forget`` runs renamed away, once over (a dead process on this
        host, or older than ``max_age_s``) and left alone for ``FORGOTTEN_KEEP_S``."""
        total = Dropped()
        now = time.time()
        for left in self.layout.iter_forgotten():
            try:
                age_s = now - left.path.lstat().st_mtime
            except OSError:
                continue
            if age_s < FORGOTTEN_KEEP_S or not left.is_stale(max_age_s, now):
                continue
            done = self.remove_renamed(self.layout.relative(left.path))
            total.chunks += done.chunks
            total.bytes += done.bytes
            if not done.complete:
                total.complete, total.where = False, done.where
        return total

    def scan(self, ns_id: str | None = None) -> list[CacheFile]:
        """Every chunk file (optionally of one namespace); vanished files are skipped."""
        located = list(self.layout.iter_chunks(ns_id))
        records = self.manifest(len(located))
        files: list[CacheFile] = []
        for loc in located:
            st = loc.stat
            rec = records.get(loc.digest)
            in_manifest = rec is not None and rec.ns_id == loc.namespace_id
            last = rec.last_access_ns if rec is not None and in_manifest else 0
            files.append(CacheFile(loc.namespace_id, loc.digest, loc.path, st.st_size,
                                   st.st_mtime_ns, max(last, 0) or st.st_mtime_ns, in_manifest,
                                   st.st_ino, st.st_dev))
        return files

    def quarantined(self) -> list[tuple[Path, int]]:
        """(path, size) of the files in the quarantine directory (never through a link)."""
        out = []
        for entry in scandir_beneath(self.path, "quarantine"):
            if entry.is_file(follow_symlinks=False):
                try:
                    out.append((self.layout.quarantine_dir / entry.name,
                                entry.stat(follow_symlinks=False).st_size))
                except OSError:
                    continue
        return out

    def unlink(self, path: Path) -> None:
        """Remove a file of this tree without following a link in its directories."""
        unlink_beneath(self.path, self.layout.relative(path))


def require_namespace(roots: list[CacheRoot], name_or_id: str) -> None:
    """``CLIError`` (naming the namespaces there are) when no root holds ``name_or_id``."""
    errors = []
    for root in roots:
        try:
            root.resolve_namespace(name_or_id)
            return
        except CLIError as exc:
            errors.append(str(exc))
    raise CLIError("; ".join(errors))


def same_file(path: Path, ref: CacheFile | os.stat_result) -> bool:
    """Whether ``path`` is still the file that was looked at (not replaced meanwhile)."""
    where = split_tree_path(path)
    try:
        st = lstat_beneath(*where) if where is not None else os.lstat(path)
    except (OSError, ValueError):
        return False
    want = ((ref.ino, ref.dev, ref.size, ref.mtime_ns) if isinstance(ref, CacheFile)
            else (ref.st_ino, ref.st_dev, ref.st_size, ref.st_mtime_ns))
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns) == want


def namespace_row(ns_id: str, name: str) -> dict[str, Any]:
    """A namespace as reports show it: id, name, and the model (with salt) and build
    (None: bound to none) the name says."""
    model, build = split_build(name)
    return {"id": ns_id, "name": name, "model": model, "build": build}


def relative(root: CacheRoot, path: Path) -> str:
    try:
        return str(path.relative_to(root.path))
    except ValueError:
        return str(path)
