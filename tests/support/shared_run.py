"""Running several ``support.shared_member`` processes on one cache directory while the
bytes on disk are sampled (the shared-budget tests and bench/bench_shared.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .process import child_env, module_command

SAMPLE_S = 0.5


def tree_bytes(root: Path) -> int:
    """Bytes of the chunk and temp files under ``root/ns`` plus the victims being deleted
    under ``root/shared/evicting`` right now (what the budget bounds).  A file renamed while
    the walk runs (temp to chunk, chunk to evicting) is counted once (by inode)."""
    seen: dict[tuple[int, int], int] = {}
    for top in (root / "ns", root / "shared" / "evicting"):
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name == "NAMESPACE":
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue  # removed or renamed while walking
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def filesystem_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def other_bytes(root: Path) -> int:
    """Blocks under ``root`` that are not chunk, temp or claimed files: directories (ext4
    gives each a block; tmpfs none), the ledger, journals, leases, manifest, marker,
    quarantine.  A directory that vanished under the walk (a retired ledger epoch renamed
    away, its files not yet deleted) makes it walk again: its files still take blocks."""
    for _ in range(10):
        total = 0
        raced: list[OSError] = []
        chunk_trees = (str(root / "ns"), str(root / "shared" / "evicting"))
        for dirpath, _dirs, files in os.walk(root, onerror=raced.append):
            with contextlib.suppress(OSError):
                total += os.lstat(dirpath).st_blocks * 512
            if dirpath.startswith(chunk_trees):
                continue
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        if not any(not str(e.filename or "").startswith(chunk_trees) for e in raced):
            return total
    return total


class DiskSampler:
    """Samples the bytes of chunk files under ``root`` every ``SAMPLE_S`` on a thread.

    With ``filesystem`` (a tmpfs holding nothing but this cache) a sample is that
    filesystem's used bytes (``statvfs``: one instant) less what was used before and less
    the cache's coordination and metadata files; without, it is a walk of the tree
    (``tree_bytes``), which on a busy tree also counts files deleted and created while it
    runs.
    """

    def __init__(self, root: Path, interval_s: float = SAMPLE_S,
                 filesystem: Path | None = None) -> None:
        self.root = root
        self.interval_s = interval_s
        self.filesystem = filesystem
        self._base = filesystem_used(filesystem) if filesystem is not None else 0
        self.samples: list[int] = []
        self.times: list[float] = []  # time.monotonic() of each sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> int:
        if self.filesystem is None:
            return tree_bytes(self.root)
        # what is not chunks first: it only grows, so a sample errs on the high side
        other = other_bytes(self.root) if self.root.exists() else 0
        return filesystem_used(self.filesystem) - self._base - other

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self.times.append(time.monotonic())
            self._stop.wait(self.interval_s)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    @property
    def peak_at(self) -> float:
        """When the peak was sampled (``time.monotonic()``)."""
        return self.times[self.samples.index(self.peak)] if self.samples else 0.0


@dataclass
class Member:
    """One running member process."""

    proc: subprocess.Popen[str]
    prefix: str
    ids: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def wait_for(self, word: str, timeout_s: float = 60.0) -> str:
        """Read stdout lines until one starts with ``word``; that line."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"member {self.prefix} ended before {word}: "
                                   f"{self._stderr()}")
            self.lines.append(line)
            if line.startswith(word):
                return line
        raise TimeoutError(f"member {self.prefix}: no {word} within {timeout_s} s")

    def result(self, timeout_s: float = 300.0) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout_s)
        if self.proc.returncode != 0:
            raise RuntimeError(f"member {self.prefix} failed ({self.proc.returncode}):\n"
                               f"{err[-3000:]}")
        lines = [ln for ln in (self.lines + out.splitlines()) if ln.startswith("{")]
        return json.loads(lines[-1])

    def _stderr(self) -> str:
        try:
            return self.proc.communicate(timeout=5)[1][-3000:]
        except subprocess.TimeoutExpired:
            return "(no exit)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


def start_member(role: str, cache: Path, prefix: str, budget: int, size: int, seconds: float,
                 peers: Sequence[str] = (), extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, go: Path | None = None) -> Member:
    """Start one member and wait until its store is open (with ``go``: it then waits for
    that file to exist before it starts, and writers say how far they got beside it)."""
    command = module_command("support.shared_member", role, cache, "--budget-bytes",
                             str(budget), "--size", str(size), "--seconds", str(seconds),
                             "--prefix", prefix, "--peers", ",".join(peers), *extra,
                             *(["--go", str(go), "--progress", str(go.parent)]
                               if go is not None else []))
    proc = subprocess.Popen(command, env=env or child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    member = Member(proc, prefix)
    try:
        member.ids = member.wait_for("READY").split()[1:]
    except BaseException:
        member.kill()
        raise
    return member


def start_writers(members: list[Member], caches: Sequence[Path], prefixes: Sequence[str],
                  budget: int, size: int, seconds: float, go: Path,
                  env: dict[str, str] | None = None) -> None:
    """Start one writer per prefix (on ``caches[i % len(caches)]``), each reading the
    others' chunks, appended to ``members`` as they start; then let them all go at once."""
    for i, prefix in enumerate(prefixes):
        members.append(start_member("writer", caches[i % len(caches)], prefix, budget, size,
                                    seconds, prefixes, go=go, env=env))
    go.touch()


def stop_all(members: Sequence[Member]) -> None:
    """Kill every member still running (test teardown)."""
    for member in members:
        if member.proc.poll() is None:
            member.kill()
