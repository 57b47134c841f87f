"""``lmcache-nvme verify PATH...``: decode every header and check every payload checksum.

The checks are the ones the store makes before serving a chunk (see
``docs/format.md``, "Validation a reader must do"), plus the ones a listing
allows: the stored key hashes to the file's name, the namespace to its
directory, and the file has exactly the size the header implies.  Reads go
through the backend's engine (O_DIRECT where the filesystem supports it, so a
server's page cache is not disturbed).

With ``--quarantine`` a bad file is renamed into ``<root>/quarantine/`` (the
store's naming) unless it changed since it was read; a running store treats
the vanished file as a miss.  Nothing is rewritten in place, and without
``--quarantine`` nothing is written at all (the O_DIRECT probe reads the
marker file), so it runs on a full or read-only filesystem.  Links, directories
and special files at chunk names are reported as skipped, never followed or read.
"""

from __future__ import annotations

import argparse
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..disk.layout import MARKER_NAME
from ..disk.safe_fs import dir_mode_for, lstat_beneath, makedirs_beneath, rename_beneath
from ..disk.validate import Defect, Expected, Verdict, defect, judge_chunk
from ..io.buffers import AlignedBuffer
from ..io.posix import NotAChunkFile, PosixIOEngine, ReadRequest, ShortFileError, probe_direct_read
from .cache import CacheFile, CacheRoot, relative, same_file
from .common import MIB, Progress, human_bytes, positive_int, print_json

TASK_SIZE = 4 * MIB


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "verify", help="check every chunk file's header and payload checksum",
        description="Decode every chunk header and check every payload checksum, the "
                    "stored key against the file name and the file size. Read-only unless "
                    "--quarantine; safe while a server uses the directory.",
        epilog="exit status: 0 every file is valid, 1 bad files, or links / directories / "
               "special files at chunk names, were found (or PATH is not a cache directory), "
               "2 usage error")
    p.add_argument("paths", metavar="PATH", type=Path, nargs="+",
                   help="cache directory (nvme.path)")
    p.add_argument("--quarantine", action="store_true",
                   help="move bad files into <PATH>/quarantine/ (a running server then "
                        "treats them as misses)")
    p.add_argument("--threads", type=positive_int, default=4, metavar="N",
                   help="files checked in parallel (default 4)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--progress", action="store_true",
                   help="show the progress bar even when stderr is not a terminal")
    p.set_defaults(func=run)
    return p


@dataclass
class Outcome:
    """What checking one file found: ``None`` reason means valid."""

    file: CacheFile
    reason: str | None = None
    vanished: bool = False
    payload_bytes: int = 0
    stat: os.stat_result | None = None


class Verifier:
    """Checks the files of one root with the backend's engine."""

    def __init__(self, root: CacheRoot, threads: int) -> None:
        self.root = root
        self.direct = probe_direct_read(root.path / MARKER_NAME)  # writes nothing
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="verify-io")
        self.engine = PosixIOEngine(TASK_SIZE, self._pool)
        self._local = threading.local()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _buffer(self, size: int) -> memoryview:
        buf: AlignedBuffer | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < size:
            if buf is not None:
                buf.close()
            buf = self._local.buf = AlignedBuffer(size)
        return buf.view

    def check(self, f: CacheFile) -> Outcome:
        out = Outcome(f)
        try:
            out.stat = lstat_beneath(self.root.path, self.root.layout.relative(f.path))
            raw, size = self.engine.read_header(f.path, self.direct)
            expected = Expected(digest=f.digest, ns_id=f.ns_id, file_size=size)
            verdict = judge_chunk(raw, expected)
            if verdict.ok and verdict.header is not None:
                verdict = self._check_payload(f, raw, verdict.header.payload_len, expected)
            out.reason = None if verdict.ok else verdict.reason
            if verdict.ok and verdict.header is not None:
                out.payload_bytes = verdict.header.payload_len
        except FileNotFoundError:
            out.vanished = True
        except NotAChunkFile as exc:
            out.reason = f"not a chunk file: {exc.strerror}"
        except OSError as exc:
            out.reason = f"read error: {exc.strerror or exc}"
        return out

    def _check_payload(self, f: CacheFile, raw: bytes, payload_len: int,
                       expected: Expected) -> Verdict:
        """Read the whole file again (header with the payload) and judge it with its payload."""
        dest = self._buffer(payload_len)
        req = ReadRequest(f.path, payload_len, dest, self.direct)
        self.engine.read_chunks([req])
        if isinstance(req.error, ShortFileError):
            return defect(Defect.SHORT, str(req.error))
        if req.error is not None:
            raise req.error
        if req.header != raw:
            raise FileNotFoundError("replaced while being checked")
        return judge_chunk(req.header, expected, req.payload_matches)


