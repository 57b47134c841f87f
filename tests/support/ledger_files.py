"""Writing ledger versions by hand, as a damaged, buggy or foreign member would (the
shared-mode damage tests): the next version of a directory's ledger, edited, or any bytes
or special file at a version's name."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.disk.coordination import version_path
from lmcache_nvme_backend.store.shared.ledger import LedgerChain, LedgerDoc

READER = "planter-1-00000000"


def newest(root: Path) -> tuple[LedgerDoc, int]:
    """The newest valid version and the number the next one takes."""
    doc, n = LedgerChain(root, READER, 0o600, 0o700)._latest()
    assert doc is not None, f"{root} has no ledger"
    return doc, n


def successor(root: Path, edit: Callable[[dict[str, Any]], None] = lambda _: None,
              ahead: int = 0) -> tuple[int, bytes]:
    """The next version (``ahead`` numbers further on) as JSON bytes, naming the newest
    as its predecessor, after ``edit`` changed its fields (no validation)."""
    doc, n = newest(root)
    fields = json.loads(doc.to_json())
    fields.update(n=n + ahead, prev=doc.digest)
    edit(fields)
    return n + ahead, json.dumps(fields).encode()


def version_file(root: Path, n: int) -> Path:
    path = root / version_path(n)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plant(root: Path, n: int, raw: bytes) -> Path:
    """Write ``raw`` as version ``n`` (as a member's link would: in one step)."""
    path = version_file(root, n)
    tmp = path.with_name(f".planted-{n}")
    tmp.write_bytes(raw)
    os.link(tmp, path)
    tmp.unlink()
    return path
