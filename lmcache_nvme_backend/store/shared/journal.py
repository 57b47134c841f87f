"""Member journals: what each member of a shared root published, deleted and read.

Every member appends to its own file (``shared/members/<member>.<gen>.journal``) and
reads the others' in the background, so each member's in-memory index holds the whole
directory and a lookup never touches the filesystem.  One record per line, each with
its own checksum, so a line still being appended (or torn by a crash) is never taken::

    <xxh32 of the rest, 8 hex> P <digest> <ns_id> <size> <tensor meta JSON | ->   published
    <xxh32> D <digest>                                              deleted (claimed)
    <xxh32> A <digest> [<digest> ...]                               read (recency)
    <xxh32> S / Z                                   begin / end of a snapshot (new generation)

A journal much larger than what it describes starts its next generation with a snapshot
(``S``, one ``P`` per chunk owned, ``Z``); the old file goes a little later, once read.
Readers use O_DIRECT where the root supports it: through GlusterFS a buffered reader saw
appends up to a second late, an O_DIRECT one within milliseconds (docs/deployment.md).

A journal is another process's file, so it is read as untrusted input: a line is refused
(counted, and a warning names the file and the field) unless it is at most ``MAX_LINE``
bytes of ASCII, its checksum fits and every field is well-formed: 32-hex digests, 16-hex
namespace ids, at most ``ACCESS_PER_LINE`` digests to an ``A`` line, and a ``P`` size that
a chunk file can have (``chunk_file_size_ok``).  A reader takes at most ``POLL_BYTES`` of
one journal per poll (the rest at the next), and sets a generation aside (a warning, and
the member's next generation is followed) when it is not a regular file or holds more
than ``JOURNAL_LIMIT`` bytes; writers start a new generation long before that.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ...disk.coordination import MEMBERS_DIR, journal_path, parse_journal_name
from ...disk.format import (
    ALIGNMENT,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    FormatError,
    TensorMeta,
    file_size_for,
)
from ...disk.layout import DIGEST_RE, NS_ID_RE
from ...disk.safe_fs import (
    NotAChunkFile,
    create_beneath,
    open_regular,
    remove_quietly,
    scandir_beneath,
)
from ...io.buffers import AlignedBuffer
from ..stats import Counter, StoreStats

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
READ_BYTES = 1 << 20
POLL_BYTES = 4 << 20  # read from one journal per poll; the rest at the next poll
# The longest record: a ``P`` line with metadata (at most a header's 4 KiB) is shorter.
MAX_LINE = 8 << 10
ACCESS_PER_LINE = 64
# A generation larger than this is damage to its readers: they set it aside.
JOURNAL_LIMIT = 4 << 30
# A generation is rotated once it is this large and four times its snapshot's size, and
# always past a quarter of JOURNAL_LIMIT (so a legitimate one never comes near it).
ROTATE_BYTES = 8 << 20
RETIRE_AFTER_S = 5.0  # an old generation outlives its successor by this long
REFUSED_SAID_EVERY_S = 60.0  # appends the filesystem refuses: one warning this often
MAX_CHUNK_FILE = file_size_for(MAX_PAYLOAD_BYTES)
_SIZE_RE = re.compile(r"[0-9]{1,12}")
_CRC_RE = re.compile(r"[0-9a-f]{8}")

# What a refused line's field had to be (the warning quotes it).
RULES = {
    "line length": f"a record is at most {MAX_LINE} bytes",
    "encoding": "records are ASCII",
    "checksum": "the first field is the xxh32 of the rest of the line",
    "record kind": "P, D, A, S or Z, with S and Z around a snapshot",
    "digest": "digests are 32 lowercase hex digits",
    "namespace id": "namespace ids are 16 lowercase hex digits",
    "digest count": f"an A record lists 1 to {ACCESS_PER_LINE} digests",
    "size": f"a P record's size is a chunk file's: {HEADER_SIZE} to {MAX_CHUNK_FILE} bytes, "
            f"a multiple of {ALIGNMENT}, the size its metadata gives",
    "metadata": "a P record's metadata is a chunk header's tensor metadata, or -",
}


class Refused(ValueError):
    """A journal line that fails a rule (``field``: the key of ``RULES`` it broke)."""

    def __init__(self, field: str) -> None:
        super().__init__(field)
        self.field = field


@dataclass(frozen=True)
class Published:
    digest: str
    ns_id: str
    size: int
    meta: TensorMeta | None


@dataclass
class Batch:
    """What one poll read from one member's journal."""

    member: str
    # in journal order, a later record of a digest replacing an earlier one
    published: dict[str, Published] = field(default_factory=dict)
    deleted: dict[str, None] = field(default_factory=dict)
    accessed: list[str] = field(default_factory=list)
    # a complete snapshot was read: the member owns exactly the digests in ``snapshot``
    snapshot: set[str] | None = None
    refused: dict[str, int] = field(default_factory=dict)  # lines refused, by field
    # read from its start (a member seen for the first time, or a new generation), and not
    # yet to its end: history, whose records of different members cannot be put in order;
    # the directory says what still exists
    first: bool = False

    def __bool__(self) -> bool:
        return bool(self.published or self.deleted or self.accessed or self.refused or
                    self.snapshot is not None)


