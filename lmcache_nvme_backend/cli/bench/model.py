"""What one ``lmcache-nvme bench`` run is: its configuration and its results.

Vocabulary (``docs/cli.md`` has the long form):

* ``bs``: payload bytes of one chunk file; one chunk is one I/O in the counts.
* ``threads``: reads: the engine's read threads (``nvme.io_threads``);
  writes: its writer threads (``nvme.write_threads``), one chunk in flight each.
* ``iodepth``: reads: chunks per engine read call (the batch LMCache hands
  the backend).  At most ``min(threads, pieces of the batch)`` reads are in
  flight, where a chunk is ``ceil(bs / task_size)`` I/Os (the header rides with the
  first).
* ``callers``: reads: threads calling the engine's read concurrently, each with its
  own batch (several requests retrieving at once; ``NVMeBackend`` runs two).
* latency: what the caller sees.  A read chunk completes when its batch returns;
  a written chunk when the engine hands it back, written and renamed into place.

The same records hold fio's results (``fio.py``), so reports and plots treat
both tools alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..common import MIB

READ_MODES = ("read", "randread")
WRITE_MODES = ("write", "randwrite")
RW_MODES = (*READ_MODES, *WRITE_MODES, "rw")
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration (one point of a sweep)."""

    rw: str
    bs: int
    size: int
    threads: int
    iodepth: int
    task_size: int
    direct: bool
    dest: str = "host"
    runtime: float | None = None
    checksum: bool = False
    callers: int = 1

    @property
    def nchunks(self) -> int:
        return max(1, self.size // self.bs)

    @property
    def random_order(self) -> bool:
        return self.rw.startswith("rand")

    @property
    def reads(self) -> bool:
        return self.rw in READ_MODES or self.rw == "rw"

    @property
    def writes(self) -> bool:
        return self.rw in WRITE_MODES or self.rw == "rw"

    def chunk_counts(self) -> tuple[int, int]:
        """(chunks read, chunks written) per pass; ``rw`` splits them half and half."""
        n = self.nchunks
        if self.rw == "rw":
            return max(1, n // 2), max(1, n - n // 2)
        return (n, 0) if self.reads else (0, n)

    def split_threads(self) -> tuple[int, int]:
        """(read pool threads, writer threads) for this mode."""
        if self.rw == "rw":
            readers = max(1, self.threads // 2)
            return readers, max(1, self.threads - readers)
        return (self.threads, 0) if self.reads else (0, self.threads)

    def pieces_per_chunk(self) -> int:
        """I/Os the engine issues for one chunk (the header rides with the first piece)."""
        return -(-self.bs // self.task_size)

    def in_flight(self) -> int:
        """Most I/Os the engine keeps in flight in this configuration.

        This is the queue depth fio is given in ``--vs-fio`` (numjobs x iodepth).
        """
        readers, writers = self.split_threads()
        total = writers
        if readers:
            pieces = self.iodepth * self.pieces_per_chunk()
            # an engine read of at most two pieces runs on its caller, one at a time
            total += self.callers if pieces <= 2 else min(readers, self.callers * pieces)
        return max(1, total)

    def label(self) -> dict[str, Any]:
        return {"rw": self.rw, "bs": self.bs, "size": self.nchunks * self.bs,
                "threads": self.threads, "iodepth": self.iodepth, "task_size": self.task_size,
                "direct": self.direct, "dest": self.dest, "runtime": self.runtime,
                "checksum": self.checksum, "callers": self.callers,
                "in_flight": self.in_flight()}


@dataclass
class DirStats:
    """Result of one direction (read or write) of one run, ours or fio's."""

    direction: str
    bytes: int
    seconds: float
    ios: int
    lat_ms: dict[str, float]

    @property
    def bw_bytes(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.ios / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"direction": self.direction, "bytes": self.bytes,
                "seconds": round(self.seconds, 6), "ios": self.ios,
                "bw_bytes": round(self.bw_bytes), "bw_mib_s": round(self.bw_bytes / MIB, 1),
                "bw_gb_s": round(self.bw_bytes / 1e9, 3), "iops": round(self.iops, 1),
                "lat_ms": {k: round(v, 3) for k, v in self.lat_ms.items()}}

    @classmethod
    def from_latencies(cls, direction: str, nbytes: int, seconds: float,
                       latencies_s: list[float]) -> DirStats:
        lat = np.asarray(latencies_s, dtype=np.float64) * 1e3
        pct: dict[str, float] = {}
        if len(lat):
            for p, v in zip(PERCENTILES, np.percentile(lat, PERCENTILES), strict=True):
                pct[f"p{p:g}"] = float(v)
            pct["max"] = float(lat.max())
            pct["mean"] = float(lat.mean())
        return cls(direction, nbytes, seconds, len(lat), pct)


@dataclass
class RunResult:
    """One run of one configuration by one tool (``lmcache-nvme`` or ``fio``)."""

    tool: str
    config: BenchConfig
    dirs: dict[str, DirStats] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def bw_bytes(self) -> float:
        return sum(d.bw_bytes for d in self.dirs.values())

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"tool": self.tool, "config": self.config.label(),
                               "bw_bytes": round(self.bw_bytes()),
                               "bw_gb_s": round(self.bw_bytes() / 1e9, 3)}
        doc.update({name: d.to_json() for name, d in self.dirs.items()})
        doc.update(self.extra)
        return doc


@dataclass
class Timed:
    """Bytes moved, active seconds and per-chunk latencies of one direction of our run."""

    nbytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)


def read_batches(n: int, cfg: BenchConfig, started: float) -> Iterator[list[int]]:
    """Chunk indices in batches of ``iodepth``: one pass, or passes until ``runtime``."""
    rng = random.Random(1)
    deadline = started + cfg.runtime if cfg.runtime else None
    while True:
        order = list(range(n))
        if cfg.random_order:
            rng.shuffle(order)
        for start in range(0, n, cfg.iodepth):
            if deadline is not None and time.perf_counter() >= deadline:
                return
            yield order[start : start + cfg.iodepth]
        if deadline is None:
            return
