"""store/free_space.py FreeSpaceGuard: the free-space floor without a statvfs per write, and
evicted files whose removal is still queued (the native engine removes them with the
write that needed the room)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_nvme_backend.store import free_space
from lmcache_nvme_backend.store.free_space import FreeSpaceGuard

MIB = 1 << 20


class Disk:
    """What statvfs answers, and how often it was asked."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.asked = 0

    def __call__(self, path: Path) -> int:
        self.asked += 1
        return self.free


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    d = Disk(1000 * MIB)
    monkeypatch.setattr(free_space, "free_bytes", d)
    return d


def test_far_from_the_floor_the_kernel_is_asked_once(disk: Disk, tmp_path: Path) -> None:
    guard = FreeSpaceGuard(tmp_path, min_free=10 * MIB)
    assert all(guard.room_for(MIB) for _ in range(20))
    assert disk.asked == 1


def test_near_the_floor_every_decision_asks_the_kernel(disk: Disk, tmp_path: Path) -> None:
    disk.free = 20 * MIB + FreeSpaceGuard.CHECK_BYTES
    guard = FreeSpaceGuard(tmp_path, min_free=20 * MIB)
    assert not guard.room_for(MIB + FreeSpaceGuard.CHECK_BYTES)
    assert guard.room_for(MIB)
    assert disk.asked == 2


def test_queued_removals_count_as_free_until_they_happen(disk: Disk, tmp_path: Path) -> None:
    disk.free = 20 * MIB
    guard = FreeSpaceGuard(tmp_path, min_free=20 * MIB)
    assert not guard.room_for(MIB)
    guard.will_free(8 * MIB)  # evicted; its file goes with the next write
    assert guard.room_for(4 * MIB)  # the kernel does not see it yet, the guard does
    disk.free -= 4 * MIB  # that write happened
    disk.free += 8 * MIB  # and the evicted file is gone
    guard.freed(8 * MIB)
    assert guard.room_for(3 * MIB)  # 24 free
    disk.free -= 3 * MIB
    assert not guard.room_for(2 * MIB)  # 21 - 2 < 20: the 8 MiB counted once, not twice