def published_line(digest: str, ns_id: str, size: int, meta: TensorMeta | None) -> bytes:
    return _line(f"P {digest} {ns_id} {size} "
                 f"{meta.to_json().decode() if meta is not None else '-'}")


def deleted_line(digest: str) -> bytes:
    return _line(f"D {digest}")


def accessed_lines(digests: Sequence[str]) -> list[bytes]:
    return [_line("A " + " ".join(digests[i : i + ACCESS_PER_LINE]))
            for i in range(0, len(digests), ACCESS_PER_LINE)]


def _line(body: str) -> bytes:
    return f"{xxhash.xxh32_intdigest(body.encode()):08x} {body}\n".encode()


def chunk_file_size_ok(size: int, meta: TensorMeta | None) -> bool:
    """Whether ``size`` is one a chunk file of this format can have (with ``meta``: the
    one its payload gives)."""
    if meta is not None:
        return size == file_size_for(meta.nbytes)
    return HEADER_SIZE <= size <= MAX_CHUNK_FILE and size % ALIGNMENT == 0


def parse_lines(data: bytes, batch: Batch, snapshot: set[str] | None) -> set[str] | None:
    """Add the complete lines of ``data`` to ``batch``; returns the snapshot being read
    (None outside one).  Lines that break a rule are counted in ``batch.refused``."""
    for raw in data.split(b"\n"):
        if not raw:
            continue
        try:
            snapshot = _parse_line(raw, batch, snapshot)
        except Refused as exc:
            batch.refused[exc.field] = batch.refused.get(exc.field, 0) + 1
    return snapshot


def _parse_line(raw: bytes, batch: Batch, snapshot: set[str] | None) -> set[str] | None:
    if len(raw) > MAX_LINE:
        raise Refused("line length")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise Refused("encoding") from None
    crc, _, body = text.partition(" ")
    if not _CRC_RE.fullmatch(crc) or int(crc, 16) != xxhash.xxh32_intdigest(body.encode()):
        raise Refused("checksum")
    kind, _, rest = body.partition(" ")
    if kind == "P":
        record = _published(rest)
        batch.published[record.digest] = record
        batch.deleted.pop(record.digest, None)  # the later record counts
        if snapshot is not None:
            snapshot.add(record.digest)
    elif kind == "D":
        if not DIGEST_RE.fullmatch(rest):
            raise Refused("digest")
        batch.deleted[rest] = None
        batch.published.pop(rest, None)
    elif kind == "A":
        digests = rest.split(" ")
        if len(digests) > ACCESS_PER_LINE:
            raise Refused("digest count")
        if not all(DIGEST_RE.fullmatch(d) for d in digests):
            raise Refused("digest")
        batch.accessed.extend(digests)
    elif kind == "S" and not rest:
        snapshot = set()
    elif kind == "Z" and not rest and snapshot is not None:
        batch.snapshot, snapshot = snapshot, None
    else:
        raise Refused("record kind")
    return snapshot


