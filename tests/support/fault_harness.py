"""A fault harness for shared mode, in the spirit of Jepsen and FoundationDB's simulation
testing: member processes (``support.shared_member`` writers: real ``ChunkStore``s with
``nvme.shared: true``, small budget) work on one cache directory while faults drawn from
a seed (``support.shared_faults``, and SIGKILL of a member, replaced by a fresh one) hit
it on a schedule, and the invariants are checked all along:

* **budget**: every ``SAMPLE_S`` the members are stopped (``shared_run.frozen``; not
  while the brick is stopped: nothing moves then, and a member waiting on the brick does
  not stop) and the bytes of chunk, temp and claimed files are walked where the files
  really are; each sample must be within the budget plus one chunk per member that could
  hold one (running, or killed less than ``TAKEOVER_S`` ago);
* **no wrong byte**: every chunk a member reads is compared with the payload of its key
  (a function of the key: every member can check every chunk); a miss is fine;
* **bounded calls**: each member times its calls (open, submit, flush, lookup, load,
  close; a call in flight counted with its age) and reports the worst; each must be within
  ``CALL_BOUND_S``;
* **recovery**: after the last fault is undone, every running member stores a new chunk
  and reads it back right, and an eviction happens, within ``RECOVERY_BOUND_S``;
* **nothing outside touched**: a sentinel directory beside the cache (its file's bytes and
  both mtimes) and the other entries beside the cache stay as they were.

``run_harness`` returns the figures (``Figures``); ``Figures.violations`` lists every
invariant that failed, each with what was seen.  The test suite runs a short seeded
schedule (tests/robustness/test_robustness_shared_faults.py), ``bench/soak_shared.py`` a
long one; docs/robustness.md has the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_nvme_backend.disk.format import file_size_for

from .gluster import gluster_volume
from .mounts import tmpfs
from .shared_faults import FAULTS, HELD, NothingToDamage, Target
from .shared_run import Member, frozen, start_member, tree_bytes

SAMPLE_S = 0.3
TAKEOVER_S = 15.0  # a killed member's temp file and share are gone by then (deployment.md)
CALL_BOUND_S = 20.0  # any public call; a stopped brick is held at most HOLD_S[1]
RECOVERY_BOUND_S = 20.0
HOLD_S = (1.0, 4.0)  # how long a held fault (full filesystem, stopped brick...) lasts
GAP_S = (0.3, 1.5)  # between two faults
KILL = "kill"
SEED_ENV = "LMCNVME_FAULT_SEED"


@dataclass(frozen=True)
class Layout:
    """Where the members run: the cache path each uses (member i: ``caches[i % n]``),
    where the files really are (``real``, walked by the sampler: the brick on GlusterFS),
    the sentinel beside the cache (where the harness checks it), the directory where a
    filler fills the cache's filesystem, the brick's process, and a local work directory
    (start, stop, progress and figures files)."""

    caches: tuple[Path, ...]
    real: Path
    sentinel: Path
    filler_dir: Path | None
    brick_pid: int | None
    work: Path


@dataclass(frozen=True)
class Plan:
    """What to run: the seed, members, budget (chunks of ``size``), the fault kinds
    (``FAULTS`` names and ``KILL``); with ``cover`` every kind comes once, in an order
    drawn from the seed (the short test), then for ``seconds`` kinds are drawn at random
    (the soak)."""

    seed: int
    seconds: float = 0.0
    members: int = 3
    chunks: int = 32
    size: int = 128 * 1024
    kinds: tuple[str, ...] = (*FAULTS, KILL)
    cover: bool = True
    params: tuple[str, ...] = ()  # extra store settings, NAME=VALUE

    @property
    def file(self) -> int:
        return file_size_for(self.size)

    @property
    def budget(self) -> int:
        return self.chunks * self.file


@dataclass
class Figures:
    """What a run measured (``report`` prints it)."""

    seed: int
    seconds: float
    budget: int
    file: int
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    samples: int = 0
    unfrozen_samples: int = 0
    peak_bytes: int = 0
    peak_over_bound: int = -(1 << 62)  # the largest sample minus its bound
    worst_call: dict[str, float] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    wrong: int = 0
    served: int = 0
    written: int = 0
    recovery_s: float | None = None
    members_started: int = 0
    violations: list[str] = field(default_factory=list)

    def report(self) -> str:
        calls = ", ".join(f"{name} {s:.2f} s" for name, s in sorted(self.worst_call.items()))
        faults = ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items()))
        skipped = ", ".join(f"{kind} {n}" for kind, n in sorted(self.skipped.items()))
        recovery = "none" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        return "\n".join([
            f"seed {self.seed} ({SEED_ENV}), {self.seconds:.1f} s of faults, "
            f"{self.members_started} members started",
            f"faults: {faults or 'none'}" + (f"; skipped: {skipped}" if skipped else ""),
            f"peak bytes {self.peak_bytes} = {self.peak_bytes / self.budget:.3f} x the budget "
            f"({self.budget}; chunk file {self.file}); worst sample - bound "
            f"{self.peak_over_bound} over {self.samples} samples "
            f"({self.unfrozen_samples} not frozen)",
            f"worst call: {calls}",
            f"chunks written {self.written}, others' and own served {self.served}, "
            f"wrong {self.wrong}; recovery after the last fault {recovery}",
            *(["VIOLATIONS:", *self.violations] if self.violations else ["no violation"]),
        ])


@dataclass
class _Running:
    member: Member
    stats: Path
    started: float
    killed: float | None = None


class _Harness:
    def __init__(self, plan: Plan, layout: Layout) -> None:
        self.plan = plan
        self.layout = layout
        self.figures = Figures(plan.seed, plan.seconds, plan.budget, plan.file)
        self.rng = random.Random(plan.seed)
        self.members: list[_Running] = []
        self.lock = threading.Lock()
        self.brick_stopped = False
        self.stop = threading.Event()
        self.go = layout.work / "go"
        self.until = layout.work / "stop"
        self.target = Target(layout.caches[0], plan.budget, layout.filler_dir,
                             layout.brick_pid, layout.sentinel / "keep")
        self.sentinel: dict[str, Any] = {}
        self.beside: set[str] = set()
        self.t0 = time.monotonic()

    # -- members --

    def start(self) -> None:
        n = len(self.members)
        prefix = f"f{n}"
        stats = self.layout.work / f"{prefix}.stats"
        extra = ["--until", str(self.until), "--stats", str(stats),
                 *(arg for p in self.plan.params for arg in ("--param", p))]
        peers = [f"f{i}" for i in range(self.plan.members)]
        started = time.monotonic()
        member = start_member("writer", self.layout.caches[n % len(self.layout.caches)],
                              prefix, self.plan.budget, self.plan.size,
                              self.plan.seconds + 600, peers, extra, go=self.go)
        with self.lock:
            self.members.append(_Running(member, stats, started))
        self.figures.members_started += 1

    def running(self) -> list[_Running]:
        with self.lock:
            return [r for r in self.members
                    if r.killed is None and r.member.proc.poll() is None]

    def kill(self) -> str:
        victim = self.rng.choice(self.running())
        os.kill(victim.member.proc.pid, signal.SIGKILL)
        victim.killed = time.monotonic()
        victim.member.kill()  # reaped
        try:
            self.start()
        except (RuntimeError, TimeoutError) as exc:
            self.violation(f"a fresh member could not start: {exc}")
        return f"SIGKILL member {victim.member.prefix} {victim.member.ids}, a fresh one started"

    # -- invariants --

    def watch_sentinel(self) -> None:
        keep = self.layout.sentinel / "keep"
        self.layout.sentinel.mkdir()
        keep.write_bytes(random.Random(self.plan.seed).randbytes(4096))
        self.sentinel = self._sentinel_state()
        self.beside = {*os.listdir(self.layout.real.parent), self.layout.real.name}

    def _sentinel_state(self) -> dict[str, Any]:
        keep = self.layout.sentinel / "keep"
        return {"bytes": keep.read_bytes(), "mtime": keep.stat().st_mtime_ns,
                "dir": self.layout.sentinel.stat().st_mtime_ns,
                "names": sorted(os.listdir(self.layout.sentinel))}

    def check_outside(self) -> None:
        if self._sentinel_state() != self.sentinel:
            self.violation(f"the sentinel {self.layout.sentinel} beside the cache changed")
        filler = {"filler"} if self.layout.filler_dir == self.layout.real.parent else set()
        new = set(os.listdir(self.layout.real.parent)) - self.beside - filler
        if new:
            self.violation(f"new entries beside the cache: {sorted(new)}")

    def violation(self, text: str) -> None:
        if text not in self.figures.violations:
            self.figures.violations.append(text)

    def bound(self, now: float) -> int:
        with self.lock:
            holders = [r for r in self.members
                       if r.killed is None or now - r.killed < TAKEOVER_S]
        return self.plan.budget + len(holders) * self.plan.file

    def sample(self) -> None:
        frozen_ok = not self.brick_stopped
        if frozen_ok:
            try:
                with frozen([r.member.proc.pid for r in self.running()], timeout_s=2.0):
                    now = time.monotonic()
                    size = tree_bytes(self.layout.real)
            except TimeoutError:  # a member waits on the filesystem: it cannot stop
                frozen_ok = False
        if not frozen_ok:
            now = time.monotonic()
            size = tree_bytes(self.layout.real)
            self.figures.unfrozen_samples += 1
        f = self.figures
        f.samples += 1
        f.peak_bytes = max(f.peak_bytes, size)
        over = size - self.bound(now)
        f.peak_over_bound = max(f.peak_over_bound, over)
        if over > 0:
            self.violation(f"{size} bytes on disk at +{now - self.t0:.1f} s: over the "
                           f"bound {self.bound(now)} by {over}")
        self.check_outside()
        self.read_stats()

    def read_stats(self) -> dict[str, dict[str, Any]]:
        """Every member's latest figures (by prefix); the worst calls and wrong bytes
        folded into ``figures``."""
        seen: dict[str, dict[str, Any]] = {}
        with self.lock:
            members = list(self.members)
        for r in members:
            with contextlib.suppress(OSError, ValueError):
                seen[r.member.prefix] = json.loads(r.stats.read_text())
        for stats in seen.values():
            self._fold(stats)
        return seen

    def _fold(self, stats: dict[str, Any]) -> None:
        for name, took in stats.get("worst", {}).items():
            self.figures.worst_call[name] = max(took, self.figures.worst_call.get(name, 0.0))

    def monitor(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            try:
                self.sample()
            except Exception as exc:  # reported, not lost with the thread
                self.violation(f"the sampler failed: {exc!r}")

    # -- the schedule --

    def faults(self) -> None:
        absent = {"stopped brick": self.layout.brick_pid is None,
                  "full filesystem": self.layout.filler_dir is None}
        kinds = [k for k in self.plan.kinds if not absent.get(k)]
        started = time.monotonic()
        if self.plan.cover:
            for kind in self.rng.sample(kinds, len(kinds)):
                time.sleep(self.rng.uniform(*GAP_S))
                self.inject(kind)
        while time.monotonic() < started + self.plan.seconds:
            time.sleep(self.rng.uniform(*GAP_S))
            self.inject(self.rng.choice(kinds))
        self.figures.seconds = time.monotonic() - started

    def inject(self, kind: str) -> None:
        at = f"+{time.monotonic() - self.t0:.1f} s"
        if kind == KILL:
            self.figures.log.append(f"{at} {self.kill()}")
            self.figures.faults[kind] += 1
            return
        hold = self.rng.uniform(*HOLD_S) if kind in HELD else 0.0
        try:
            with FAULTS[kind](self.target, self.rng) as what:
                self.figures.faults[kind] += 1
                self.brick_stopped = kind == "stopped brick"
                self.figures.log.append(f"{at} {what}" + (f" for {hold:.1f} s" if hold else ""))
                time.sleep(hold)
        except NothingToDamage as why:
            self.figures.skipped[kind] += 1
            self.figures.log.append(f"{at} {kind} skipped: {why}")
        finally:
            self.brick_stopped = False

    def recover(self, since: float) -> None:
        """Wait until every running member stored and read back a new chunk and some
        member evicted, after ``since``; the time it took, or a violation."""
        deadline = since + RECOVERY_BOUND_S
        while True:
            stats = self.read_stats()
            live = [stats.get(r.member.prefix, {}) for r in self.running()]
            roundtrips = [s.get("roundtrip_at", 0.0) for s in live]
            evicted = max((s.get("evicted_at", 0.0) for s in stats.values()), default=0.0)
            if live and min(roundtrips) > since and evicted > since:
                self.figures.recovery_s = max(*roundtrips, evicted) - since
                return
            if time.monotonic() > deadline:
                self.violation(
                    f"no recovery within {RECOVERY_BOUND_S} s of the last fault: "
                    f"{sum(t > since for t in roundtrips)} of {len(live)} members stored "
                    f"and read back a new chunk, "
                    f"{'an' if evicted > since else 'no'} eviction")
                return
            time.sleep(0.2)

    def finish(self) -> None:
        """Stop every member (each closes its store) and fold in their last figures."""
        self.until.touch()
        finals = self.read_stats()  # a killed member's last word
        for r in self.members:
            if r.killed is not None:
                continue
            try:
                finals[r.member.prefix] = r.member.result(timeout_s=CALL_BOUND_S + 60)
            except Exception as exc:  # a member that failed or hung says so
                self.violation(f"member {r.member.prefix} did not end cleanly: {exc}")
                r.member.kill()
                continue
            self._fold(finals[r.member.prefix])
        for stats in finals.values():
            self.figures.wrong += int(stats.get("wrong", 0))
            self.figures.written += int(stats.get("written", 0))
            self.figures.served += sum(int(stats.get(f"{w}_served", 0)) for w in ("peer", "own"))
            self.figures.calls.update({k: int(v) for k, v in stats.get("calls", {}).items()})
        if self.figures.wrong:
            self.violation(f"{self.figures.wrong} chunk(s) read with wrong bytes")
        for name, took in sorted(self.figures.worst_call.items()):
            if took > CALL_BOUND_S:
                self.violation(f"a {name} call took {took:.1f} s (bound {CALL_BOUND_S} s)")
        if self.figures.violations:  # what the members said, for a failure too rare to rerun
            for r in self.members:
                said = [ln for ln in r.member.stderr.splitlines() if " INFO" not in ln]
                self.figures.log += [f"member {r.member.prefix} {r.member.ids} said:",
                                     *said[-40:]]

    def run(self) -> Figures:
        self.watch_sentinel()
        self.t0 = time.monotonic()
        watcher = threading.Thread(target=self.monitor, daemon=True)
        try:
            for _ in range(self.plan.members):
                self.start()
            self.go.touch()
            watcher.start()
            time.sleep(2.0)  # the directory fills: every write evicts
            self.faults()
            self.recover(time.monotonic())
            self.finish()
        finally:
            self.stop.set()
            if watcher.is_alive():
                watcher.join()
            for r in self.members:
                if r.member.proc.poll() is None:
                    r.member.kill()
        self.check_outside()
        return self.figures


def run_harness(plan: Plan, layout: Layout) -> Figures:
    """Run ``plan`` on ``layout`` (see the module doc); the figures, with any violation."""
    return _Harness(plan, layout).run()


def seed_from_env(default: int | None = None) -> int:
    """``$LMCNVME_FAULT_SEED`` if set, else ``default``, else a fresh random seed."""
    text = os.environ.get(SEED_ENV)
    if text:
        return int(text)
    return default if default is not None else random.SystemRandom().randrange(1 << 32)


@contextlib.contextmanager
def local_layout(work: Path, size: str = "64m") -> Iterator[Layout]:
    """The cache on a tmpfs of its own (``size``), the sentinel beside it, the filler in
    that tmpfs's root."""
    with tmpfs(work / "fs", size) as fs:
        yield Layout((fs / "cache",), fs / "cache", fs / "sentinel", fs, None, work)


@contextlib.contextmanager
def gluster_layout(work: Path, brick_fs: str = "96m") -> Iterator[Layout]:
    """A GlusterFS volume mounted twice (members alternate between the mounts), its
    brick on a tmpfs of ``brick_fs`` (the filler goes beside the brick); the sentinel and
    the samples are on the brick, which answers while the brick process is stopped."""
    with gluster_volume(work / "gluster", mounts=2, brick_fs=brick_fs) as volume:
        caches = tuple(m / "cache" for m in volume.mounts)
        yield Layout(caches, volume.on_brick(caches[0]), volume.brick / "sentinel",
                     volume.brick.parent, volume.brick_pid, work)
