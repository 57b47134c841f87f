"""Running several ``support.shared_member`` processes on one cache directory while the
bytes on disk are sampled (the shared-budget tests,
tests/robustness/test_robustness_shared_budget.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.disk.layout import TEMP_INFIX
from lmcache_nvme_backend.store.shared.ledger import LedgerChain

from .process import child_env, module_command

SAMPLE_S = 0.5
SETTLE_S = 0.05  # after every member stopped: what a filesystem daemon still applies


def _budgeted_files(root: Path) -> dict[tuple[int, int], tuple[str, int]]:
    """(kind, size) by inode of the chunk and temp files under ``root/ns`` and the victims
    being deleted under ``root/shared/evicting`` right now (what the budget bounds).  A
    file renamed while the walk runs (temp to chunk, chunk to evicting) is seen once."""
    seen: dict[tuple[int, int], tuple[str, int]] = {}
    for top in (root / "ns", root / "shared" / "evicting"):
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name == "NAMESPACE":
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue  # removed or renamed while walking
                kind = ("evicting" if top.name == "evicting" else
                        "temp" if TEMP_INFIX in name else "chunk")
                seen[(st.st_dev, st.st_ino)] = (kind, st.st_size)
    return seen


def tree_bytes(root: Path) -> int:
    """Bytes the budget bounds in the tree right now (``_budgeted_files``)."""
    return sum(size for _, size in _budgeted_files(root).values())


def budget_report(root: Path, members: Sequence[Member] = ()) -> str:
    """What a tree holds against its budget, for an assertion message: the files by kind,
    the ledger's accounts, and what the members warned of (a failure too rare to rerun
    must say enough by itself)."""
    kinds: dict[str, list[int]] = {}
    for kind, size in _budgeted_files(root).values():
        kinds.setdefault(kind, []).append(size)
    lines = [f"{kind}: {len(sizes)} files, {sum(sizes)} bytes" for kind, sizes in kinds.items()]
    doc = LedgerChain(root, "reader-1-00000000", 0o600, 0o700).latest()
    if doc is not None:
        lines.append(f"ledger version {doc.n}: budget {doc.budget}, orphans {doc.orphans_cap} "
                     f"(generation {doc.orphans_gen}), pool {doc.pool()}")
        lines += [f"  {member}: {acct.state}, cap {acct.cap}, {len(acct.freed)} freed, "
                  f"{len(acct.evicting)} evicting" for member, acct in doc.accounts.items()]
    for member in members:
        said = [ln for ln in member.stderr.splitlines() if "WARNING" in ln or "ERROR" in ln]
        lines += [f"member {member.prefix} {member.ids}:", *said[-20:]]
    return "\n".join(lines)


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


@contextlib.contextmanager
def frozen(pids: Sequence[int], timeout_s: float = 5.0) -> Iterator[None]:
    """Stop the processes ``pids`` (SIGSTOP) and wait until every thread of each is
    stopped, so that the filesystem holds still while it is measured; continue them after.
    A process that is gone or a zombie is skipped."""
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        deadline = time.monotonic() + timeout_s
        while not all(_all_threads_stopped(pid) for pid in stopped):
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {stopped} did not stop within {timeout_s} s")
            time.sleep(0.001)
        time.sleep(SETTLE_S)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # the thread ended
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


class DiskSampler:
    """Samples the bytes of chunk files under ``root`` every ``SAMPLE_S`` on a thread.

    With ``filesystem`` (a filesystem holding nothing but this cache) a sample is that
    filesystem's used bytes (``statvfs``) less what was used before and less the cache's
    coordination and metadata files (a walk); without, it is a walk of the tree
    (``tree_bytes``).  With ``pause`` (the member processes' ids, asked at each sample)
    every member is stopped while a sample is taken: the tree holds still, so the walk and
    ``statvfs`` see one instant (else a walk of a busy tree races the writers, and the
    ledger versions written meanwhile count as chunks).
    """

    def __init__(self, root: Path, interval_s: float = SAMPLE_S,
                 filesystem: Path | None = None,
                 pause: Callable[[], Sequence[int]] | None = None) -> None:
        self.root = root
        self.interval_s = interval_s
        self.filesystem = filesystem
        self.pause = pause
        self._base = filesystem_used(filesystem) if filesystem is not None else 0
        self.samples: list[int] = []
        self.times: list[float] = []  # time.monotonic() of each sample
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError("the disk sampler failed") from self.error

    def sample(self) -> int:
        if self.pause is None:
            return self._measure()
        with frozen(self.pause()):
            return self._measure()

    def _measure(self) -> int:
        if self.filesystem is None:
            return tree_bytes(self.root)
        # what is not chunks first: it only grows, so a sample errs on the high side
        other = other_bytes(self.root) if self.root.exists() else 0
        return filesystem_used(self.filesystem) - self._base - other

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.samples.append(self.sample())
                self.times.append(time.monotonic())
                self._stop.wait(self.interval_s)
        except BaseException as exc:  # raised in the test's thread by __exit__
            self.error = exc

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    @property
    def peak_at(self) -> float:
        """When the peak was sampled (``time.monotonic()``)."""
        return self.times[self.samples.index(self.peak)] if self.samples else 0.0


@dataclass
class Member:
    """One running member process.  Its stderr is read as it comes, by a thread of this
    process: a pipe nobody reads fills at 64 KiB, and then every log call of the member
    blocks (the logging lock held by a write that never ends), freezing its threads."""

    proc: subprocess.Popen[str]
    prefix: str
    ids: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    _said: list[str] = field(default_factory=list, repr=False)
    _reader: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._said.append(line)

    @property
    def stderr(self) -> str:
        """What the member wrote to stderr so far (all of it once it ended)."""
        return "".join(self._said)

    def wait_for(self, word: str, timeout_s: float = 60.0) -> str:
        """Read stdout lines until one starts with ``word``; that line."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"member {self.prefix} ended before {word}: "
                                   f"{self._ended(5.0)[-3000:]}")
            self.lines.append(line)
            if line.startswith(word):
                return line
        raise TimeoutError(f"member {self.prefix}: no {word} within {timeout_s} s")

    def result(self, timeout_s: float = 300.0) -> dict[str, Any]:
        self.proc.wait(timeout=timeout_s)  # stdout holds a few lines: it never fills
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        err = self._ended(timeout_s)
        if self.proc.returncode != 0:
            raise RuntimeError(f"member {self.prefix} failed ({self.proc.returncode}):\n"
                               f"{err[-3000:]}")
        lines = [ln for ln in (self.lines + out.splitlines()) if ln.startswith("{")]
        return json.loads(lines[-1])

    def _ended(self, timeout_s: float) -> str:
        """All of stderr once the process ended ("(no exit)" if it did not in time)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "(no exit)"
        if self._reader is not None:
            self._reader.join(timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._ended(30.0)


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
                  env: dict[str, str] | None = None, extra: Sequence[str] = ()) -> None:
    """Start one writer per prefix (on ``caches[i % len(caches)]``), each reading the
    others' chunks, appended to ``members`` as they start; then let them all go at once."""
    for i, prefix in enumerate(prefixes):
        members.append(start_member("writer", caches[i % len(caches)], prefix, budget, size,
                                    seconds, prefixes, extra, go=go, env=env))
    go.touch()


def running_pids(members: Sequence[Member]) -> list[int]:
    """The process ids of the members not yet waited for (a sampler's ``pause``)."""
    return [m.proc.pid for m in members if m.proc.returncode is None]


def stop_all(members: Sequence[Member]) -> None:
    """Kill every member still running (test teardown)."""
    for member in members:
        if member.proc.poll() is None:
            member.kill()
