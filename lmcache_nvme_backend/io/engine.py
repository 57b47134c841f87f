"""The seam between the chunk store and an I/O engine: two batch shapes, one result, one protocol.

The store decides (which chunks, which root, how many bytes, what a result means); an
engine moves bytes.  Only plain values cross: a batch is a sequence of shares
(``ReadShare``, ``WriteShare``: the chunks of one call or task on one root, in one
namespace and layout, the common part once, then columns of one length), and the engine
hands back one ``Batch``.  The engine names each chunk's files from its digest and the
share's naming (``RootLayout.chunk_naming`` / ``write_naming``): no Python per chunk.
Both engines, ``native.py`` and ``python_engine.py``, pass ``tests/unit/test_engine_contract.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

#: A chunk's status in a ``Batch``.  OK: read and verified / written and renamed into place.
#: JUDGE (reads): the bytes landed but the quick check failed; the details carry the header
#: and checksum for ``disk.validate`` to name the defect.  FAILED: an errno in the details.
#: NEW_NAMESPACE (writes): published, in a namespace directory made for it.
OK, JUDGE, FAILED, NEW_NAMESPACE = 0, 1, 2, 3

#: How a root names a chunk's file from its digest, ``(shard_prefix, shard_levels,
#: final_suffix)`` (``RootLayout.chunk_naming``).
ChunkNaming = tuple[str, int, str]

#: How a root names a chunk's files from its digest, ``(shard_prefix, shard_levels,
#: final_suffix, temp_suffix)`` (``RootLayout.write_naming``).
WriteNaming = tuple[str, int, str, str]

#: The chunks of a read call on one root in one namespace and layout, ``(root_fd, naming,
#: direct, payload_len, meta, digests, dests, keys)``: ``meta`` as the header holds it, keys
#: UTF-8; each chunk is read into its buffer and checked against its key and ``meta``.  A
#: plain tuple: a named tuple's constructor costs about five times one.
ReadShare = tuple[int, ChunkNaming, bool, int, bytes, list[str], list[memoryview], list[bytes]]

#: The chunks of a store task that go to one root, ``(root_fd, naming, namespace, meta,
#: direct, mode, dir_mode, fsync_level, victims, digests, payloads, keys, gpu_checksums)``:
#: ``namespace`` and ``meta`` as the header holds them; each chunk is written as its temp
#: name, then renamed; ``fsync_level`` 0 none, 1 the file's data, 2 also the directory;
#: ``victims``: relative paths removed before the first write (evicted for this share);
#: ``gpu_checksums``: None, or an ``(a, b)`` per chunk for its header.
WriteShare = tuple[int, WriteNaming, bytes, bytes, bool, int, int, int, tuple[str, ...],
                   list[str], list[memoryview], list[bytes], "list[tuple[int, int]] | None"]


class Batch(NamedTuple):
    """A batch's outcome: a status per chunk, in order, and the details of every chunk not
    OK: reads ``(index, errno, header or None, checksum of what landed)``, writes ``(index,
    status, errno)``."""

    statuses: bytes
    details: list[Any]


#: Called once with a batch's outcome, on one of the engine's threads; must be quick.
OnDone = Callable[[Batch], None]


class ChunkEngine(Protocol):
    """What the store asks of an I/O engine.  Every call takes plain values; none blocks on
    another call's I/O except ``read`` (which waits for its own batch) and ``close``."""

    name: str

    def read(self, shares: Sequence[ReadShare]) -> Batch:
        """Read and verify a batch; the calling thread helps and returns when all are done."""

    def submit_read(self, shares: Sequence[ReadShare], on_done: OnDone) -> None:
        """Start reading a batch; ``on_done(batch)`` runs on an engine thread after it."""

    def submit_write(self, shares: Sequence[WriteShare], on_done: OnDone) -> None:
        """Start writing a batch (writers run at a lower CPU priority and let reads in flight
        go first for a bounded time); ``on_done(batch)`` runs on an engine thread after it."""

    def unlink(self, items: Sequence[tuple[int, str]]) -> list[int]:
        """Remove chunk files ``(root_fd, rel)`` now, on the calling thread, without following
        a link in their directories; an errno per item (0: removed)."""

    def cancel_writes(self) -> int:
        """Writes not started yet end as ``ECANCELED`` (a closing store); how many."""

    def reading(self) -> AbstractContextManager[None]:
        """Held while reading outside the engine (the GPU path): writers that can see it
        yield as they yield to the engine's own reads."""

    def signal_later(self, eventfd: int) -> bool:
        """In an ``on_done``: have ``eventfd`` signalled once the engine's thread is done with
        the batches in hand (one GIL release for all); False: the caller signals it itself."""

    def writer_thread_ids(self) -> list[int]:
        """Kernel ids of the threads that write chunk files."""

    def retired_bytes(self) -> int:
        """Bytes in removed chunk files kept for reuse (on disk, outside the index)."""

    def close(self) -> None:
        """Finish queued reads and writes, hand back their batches, stop every thread."""
