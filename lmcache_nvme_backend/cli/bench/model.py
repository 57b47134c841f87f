"""What one ``lmcache-nvme bench`` run is: its configuration and its results, ours or fio's.

``bs`` is one chunk file's payload, one I/O.  Latency is what the caller sees: a read chunk
completes when its batch returns, a written one when the engine hands it back, in place.
"""

from __future__ import annotations

import dataclasses
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

    def in_flight(self) -> int:
        """Most I/Os the engine keeps in flight: the queue depth fio gets in ``--vs-fio``.

        Reads count in pieces, a batch's all in parallel up to the read threads (as the
        native engine reads them), except that a batch of at most two counts once per caller
        (the Python engine reads those on its caller alone).  Both engines only approach
        this: the Python one reads a large chunk's pieces in order, the native one has no
        caller-alone rule."""
        readers, writers = self.split_threads()
        total = writers
        if readers:
            # a chunk is ceil(bs / task_size) I/Os (the header rides with the first piece)
            pieces = self.iodepth * -(-self.bs // self.task_size)
            # the Python engine's rule for a read of at most two chunks, here in pieces
            total += self.callers if pieces <= 2 else min(readers, self.callers * pieces)
        return max(1, total)

    def label(self) -> dict[str, Any]:
        """The fields as JSON, ``size`` as a pass moves it (whole chunks)."""
        return {**dataclasses.asdict(self), "size": self.nchunks * self.bs,
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
            pct = {f"p{p:g}": float(v)
                   for p, v in zip(PERCENTILES, np.percentile(lat, PERCENTILES), strict=True)}
            pct.update(max=float(lat.max()), mean=float(lat.mean()))
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
        return {"tool": self.tool, "config": self.config.label(),
                "bw_bytes": round(self.bw_bytes()), "bw_gb_s": round(self.bw_bytes() / 1e9, 3),
                **{name: d.to_json() for name, d in self.dirs.items()}, **self.extra}


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
