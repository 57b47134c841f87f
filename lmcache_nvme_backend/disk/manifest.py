"""Persisted index snapshot of one root: recency order, sizes and tensor metadata.

The directory tree is the truth about which chunks exist; the manifest adds
what a directory listing cannot give cheaply (LRU order, the tensor metadata
needed to allocate before reading, sizes without a ``stat`` per file).  It is
written atomically (temporary file + rename) at close and periodically, and a
missing, stale or damaged manifest only costs a ``stat`` and a header read per
chunk during recovery, never a wrong entry.
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

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"


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
    """Write the entries (LRU order) of one root.

    Rows are encoded ``batch`` at a time so this background work never holds the
    GIL for long: one ``json.dump`` of a million rows would stall the engine's
    threads for about a second.
    """
    metas: dict[TensorMeta, int] = {}
    rows = []
    for e in entries:
        meta_ref = -1 if e.meta is None else metas.setdefault(e.meta, len(metas))
        rows.append([e.digest, e.ns_id, e.size, e.last_access_ns, meta_ref])
    index_dir.mkdir(parents=True, exist_ok=True)
    final = index_dir / MANIFEST_NAME
    tmp = index_dir / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode)
    os.fchmod(fd, file_mode)  # exactly file_mode, whatever the umask
    with os.fdopen(fd, "w") as f:
        meta_docs = ",".join(m.to_json().decode() for m in metas)
        f.write(f'{{"version":{MANIFEST_VERSION},"metas":[{meta_docs}],"entries":[')
        for start in range(0, len(rows), batch):
            encoded = json.dumps(rows[start : start + batch], separators=(",", ":"))[1:-1]
            f.write(("," if start else "") + encoded)
        f.write("]}")
    os.replace(tmp, final)


def load_manifest(index_dir: Path) -> dict[str, ManifestRecord]:
    """Records by digest; empty (with a log line) when the manifest is missing or unreadable."""
    path = index_dir / MANIFEST_NAME
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("version") != MANIFEST_VERSION:
            raise ValueError(f"manifest version {doc.get('version')}")
        metas = [TensorMeta.from_json(json.dumps(m).encode()) for m in doc["metas"]]
        records = {}
        for digest, ns_id, size, last_access_ns, meta_ref in doc["entries"]:
            meta = metas[meta_ref] if meta_ref >= 0 else None
            records[str(digest)] = ManifestRecord(str(ns_id), int(size), int(last_access_ns), meta)
        return records
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, IndexError, FormatError) as exc:
        logger.warning("Ignoring unreadable manifest %s (%s); rebuilding from the directory.",
                       path, exc)
        return {}
