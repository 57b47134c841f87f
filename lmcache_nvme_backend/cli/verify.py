"""``lmcache-nvme verify PATH...``: decode every header and check every payload checksum.

The store's checks before it serves a chunk (``docs/format.md``), plus the key against the
file's name, the namespace against its directory and the exact file size.  Payloads are
read through the store's I/O engine, with O_DIRECT where supported (a server's page cache
is left alone).  ``--quarantine`` renames a bad file into ``<root>/quarantine/`` unless it
changed since it was read; without it nothing is written.  Links and special files at chunk
names are reported as skipped, never read.
"""

from __future__ import annotations

import argparse
import itertools
import os
import stat
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..disk.format import ChunkHeader, padded_length, text_bytes
from ..disk.layout import MARKER_NAME
from ..disk.safe_fs import (
    dir_mode_for,
    lstat_beneath,
    makedirs_beneath,
    rename_beneath,
    root_descriptor,
)
from ..disk.validate import Defect, Expected, defect, judge_chunk
from ..io import engine_for
from ..io.buffers import AlignedBuffer
from ..io.engine import OK, ReadShare
from ..io.files import read_failure
from ..io.posix import NotAChunkFile, ShortFileError, probe_direct_read, read_header
from .cache import CacheFile, CacheRoot, relative, same_file
from .common import (
    MIB,
    Progress,
    add_output_options,
    cache_dir_command,
    human_bytes,
    positive_int,
    print_json,
)

TASK_SIZE = 4 * MIB
#: A batch of payload reads: files up to this many bytes on disk (a larger one alone).
BATCH_BYTES = 64 * MIB


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cache_dir_command(
        sub, "verify", "check every chunk file's header and payload checksum",
        "Decode every chunk header and check every payload checksum, the stored key against "
        "the file name and the file size. Read-only unless --quarantine; safe while a server "
        "uses the directory.",
        "exit status: 0 every file is valid, 1 bad files, or links / directories / special "
        "files at chunk names, were found (or PATH is not a cache directory), 2 usage error",
        paths_help="cache directory (nvme.path)")
    p.add_argument("--quarantine", action="store_true",
                   help="move bad files into <PATH>/quarantine/ (a running server then "
                        "treats them as misses)")
    p.add_argument("--threads", type=positive_int, default=4, metavar="N",
                   help="files checked in parallel (default 4)")
    add_output_options(p)
    p.add_argument("--progress", action="store_true",
                   help="show the progress bar even when stderr is not a terminal")
    p.set_defaults(func=run)
    return p


@dataclass
class Outcome:
    """What checking one file found (``reason`` None: valid); ``header``, ``raw`` and
    ``expected`` keep a valid header for the payload's check."""

    file: CacheFile
    reason: str | None = None
    vanished: bool = False
    payload_bytes: int = 0
    stat: os.stat_result | None = None
    header: ChunkHeader | None = None
    raw: bytes = b""
    expected: Expected | None = None

    def failed(self, exc: OSError) -> None:
        """The file could not be read: gone (vanished), or why not."""
        if isinstance(exc, FileNotFoundError):
            self.vanished = True
        elif isinstance(exc, NotAChunkFile):
            self.reason = f"not a chunk file: {exc.strerror}"
        elif isinstance(exc, ShortFileError):
            self.reason = defect(Defect.SHORT, str(exc)).reason
        else:
            self.reason = f"read error: {exc.strerror or exc}"

    def unserved(self, header: ChunkHeader, err: int, landed: bytes | None,
                 computed: int) -> None:
        """The engine did not serve the payload: the read failed (``err``), or the validator
        says why of what ``landed`` with checksum ``computed`` (as ``store/reads.py``)."""
        if landed is None:
            self.failed(read_failure(self.file.path, err))
        elif landed != self.raw:
            self.vanished = True  # replaced while being checked
        else:
            assert self.expected is not None
            verdict = judge_chunk(landed, self.expected,
                                  lambda h: h.payload_checksum == computed)
            self.reason = None if verdict.ok else verdict.reason
            self.payload_bytes = header.payload_len if verdict.ok else 0


