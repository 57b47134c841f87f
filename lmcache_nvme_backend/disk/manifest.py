"""Persisted index snapshot of one root: recency order, sizes and tensor metadata.

The directory tree is the truth about which chunks exist; the manifest adds what a listing
cannot give cheaply.  A missing, stale or damaged manifest only costs a ``stat`` and a
header read per chunk during recovery, never a wrong entry.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .format import FormatError, TensorMeta
from .layout import DIGEST_RE, NS_ID_RE, TempFile, this_host
from .safe_fs import (
    create_beneath,
    dir_mode_for,
    makedirs_beneath,
    read_small_file,
    remove_quietly,
    rename_beneath,
    scandir_beneath,
    unlink_beneath,
)

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
TEMP_PREFIX = f".{MANIFEST_NAME}.tmp-"
# A manifest larger than this is never read (a real one holds ~100 bytes per chunk).
DEFAULT_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class ManifestRecord:
    ns_id: str
    size: int
    last_access_ns: int
    meta: TensorMeta | None


class ManifestRow(Protocol):
    """What the manifest keeps of one indexed chunk (the store's index entries have it)."""

    digest: str
    ns_id: str
    size: int
    last_access_ns: int
    meta: TensorMeta | None


def save_manifest(index_dir: Path, entries: Sequence[ManifestRow], file_mode: int,
                  batch: int = 4096) -> None:
    """Write the entries (LRU order) of one root, atomically, never through a link; rows
    are encoded ``batch`` at a time (a million at once would hold the GIL for a second)."""
    metas: dict[TensorMeta, int] = {}
    rows = []
    for e in entries:
        meta_ref = -1 if e.meta is None else metas.setdefault(e.meta, len(metas))
        rows.append([e.digest, e.ns_id, e.size, e.last_access_ns, meta_ref])
    root, index_name = index_dir.parent, index_dir.name
    makedirs_beneath(root, index_name, dir_mode_for(file_mode))
    tmp_rel = f"{index_name}/{TEMP_PREFIX}{this_host()}-{os.getpid()}"
    try:
        fd = create_beneath(root, tmp_rel, file_mode)
    except FileExistsError:  # left by a dead process with our pid, or planted: never followed
        unlink_beneath(root, tmp_rel)
        fd = create_beneath(root, tmp_rel, file_mode)
    try:
        with os.fdopen(fd, "w") as f:
            meta_docs = ",".join(m.to_json().decode() for m in metas)
            f.write(f'{{"version":{MANIFEST_VERSION},"metas":[{meta_docs}],"entries":[')
            for start in range(0, len(rows), batch):
                encoded = json.dumps(rows[start : start + batch], separators=(",", ":"))[1:-1]
                f.write(("," if start else "") + encoded)
            f.write("]}")
        rename_beneath(root, tmp_rel, f"{index_name}/{MANIFEST_NAME}")
    except BaseException:
        remove_quietly(root, tmp_rel)
        raise


def load_manifest(index_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, ManifestRecord]:
    """Records by digest; empty (logged) when the manifest is missing or unreadable.  Advice
    only: rows this version does not write are skipped, a file over ``max_bytes`` unread."""
    path = index_dir / MANIFEST_NAME
    try:
        raw = read_small_file(index_dir.parent, f"{index_dir.name}/{MANIFEST_NAME}",
                              max_bytes + 1)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("Ignoring unreadable manifest %s (%s); rebuilding from the directory.",
                       path, exc)
        return {}
    if len(raw) > max_bytes:
        logger.warning("Ignoring manifest %s: larger than %d bytes, more than this tree's "
                       "chunks can need; rebuilding from the directory.", path, max_bytes)
        return {}
    try:
        doc = json.loads(raw, parse_constant=_reject_constant)
        return _records(doc)
    except (ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError,
            MemoryError) as exc:
        logger.warning("Ignoring unreadable manifest %s (%s); rebuilding from the directory.",
                       path, str(exc)[:200])
        return {}


def _reject_constant(name: str) -> object:
    raise ValueError(f"non-finite number {name}")


def _records(doc: object) -> dict[str, ManifestRecord]:
    if not isinstance(doc, dict):
        raise ValueError(f"manifest is a JSON {type(doc).__name__}, not an object")
    if doc.get("version") != MANIFEST_VERSION:
        raise ValueError(f"manifest version {str(doc.get('version'))[:20]}")
    meta_docs, rows = doc.get("metas"), doc.get("entries")
    if not isinstance(meta_docs, list) or not isinstance(rows, list):
        raise ValueError("manifest lacks metas or entries lists")
    metas: list[TensorMeta | None] = []
    for m in meta_docs:
        try:
            metas.append(TensorMeta.from_json(json.dumps(m).encode()))
        except (FormatError, ValueError, TypeError, RecursionError):
            metas.append(None)
    records: dict[str, ManifestRecord] = {}
    skipped = 0
    for row in rows:
        rec = _record(row, metas)
        if rec is None:
            skipped += 1
        else:
            records[row[0]] = rec
    if skipped:
        logger.warning("Manifest: %d rows are not index rows; skipped (their chunks are "
                       "indexed from the directory).", skipped)
    return records


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _record(row: object, metas: list[TensorMeta | None]) -> ManifestRecord | None:
    if not isinstance(row, list) or len(row) != 5:
        return None
    digest, ns_id, size, last_access_ns, meta_ref = row
    if not (isinstance(digest, str) and DIGEST_RE.match(digest) and isinstance(ns_id, str)
            and NS_ID_RE.match(ns_id) and _is_int(size, 0, 1 << 62)
            and _is_int(last_access_ns, 0, 1 << 63) and _is_int(meta_ref, -1, len(metas) - 1)):
        return None
    return ManifestRecord(ns_id, size, last_access_ns, metas[meta_ref] if meta_ref >= 0 else None)


def remove_stale_manifest_temps(index_dir: Path) -> int:
    """Remove the temporary manifests of dead writers (``TempFile.is_stale``); how many.
    They are ``.manifest.json.tmp-<host>-<pid>`` (``-<pid>`` by earlier versions: this host)."""
    removed = 0
    for entry in scandir_beneath(index_dir.parent, index_dir.name):
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        host, _, pid = entry.name[len(TEMP_PREFIX) :].rpartition("-")
        tmp = TempFile(index_dir / entry.name, host or this_host(),
                       int(pid) if pid.isdigit() else -1)
        if tmp.is_stale() and remove_quietly(index_dir.parent, f"{index_dir.name}/{entry.name}"):
            removed += 1
    return removed