def quarantine(root: CacheRoot, out: Outcome) -> str | None:
    """Rename a bad file into the quarantine directory if it is still the file checked."""
    if out.stat is None or not same_file(out.file.path, out.stat):
        return None
    target = root.layout.quarantine_path(out.file.digest)
    try:  # never through a link (a planted quarantine/ link is refused)
        makedirs_beneath(root.path, "quarantine", dir_mode_for(stat.S_IMODE(out.stat.st_mode)))
        rename_beneath(root.path, root.layout.relative(out.file.path),
                       root.layout.relative(target))
    except (OSError, ValueError):
        return None
    return relative(root, target)


def verify_root(root: CacheRoot, threads: int, do_quarantine: bool,
                progress_enabled: bool) -> dict[str, Any]:
    files = root.scan()
    skipped = [{"path": relative(root, p), "kind": kind}
               for p, kind in root.special_entries()]
    started = time.perf_counter()
    progress = Progress(progress_enabled, sum(f.size for f in files), f"verify {root.path}")
    verifier = Verifier(root, threads)
    outcomes: list[Outcome] = []
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="verify") as pool:
            for out in pool.map(verifier.check, files):
                outcomes.append(out)
                progress.update(out.file.size)
    finally:
        verifier.close()
        progress.close()
    seconds = time.perf_counter() - started
    bad = []
    for out in outcomes:
        if out.reason is None:
            continue
        moved = quarantine(root, out) if do_quarantine else None
        bad.append({"path": relative(root, out.file.path), "namespace_id": out.file.ns_id,
                    "reason": out.reason, "quarantined_to": moved})
    ok = sum(1 for o in outcomes if o.reason is None and not o.vanished)
    checked_bytes = sum(o.file.size for o in outcomes if not o.vanished)
    return {"path": str(root.path), "files": len(files), "ok": ok, "bad": bad,
            "skipped": skipped,
            "vanished": sum(o.vanished for o in outcomes), "bytes": checked_bytes,
            "payload_bytes": sum(o.payload_bytes for o in outcomes),
            "seconds": round(seconds, 3), "direct_io": verifier.direct}


def run(args: argparse.Namespace) -> int:
    import sys

    roots = [CacheRoot(p) for p in args.paths]
    progress = args.progress or sys.stderr.isatty()
    reports = [verify_root(r, args.threads, args.quarantine, progress) for r in roots]
    any_bad = any(r["bad"] or r["skipped"] for r in reports)
    if args.json:
        print_json({"command": "verify", "roots": reports, "ok": not any_bad})
        return 1 if any_bad else 0
    for rep in reports:
        rate = rep["bytes"] / rep["seconds"] / 1e9 if rep["seconds"] > 0 else 0.0
        print(f"{rep['path']}: checked {rep['files']} chunk files "
              f"({human_bytes(rep['bytes'])}) in {rep['seconds']:.2f} s ({rate:.2f} GB/s, "
              f"{'O_DIRECT' if rep['direct_io'] else 'buffered'}): {rep['ok']} ok, "
              f"{len(rep['bad'])} bad, {rep['vanished']} removed by the server meanwhile")
        for b in rep["bad"]:
            where = (f" -> quarantined as {b['quarantined_to']}" if b["quarantined_to"]
                     else (" (left in place: changed or vanished meanwhile)"
                           if args.quarantine else ""))
            print(f"  BAD {b['path']}: {b['reason']}{where}")
        for sk in rep["skipped"]:
            print(f"  SKIPPED {sk['path']}: a {sk['kind']} at a chunk file's name (never "
                  "followed or read; the server treats it as a miss; remove it)")
    if any_bad and not args.quarantine:
        print("Bad files are never served (the store checks on every read and quarantines "
              "them); run with --quarantine to move them out now.")
    return 1 if any_bad else 0
