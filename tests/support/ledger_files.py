"""Writing ledger versions by hand, as a damaged, buggy or foreign member would (the
shared-mode damage tests and the fault harness): the next version of a directory's ledger,
edited, or any bytes or special file at a version's name (``ledger_damage``: each kind the
members must set aside); and a foreign member's lease kept moving (``renewed_lease``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.disk.coordination import version_path
from lmcache_nvme_backend.store.shared.leases import Lease, write_lease
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


def edit_field(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit (``successor``) setting the field at a dotted ``path`` (``*``: the first
    entry of a mapping, e.g. ``accounts.*.cap``)."""
    def edit(fields: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = fields
        for key in parents:
            target = target[key] if key != "*" else next(iter(target.values()))
        target[last] = value
    return edit


def _special(kind: str) -> Callable[[Path, int], Path]:
    def make(root: Path, n: int) -> Path:
        path = version_file(root, n)
        if kind == "symlink":
            path.symlink_to(root / "elsewhere.json")
            (root / "elsewhere.json").write_bytes(successor(root)[1])
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
        return path
    return make


def _bytes(make: Callable[[Path], bytes]) -> Callable[[Path, int], Path]:
    return lambda root, n: plant(root, n, make(root))


def ledger_damage(budget: int) -> dict[str, Callable[[Path, int], Path]]:
    """Each kind of damaged version, by name: ``make(root, n)`` puts it at number ``n``
    and returns its path (the negative caps are four budgets of ``budget``)."""
    return {
        "truncated": _bytes(lambda root: successor(root)[1][:40]),
        "not json": _bytes(lambda root: b"\x00\xff not a ledger"),
        "nan": _bytes(lambda root: successor(root, edit_field("budget", math.nan))[1]),
        "n mismatch": _bytes(lambda root: successor(
            root, lambda f: f.update(n=f["n"] + 7))[1]),
        "negative orphan cap": _bytes(lambda root: successor(
            root, edit_field("orphans.cap", -4 * budget))[1]),
        "negative member cap": _bytes(lambda root: successor(
            root, edit_field("accounts.*.cap", -4 * budget))[1]),
        "symlink": _special("symlink"),
        "fifo": _special("fifo"),
        "directory": _special("directory"),
    }


@contextlib.contextmanager
def renewed_lease(root: Path, member: str, ledger_format: int, budget: int
                  ) -> Iterator[None]:
    """A lease of ``member`` (on another host) renewed every 0.2 s, whose janitor counter
    never moves: a member that does nothing (a stuck or foreign process rewriting it)."""
    stop = threading.Event()
    lease = Lease(member, host=member.split("-")[0], pid=1, budget=budget,
                  ledger_format=ledger_format)
    (root / "shared" / "members").mkdir(parents=True, exist_ok=True)
    write_lease(root, lease, 0o600)

    def renew() -> None:
        while not stop.wait(0.2):
            lease.seq += 1
            write_lease(root, lease, 0o600)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
