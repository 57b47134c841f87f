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
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ...disk.coordination import MEMBERS_DIR, journal_path, parse_journal_name
from ...disk.format import ALIGNMENT, FormatError, TensorMeta
from ...disk.layout import DIGEST_RE, NS_ID_RE
from ...disk.safe_fs import create_beneath, open_regular, remove_quietly, scandir_beneath
from ...io.buffers import AlignedBuffer

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
READ_BYTES = 1 << 20
MAX_LINE = 64 << 10
ACCESS_PER_LINE = 64
# A generation is rotated once it is this large and four times its snapshot's size.
ROTATE_BYTES = 8 << 20
RETIRE_AFTER_S = 5.0  # an old generation outlives its successor by this long
REFUSED_SAID_EVERY_S = 60.0  # appends the filesystem refuses: one warning this often


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
    bad_lines: int = 0
    # read from its start (a member seen for the first time): history, whose records of
    # different members cannot be put in order; the directory says what still exists
    first: bool = False


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


def parse_lines(data: bytes, batch: Batch, snapshot: set[str] | None) -> set[str] | None:
    """Add the complete lines of ``data`` to ``batch``; returns the snapshot being read
    (None outside one).  Lines failing their checksum are counted and skipped."""
    for raw in data.split(b"\n"):
        if not raw:
            continue
        try:
            text = raw.decode()
            crc, _, body = text.partition(" ")
            if int(crc, 16) != xxhash.xxh32_intdigest(body.encode()):
                raise ValueError("checksum")
            kind, _, rest = body.partition(" ")
            if kind == "P":
                digest, ns_id, size, meta = rest.split(" ", 3)
                if not (DIGEST_RE.match(digest) and NS_ID_RE.match(ns_id)):
                    raise ValueError("name")
                batch.published[digest] = Published(
                    digest, ns_id, int(size),
                    None if meta == "-" else TensorMeta.from_json(meta.encode()))
                batch.deleted.pop(digest, None)  # the later record counts
                if snapshot is not None:
                    snapshot.add(digest)
            elif kind == "D" and DIGEST_RE.match(rest):
                batch.deleted[rest] = None
                batch.published.pop(rest, None)
            elif kind == "A":
                batch.accessed.extend(d for d in rest.split(" ") if DIGEST_RE.match(d))
            elif kind == "S":
                snapshot = set()
            elif kind == "Z" and snapshot is not None:
                batch.snapshot, snapshot = snapshot, None
            else:
                raise ValueError("kind")
        except (ValueError, UnicodeDecodeError, FormatError):
            batch.bad_lines += 1
    return snapshot


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
        return self.size > ROTATE_BYTES and self.size > 4 * 120 * max(owned, 1)

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
    gen: int
    fd: int
    offset: int = 0
    partial: bytes = b""
    snapshot: set[str] | None = None


class JournalTail:
    """Follows the other members' journals on one root, reading only what is new."""

    def __init__(self, root: Path, own: str, direct: bool) -> None:
        self.root = root
        self.own = own
        self.direct = direct and bool(_O_DIRECT)
        self._follows: dict[str, _Follow] = {}
        self._buf: AlignedBuffer | None = None

    def journals(self) -> dict[str, int]:
        """The newest generation of each member's journal in the directory."""
        newest: dict[str, int] = {}
        for entry in scandir_beneath(self.root, MEMBERS_DIR):
            parsed = parse_journal_name(entry.name)
            if parsed is not None and parsed[0] != self.own:
                member, gen = parsed
                newest[member] = max(gen, newest.get(member, 0))
        return newest

    def poll(self) -> list[Batch]:
        """New records of every other member (a member seen for the first time: all)."""
        batches = []
        listed = self.journals()
        for member in [m for m in self._follows if m not in listed]:
            self._drop(member)
        for member, gen in listed.items():
            batch = Batch(member)
            follow = self._follows.get(member)
            if follow is not None and follow.gen < gen:
                self._read_new(follow, batch, member)  # finish the old generation first
                self._drop(member)
                follow = None
            if follow is None:
                follow = self._open(member, gen)
                if follow is None:
                    continue
                batch.first = True
            self._read_new(follow, batch, member)
            if batch.published or batch.deleted or batch.accessed or batch.snapshot is not None \
                    or batch.bad_lines:
                batches.append(batch)
        return batches

    def members(self) -> list[str]:
        return list(self._follows)

    def _open(self, member: str, gen: int) -> _Follow | None:
        rel = journal_path(member, gen)
        fd = -1
        if self.direct:
            with contextlib.suppress(OSError):
                fd = open_regular(self.root, rel, os.O_RDONLY | _O_DIRECT)
        if fd < 0:
            try:
                fd = open_regular(self.root, rel)
            except OSError as exc:
                logger.debug("NVMe tier: cannot open journal %s: %s", rel, exc)
                return None
        follow = _Follow(gen, fd)
        self._follows[member] = follow
        return follow

    def _drop(self, member: str) -> None:
        follow = self._follows.pop(member, None)
        if follow is not None:
            os.close(follow.fd)

    def _read_new(self, follow: _Follow, batch: Batch, member: str) -> None:
        for data in self._chunks(follow, member):
            data = follow.partial + data
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) > MAX_LINE:
                data, end = b"", 0  # no line this long is ours: skip it
            follow.partial = data[end:]
            follow.snapshot = parse_lines(data[:end], batch, follow.snapshot)

    def _chunks(self, follow: _Follow, member: str) -> Iterator[bytes]:
        """The bytes appended since the last read, in pieces of at most ``READ_BYTES``."""
        while True:
            try:
                data = self._pread(follow)
            except OSError as exc:
                logger.debug("NVMe tier: cannot read %s's journal: %s", member, exc)
                return
            if not data:
                return
            follow.offset += len(data)
            yield data
            if len(data) < READ_BYTES // 2:
                return

    def _pread(self, follow: _Follow) -> bytes:
        if not self.direct:
            return os.pread(follow.fd, READ_BYTES, follow.offset)
        if self._buf is None:
            self._buf = AlignedBuffer(READ_BYTES + ALIGNMENT)
        start = follow.offset - follow.offset % ALIGNMENT
        n = os.preadv(follow.fd, [self._buf.view], start)
        skip = follow.offset - start
        return bytes(self._buf.view[skip:n]) if n > skip else b""

    def close(self) -> None:
        for member in list(self._follows):
            self._drop(member)
        if self._buf is not None:
            self._buf.close()
            self._buf = None
