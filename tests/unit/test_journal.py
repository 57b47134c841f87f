"""Member journals: checksummed lines, partial appends, order within a batch, snapshots."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from support.mounts import fill_bytes, tmpfs

from lmcache_nvme_backend.disk.coordination import MEMBERS_DIR, journal_path
from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.store.shared import journal as journal_module
from lmcache_nvme_backend.store.shared.journal import (
    Batch,
    JournalTail,
    JournalWriter,
    accessed_lines,
    deleted_line,
    parse_lines,
    published_line,
)
from lmcache_nvme_backend.store.stats import StoreStats

W, R = "hostW-1-0000000a", "hostR-2-0000000b"
D1, D2, D3 = "1" * 32, "2" * 32, "3" * 32
NS = "ab" * 8
META = TensorMeta(shapes=((4096,),), dtypes=("uint8",), fmt=1, nbytes=4096)


def writer(root: Path) -> JournalWriter:
    (root / MEMBERS_DIR).mkdir(parents=True, exist_ok=True)
    return JournalWriter(root, W, 0o600)


def test_records_round_trip_and_damaged_lines_are_skipped() -> None:
    data = b"".join([published_line(D1, NS, 8192, META), published_line(D2, NS, 8192, None),
                     *accessed_lines([D1, D2]), deleted_line(D3)])
    damaged = data.replace(b" P " + D2.encode(), b" P " + D3.encode())  # checksum no longer fits
    batch = Batch(W)
    assert parse_lines(damaged + b"garbage line\n", batch, None) is None
    assert list(batch.published) == [D1] and batch.published[D1].meta == META
    assert batch.accessed == [D1, D2] and list(batch.deleted) == [D3]
    assert batch.refused == {"checksum": 2}


@pytest.mark.parametrize(("body", "field"), [
    (f"P {D1} {NS} {1 << 40} -", "size"),  # 1 TiB: larger than any chunk file
    (f"P {D1} {NS} -8192 -", "size"),
    (f"P {D1} {NS} 0 -", "size"),
    (f"P {D1} {NS} 8193 -", "size"),  # not a multiple of the alignment
    (f"P {D1} {NS} +8192 -", "size"),
    (f"P {D1} {NS} 12288 {META.to_json().decode()}", "size"),  # not what its metadata says
    (f"P {D1} {NS} 8192 {{\"shapes\":1}}", "metadata"),
    (f"P {D1[:31]} {NS} 8192 -", "digest"),
    (f"P {D1} {NS}0 8192 -", "namespace id"),
    (f"P {D1} {NS} 8192", "record kind"),
    ("A " + " ".join([D1] * 65), "digest count"),
    (f"A {D1} nothex", "digest"),
    ("D " + "A" * 32, "digest"),  # upper case
    ("Z", "record kind"),  # the end of a snapshot that never began
    ("Q x", "record kind"),
])
def test_a_line_with_a_field_out_of_bounds_is_refused(body: str, field: str) -> None:
    batch = Batch(W)
    line = journal_module._line(body)
    assert parse_lines(line + published_line(D2, NS, 8192, META), batch, None) is None
    assert batch.refused == {field: 1}
    assert list(batch.published) == [D2] and not batch.deleted and not batch.accessed


def test_overlong_and_non_ascii_lines_are_refused() -> None:
    batch = Batch(W)
    long_line = journal_module._line("A " + D1 * 300)
    parse_lines(long_line + "é".encode() * 4 + b"\n", batch, None)
    assert batch.refused == {"line length": 1, "encoding": 1}


def test_later_records_of_a_digest_win_within_a_batch() -> None:
    batch = Batch(W)
    parse_lines(published_line(D1, NS, 8192, META) + deleted_line(D1) +
                deleted_line(D2) + published_line(D2, NS, 8192, META), batch, None)
    assert list(batch.published) == [D2] and list(batch.deleted) == [D1]


def test_a_tail_reads_only_whole_new_lines(tmp_path: Path) -> None:
    w = writer(tmp_path)
    tail = JournalTail(tmp_path, R, direct=False, stats=StoreStats())
    w.append([published_line(D1, NS, 8192, META)])
    (first,) = tail.poll()
    assert first.first and list(first.published) == [D1]
    line = published_line(D2, NS, 8192, META)
    fd = os.open(tmp_path / journal_path(W, 1), os.O_WRONLY | os.O_APPEND)
    os.write(fd, line[:20])  # an append caught half-way
    assert tail.poll() == []
    os.write(fd, line[20:])
    os.close(fd)
    (second,) = tail.poll()
    assert not second.first and list(second.published) == [D2]
    assert tail.poll() == []
    w.close()


def test_a_new_generation_starts_with_a_snapshot(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    w = writer(tmp_path)
    # O_DIRECT where the filesystem takes it
    tail = JournalTail(tmp_path, R, direct=True, stats=StoreStats())
    w.append([published_line(D1, NS, 8192, META), published_line(D2, NS, 8192, META)])
    tail.poll()
    w.append([deleted_line(D1), *accessed_lines([D2] * 10)])
    assert not w.wants_rotation(owned=1)
    monkeypatch.setattr(journal_module, "ROTATE_BYTES", 10)
    assert w.wants_rotation(owned=0)  # large, and four times what one chunk's snapshot takes
    w.rotate([published_line(D2, NS, 8192, META)])
    assert (tmp_path / journal_path(W, 2)).exists()
    batches = tail.poll()
    assert [list(b.deleted) for b in batches] == [[D1]]  # the old generation finished first
    assert batches[0].snapshot == {D2}
    w.retire_old(now=1e18)
    assert not (tmp_path / journal_path(W, 1)).exists()
    w.close(remove=True)
    assert tail.poll() == [] and tail.members() == []
    tail.close()


def test_appends_a_full_filesystem_refuses_leave_whole_lines_and_one_warning(
        tmp_path: Path, package_log: pytest.LogCaptureFixture) -> None:
    """On a full filesystem an append neither raises (it runs inside store calls and
    evictions) nor leaves half a record for the next one to run into; said once."""
    caplog = package_log
    caplog.set_level(logging.DEBUG, logger="lmcache_nvme_backend")
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        w = writer(mnt)
        first = published_line(D1, NS, 8192, META)
        w.append([first])
        filler = fill_bytes(mnt)
        refused = [deleted_line(f"{i:032x}") for i in range(300)]  # more than the page left
        for line in refused:
            w.append([line])
        filler.unlink()
        w.append([deleted_line(D2)])
        w.close()
        data = (mnt / journal_path(W, 1)).read_bytes()
    lines = data.splitlines(keepends=True)
    assert lines[0] == first and lines[-1] == deleted_line(D2)
    assert set(lines[1:-1]) <= set(refused) and len(lines) < len(refused) + 2
    warnings = {id(r) for r in caplog.records if r.levelno == logging.WARNING
                and "cannot write this member's journal" in r.getMessage()}
    assert len(warnings) == 1
