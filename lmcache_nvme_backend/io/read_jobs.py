"""Read jobs: one chunk read, verified block by block as its pieces land.

A ``ReadRequest`` is one chunk file to read into a caller's buffer.  The engine
splits it into pieces (one for a chunk up to the task size) that run on a thread
pool; whichever thread finishes a piece hashes the format's checksum blocks that
piece completed (a block spanning two pieces is hashed by whichever finishes
second), and the thread that finishes the last piece calls ``on_done``.  So a
chunk is verified as soon as its own bytes are in, while other chunks are still
being read, and no thread waits for a whole batch before checking anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..disk.format import (
    BLOCK_SIZE,
    ChunkHeader,
    combine_block_digests,
    payload_checksum,
    stated_version,
)
from ..disk.format import block_digests as hash_blocks


@dataclass(eq=False)
class ReadRequest:
    """Read one chunk file: header into ``header``, payload into ``dest``.

    After the read ``error`` is the first failure (None when every byte landed)
    and ``digests`` holds the xxh3 of each checksum block of the payload.
    ``on_done(request)`` runs once, on the thread that completed the read.
    """

    path: Path
    payload_len: int
    dest: memoryview
    direct: bool
    header: bytes = b""
    error: BaseException | None = None
    on_done: Callable[[ReadRequest], None] | None = None
    digests: list[int] = field(default_factory=list)
    _pending_blocks: list[int] = field(default_factory=list)
    _pieces_left: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def block_count(self) -> int:
        return -(-self.payload_len // BLOCK_SIZE)

    def expect_pieces(self, spans: list[tuple[int, int]]) -> None:
        """Announce the pieces (payload offset, length) that will fill the buffer."""
        self.digests = [0] * self.block_count
        self._pending_blocks = [0] * self.block_count
        for start, length in spans:
            for block in _blocks_of(start, length, self.payload_len):
                self._pending_blocks[block] += 1
        self._pieces_left = len(spans)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def piece_done(self, start: int, length: int) -> bool:
        """Hash the blocks this piece completed; True when it was the request's last piece."""
        with self._lock:
            ready = []
            for block in _blocks_of(start, length, self.payload_len):
                self._pending_blocks[block] -= 1
                if self._pending_blocks[block] == 0:
                    ready.append(block)
        # A version 1 file is checked over the whole payload (payload_matches): block
        # digests would be hashed for nothing once its header has landed.
        if self.error is None and stated_version(self.header) != 1:
            for block in ready:  # xxh3 releases the GIL: other pieces keep reading
                begin = block * BLOCK_SIZE
                end = min(begin + BLOCK_SIZE, self.payload_len)
                self.digests[block] = hash_blocks(self.dest[begin:end])[0]
        with self._lock:
            self._pieces_left -= 1
            return self._pieces_left == 0

    def computed_checksum(self) -> int:
        """The payload checksum of the bytes that landed, as the header that landed states
        its version: the whole payload's xxh3 for version 1, the block digests combined
        otherwise (what an engine hands back with a chunk it could not verify)."""
        if stated_version(self.header) == 1:
            return payload_checksum(self.dest[: self.payload_len], version=1)
        return combine_block_digests(self.digests)

    def payload_matches(self, header: ChunkHeader) -> bool:
        """Whether the payload that landed matches the header's checksum (v2 or v1)."""
        if header.version == 1:
            return payload_checksum(self.dest[: self.payload_len], version=1) == \
                header.payload_checksum
        return combine_block_digests(self.digests) == header.payload_checksum


def _blocks_of(start: int, length: int, payload_len: int) -> range:
    """The checksum blocks that the payload bytes ``[start, start + length)`` touch."""
    end = min(start + length, payload_len)
    if end <= start:
        return range(0)
    return range(start // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1)


class Latch:
    """Counts down completions; ``wait`` returns when all have happened."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._cond = threading.Condition()

    def count_down(self) -> None:
        with self._cond:
            self._count -= 1
            if self._count <= 0:
                self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._count <= 0)