def _published(rest: str) -> Published:
    parts = rest.split(" ", 3)
    if len(parts) != 4:
        raise Refused("record kind")
    digest, ns_id, size_text, meta_text = parts
    if not DIGEST_RE.fullmatch(digest):
        raise Refused("digest")
    if not NS_ID_RE.fullmatch(ns_id):
        raise Refused("namespace id")
    try:
        meta = None if meta_text == "-" else TensorMeta.from_json(meta_text.encode())
    except FormatError:
        raise Refused("metadata") from None
    if not _SIZE_RE.fullmatch(size_text) or not chunk_file_size_ok(size := int(size_text), meta):
        raise Refused("size")
    return Published(digest, sys.intern(ns_id), size, meta)  # one string per namespace


class JournalWriter:
    """This member's journal on one root: appends, and generations with snapshots."""

    def __init__(self, root: Path, member: str, file_mode: int) -> None:
        self.root = root
        self.member = member
        self._file_mode = file_mode
        self._lock = threading.Lock()
        self.gen = 1
        self.size = 0
        self._fd = self._create(self.gen, [])
        self._retiring: list[tuple[float, int]] = []  # (when to remove, generation)
        self._refused_said_at = -REFUSED_SAID_EVERY_S

    def _create(self, gen: int, lines: Sequence[bytes]) -> int:
        rel = journal_path(self.member, gen)
        fd = create_beneath(self.root, rel, self._file_mode, os.O_WRONLY | os.O_APPEND)
        try:
            _write_all(fd, b"".join(lines))
        except BaseException:
            os.close(fd)
            remove_quietly(self.root, rel)
            raise
        return fd

    def append(self, lines: Sequence[bytes]) -> None:
        """Append records (one write call: readers see whole lines or nothing new).  Records
        the filesystem refuses (full, failing) are never left half-written; they are lost
        to the other members and said (``_refused``), and the store goes on: a chunk whose
        ``P`` is lost is a miss for them until a snapshot lists it (this member's account
        counts it all the same), a deleted one a miss when they read it."""
        if not lines:
            return
        data = b"".join(lines)
        with self._lock:
            if self._fd < 0:
                return
            try:
                _write_all(self._fd, data)
            except OSError as exc:
                self._refused(exc, f"{len(lines)} record(s) are lost to the other members")
                return
            self.size += len(data)

    def wants_rotation(self, owned: int) -> bool:
        return self.size > ROTATE_BYTES and (self.size > 4 * 120 * max(owned, 1) or
                                             self.size > JOURNAL_LIMIT // 4)

    def rotate(self, owned: Sequence[bytes]) -> None:
        """Start the next generation with a snapshot of the chunks this member owns (the
        current one goes on when the filesystem refuses the new one: tried again later)."""
        lines = [_line("S"), *owned, _line("Z")]
        with self._lock:
            try:
                fd = self._create(self.gen + 1, lines)
            except OSError as exc:
                self._refused(exc, "the journal's next generation is not started yet")
                return
            old, self._fd = self._fd, fd
            os.close(old)
            self._retiring.append((time.monotonic() + RETIRE_AFTER_S, self.gen))
            self.gen += 1
            self.size = sum(len(line) for line in lines)

    def _refused(self, exc: OSError, what: str) -> None:
        """A write to this journal failed: a warning at most every ``REFUSED_SAID_EVERY_S``
        (a full filesystem refuses every append until space frees)."""
        now = time.monotonic()
        level = logging.DEBUG
        if now - self._refused_said_at >= REFUSED_SAID_EVERY_S:
            self._refused_said_at, level = now, logging.WARNING
        logger.log(level, "NVMe tier: cannot write this member's journal %s: %s; %s (said "
                   "at most every %.0f s).", self.root / journal_path(self.member, self.gen),
                   exc.strerror or exc, what, REFUSED_SAID_EVERY_S)

    def retire_old(self, now: float | None = None) -> None:
        """Remove old generations whose successors have been readable long enough."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [g for when, g in self._retiring if when <= now]
            self._retiring = [(w, g) for w, g in self._retiring if w > now]
        for gen in due:
            remove_quietly(self.root, journal_path(self.member, gen))

    def close(self, remove: bool = False) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        if remove:
            for _, gen in self._retiring:
                remove_quietly(self.root, journal_path(self.member, gen))
            remove_quietly(self.root, journal_path(self.member, self.gen))


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` at the end of ``fd``; if that fails, what was written is cut off
    again, so that no half record is left for the next one to run into."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        if len(view) < len(data):
            with contextlib.suppress(OSError):
                os.ftruncate(fd, os.fstat(fd).st_size - (len(data) - len(view)))
        raise


@dataclass
class _Follow:
    member: str
    gen: int
    fd: int
    rel: str
    offset: int = 0
    partial: bytes = b""
    snapshot: set[str] | None = None
    history: bool = True  # not yet read to its end (``Batch.first``)


class JournalTail:
    """Follows the other members' journals on one root, reading only what is new, at most
    ``POLL_BYTES`` of each per poll."""

    def __init__(self, root: Path, own: str, direct: bool, stats: StoreStats) -> None:
        self.root = root
        self.own = own
        self.direct = direct and bool(_O_DIRECT)
        self._stats = stats
        self._follows: dict[str, _Follow] = {}
        self._set_aside: set[tuple[str, int]] = set()  # (member, generation)
        self._warned: set[tuple[str, str]] = set()  # (journal, field) named in a warning
        self._buf: AlignedBuffer | None = None

    def journals(self) -> dict[str, list[int]]:
        """The generations of each other member's journal in the directory."""
        gens: dict[str, list[int]] = {}
        for entry in scandir_beneath(self.root, MEMBERS_DIR):
            parsed = parse_journal_name(entry.name)
            if parsed is not None and parsed[0] != self.own:
                gens.setdefault(parsed[0], []).append(parsed[1])
        return gens

    def poll(self) -> list[Batch]:
        """New records of every other member (from a generation's start when it is new
        here), at most ``POLL_BYTES`` of each journal."""
        batches = []
        listed = self.journals()
        for member in [m for m in self._follows if m not in listed]:
            self._drop(member)
        self._set_aside = {(m, g) for m, g in self._set_aside if g in listed.get(m, ())}
        present = {journal_path(m, g) for m, gens in listed.items() for g in gens}
        self._warned = {(rel, key) for rel, key in self._warned if rel in present}
        for member, gens in listed.items():
            batch = Batch(member)
            newest = max((g for g in gens if (member, g) not in self._set_aside), default=0)
            follow = self._follows.get(member)
            # an older generation is finished first (over several polls if it is long)
            if follow is not None and follow.gen < newest and self._read_new(follow, batch):
                self._drop(member)
                follow = None
            if follow is None and newest:
                follow = self._open(member, newest)
                if follow is not None:
                    self._read_new(follow, batch)
            elif follow is not None and follow.gen >= newest:
                self._read_new(follow, batch)
            if batch:
                batches.append(batch)
        return batches

    def members(self) -> list[str]:
        return list(self._follows)

    def reading_history(self) -> bool:
        """Whether some journal followed has not been read to its end yet."""
        return any(f.history for f in self._follows.values())

    def _open(self, member: str, gen: int) -> _Follow | None:
        rel = journal_path(member, gen)
        fd = -1
        if self.direct:
            with contextlib.suppress(OSError):
                fd = open_regular(self.root, rel, os.O_RDONLY | _O_DIRECT)
        try:
            if fd < 0:
                fd = open_regular(self.root, rel)
            size = os.fstat(fd).st_size
        except NotAChunkFile as exc:  # a link, directory, FIFO...: never ours
            self._put_aside(member, gen, exc.strerror or str(exc))
            return None
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if exc.errno != errno.ENOENT:  # else gone: rotated or removed meanwhile
                self._warn(rel, "open", "NVMe tier: cannot open journal %s: %s (tried again "
                           "at the next poll).", self.root / rel, exc)
            return None
        if size > JOURNAL_LIMIT:
            os.close(fd)
            self._put_aside(member, gen, f"it holds {size} bytes, more than the {JOURNAL_LIMIT} "
                                         "a journal may")
            return None
        follow = _Follow(member, gen, fd, rel)
        self._follows[member] = follow
        return follow

    def _put_aside(self, member: str, gen: int, why: str) -> None:
        self._set_aside.add((member, gen))
        self._stats.add(Counter.SHARED_JOURNALS_SET_ASIDE)
        logger.warning("NVMe tier: journal %s: set aside, not read (%s); the chunks member %s "
                       "published there are served from the directory listing, and its next "
                       "generation is followed.", self.root / journal_path(member, gen), why,
                       member)

    def _drop(self, member: str) -> None:
        follow = self._follows.pop(member, None)
        if follow is not None:
            os.close(follow.fd)

    def _read_new(self, follow: _Follow, batch: Batch) -> bool:
        """Parse up to ``POLL_BYTES`` appended since the last read into ``batch``; whether
        the end of the file was reached."""
        batch.first |= follow.history
        refused_before = dict(batch.refused)
        try:
            return self._read_into(follow, batch)
        finally:
            self._report(follow.rel, {k: n - refused_before.get(k, 0)
                                      for k, n in batch.refused.items()})

    def _read_into(self, follow: _Follow, batch: Batch) -> bool:
        budget = POLL_BYTES
        while budget > 0:
            try:
                got = self._pread(follow)
            except OSError as exc:
                self._warn(follow.rel, "read", "NVMe tier: cannot read journal %s at byte %d: "
                           "%s (tried again at the next poll).", self.root / follow.rel,
                           follow.offset, exc)
                return False
            follow.offset += len(got)
            budget -= len(got)
            if follow.offset > JOURNAL_LIMIT:
                self._drop(follow.member)
                self._put_aside(follow.member, follow.gen, f"it grew past the {JOURNAL_LIMIT} "
                                                           "bytes a journal may hold")
                return False
            data = follow.partial + got
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) > MAX_LINE:
                data = b""  # no line this long is ours: skip it
                batch.refused["line length"] = batch.refused.get("line length", 0) + 1
            follow.partial = data[end:]
            follow.snapshot = parse_lines(data[:end], batch, follow.snapshot)
            if len(got) < READ_BYTES // 2:  # a short read: the end of the file
                follow.history = False
                return True
        return False

    def _pread(self, follow: _Follow) -> bytes:
        if not self.direct:
            return os.pread(follow.fd, READ_BYTES, follow.offset)
        if self._buf is None:
            self._buf = AlignedBuffer(READ_BYTES + ALIGNMENT)
        start = follow.offset - follow.offset % ALIGNMENT
        n = os.preadv(follow.fd, [self._buf.view], start)
        skip = follow.offset - start
        return bytes(self._buf.view[skip:n]) if n > skip else b""

    def _report(self, rel: str, refused: dict[str, int]) -> None:
        """Count refused lines, and name each broken rule once per journal."""
        for field_name, count in refused.items():
            if not count:
                continue
            self._stats.add(Counter.SHARED_JOURNAL_REFUSED, count)
            self._warn(rel, field_name, "NVMe tier: journal %s: %d line(s) refused, field %s "
                       "(%s); they are skipped and the rest of the journal applies (further "
                       "refusals of this kind are counted in shared_journal_refused).",
                       self.root / rel, count, field_name, RULES[field_name])

    def _warn(self, rel: str, key: str, message: str, *args: object) -> None:
        if (rel, key) in self._warned:
            logger.debug(message, *args)
        else:
            self._warned.add((rel, key))
            logger.warning(message, *args)

    def close(self) -> None:
        for member in list(self._follows):
            self._drop(member)
        if self._buf is not None:
            self._buf.close()
            self._buf = None