_Group = list[tuple[Outcome, ChunkHeader]]  # the files of one namespace and layout


class Verifier:
    """Checks the files of one root: headers on ``threads`` threads, then each batch's
    payloads through an I/O engine of ``threads`` readers."""

    def __init__(self, root: CacheRoot, threads: int) -> None:
        self.root = root
        self.direct = probe_direct_read(root.path / MARKER_NAME)  # writes nothing
        self._root_fd = root_descriptor(root.layout.root_str)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="verify")
        self.engine = engine_for("auto", threads, 1, TASK_SIZE)
        self._buffer = AlignedBuffer(0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.close()
        self._buffer.close()

    def check(self, files: list[CacheFile]) -> list[Outcome]:
        """The outcome of each file: its header judged, then its payload read and verified."""
        outcomes = list(self._pool.map(self._check_header, files))
        groups: dict[tuple[str, bytes], _Group] = {}
        for out in outcomes:
            if out.header is not None:
                groups.setdefault((out.file.ns_id, out.header.tensor_meta.to_json()),
                                  []).append((out, out.header))
        if groups:
            self._check_payloads(groups)
        return outcomes

    def _check_header(self, f: CacheFile) -> Outcome:
        out = Outcome(f)
        try:
            out.stat = lstat_beneath(self.root.path, self.root.layout.relative(f.path))
            raw, size = read_header(f.path, self.direct)
        except OSError as exc:
            out.failed(exc)
            return out
        out.expected = Expected(digest=f.digest, ns_id=f.ns_id, file_size=size)
        verdict = judge_chunk(raw, out.expected)
        if verdict.ok:
            out.header, out.raw = verdict.header, raw
        else:
            out.reason = verdict.reason
        return out

    def _check_payloads(self, groups: dict[tuple[str, bytes], _Group]) -> None:
        """Read the files whose headers passed, one share per namespace and layout, and
        judge each one the engine did not serve (as ``store/reads.py`` does)."""
        sizes = [padded_length(header.payload_len) for mine in groups.values()
                 for _, header in mine]
        if sum(sizes) > self._buffer.size:
            self._buffer.close()
            self._buffer = AlignedBuffer(sum(sizes))
        dests = [self._buffer.view[start:end]
                 for start, end in itertools.pairwise([0, *itertools.accumulate(sizes)])]
        shares: list[ReadShare] = []
        order: _Group = []
        for (ns_id, meta), mine in groups.items():
            views = dests[len(order) : len(order) + len(mine)]
            shares.append((self._root_fd, self.root.layout.chunk_naming(ns_id), self.direct,
                           mine[0][1].payload_len, meta, [out.file.digest for out, _ in mine],
                           views, [text_bytes(header.key) for _, header in mine]))
            order += mine
        try:
            batch = self.engine.read(shares)
        finally:
            for view in dests:
                view.release()
        details = {detail[0]: detail for detail in batch.details}
        for k, (out, header) in enumerate(order):
            if batch.statuses[k] == OK:
                out.payload_bytes = header.payload_len
            else:
                out.unserved(header, *details[k][1:])


def batches(files: list[CacheFile]) -> Iterator[list[CacheFile]]:
    """The files in batches of at most ``BATCH_BYTES`` on disk (a larger file alone)."""
    batch: list[CacheFile] = []
    nbytes = 0
    for f in files:
        if batch and nbytes + f.size > BATCH_BYTES:
            yield batch
            batch, nbytes = [], 0
        batch.append(f)
        nbytes += f.size
    if batch:
        yield batch


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
               for p, kind in root.layout.iter_special_entries()]
    started = time.perf_counter()
    progress = Progress(progress_enabled, sum(f.size for f in files), f"verify {root.path}")
    verifier = Verifier(root, threads)
    outcomes: list[Outcome] = []
    try:
        for batch in batches(files):
            outcomes += verifier.check(batch)
            progress.advance(sum(f.size for f in batch))
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
