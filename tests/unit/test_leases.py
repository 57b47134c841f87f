"""Leases, and liveness judged by the observer's own clock (no clock is shared)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lmcache_nvme_backend.disk.coordination import MEMBERS_DIR, host_tag, lease_path
from lmcache_nvme_backend.disk.layout import pid_alive
from lmcache_nvme_backend.store.shared.leases import Lease, Liveness, read_leases, write_lease

REMOTE = "otherhost-4242-0000000a"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_remote_member_is_alive_while_its_counter_moves() -> None:
    clock = Clock()
    live = Liveness(lease_s=10, clock=clock)
    live.observe({REMOTE: Lease(REMOTE, seq=1)})
    clock.now += 9
    assert live.alive(REMOTE)
    live.observe({REMOTE: Lease(REMOTE, seq=2)})  # renewed: its own clock is irrelevant
    clock.now += 9
    assert live.alive(REMOTE)
    live.observe({REMOTE: Lease(REMOTE, seq=2)})  # stopped
    clock.now += 2
    assert not live.alive(REMOTE) and live.silent_for(REMOTE) == 11
    # never seen: given a lease period from the first question
    assert live.alive("thirdhost-1-0000000b")
    clock.now += 10.5
    assert not live.alive("thirdhost-1-0000000b")


def test_a_member_on_this_host_is_dead_as_soon_as_its_process_is() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    member = f"{host_tag()}-{child.pid}-0000000c"
    live = Liveness(lease_s=10, clock=Clock())
    assert live.alive(member)
    child.kill()
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_bytes().rpartition(b")")[2].split()[0] != b"Z":  # killed, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not live.alive(member)  # a zombie is dead all the same
    child.wait()
    assert not pid_alive(child.pid)


def test_leases_round_trip_and_strangers_are_ignored(tmp_path: Path) -> None:
    (tmp_path / MEMBERS_DIR).mkdir(parents=True)
    lease = Lease(REMOTE, host="otherhost", pid=4242, seq=7, budget=1 << 30, owned_bytes=5,
                  newest_read_age_s=0.5)
    write_lease(tmp_path, lease, 0o600)
    (tmp_path / lease_path("badhost-1-0000000d")).write_text('{"member": 3}')
    (tmp_path / MEMBERS_DIR / "not-a-lease.txt").write_text("{}")
    (tmp_path / lease_path("liar-2-0000000e")).write_text(
        Lease("someone-9-0000000f", seq="x").to_json().decode())  # type: ignore[arg-type]
    assert read_leases(tmp_path) == {REMOTE: lease}
    assert os.stat(tmp_path / lease_path(REMOTE)).st_mode & 0o777 == 0o600
