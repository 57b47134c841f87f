"""Placement and settlement of a batch of chunk writes: where each goes, and what became of it.

``place`` groups the admitted chunks of one layout by root and reserves their bytes: a
root's share as one amount when it fits (its eviction victims deferred to the engine,
which removes their files first), chunk by chunk otherwise.  ``settle`` indexes what the
engine wrote in one lock hold and counts each chunk that was not written by its reason.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from ..config import NVMeSettings
from ..disk.format import TensorMeta
from ..disk.gpusum import host_checksum
from ..disk.layout import temp_name
from ..io import engine
from ..io.posix import NotAChunkFile
from .catalog import Catalog
from .index import IndexEntry
from .room import Room
from .roots import Roots, RootState, note_full, note_space, write_namespace_file
from .stats import Counter, StoreStats
from .writeback import TaskOutcome

logger = logging.getLogger(__name__)

_FSYNC_LEVEL = {"none": 0, "data": 1, "full": 2}


class Layout(NamedTuple):
    """What the chunks of one layout and namespace share, derived once for each."""

    meta: TensorMeta
    namespace: str
    nbytes: int
    file_size: int
    key_room: int  # UTF-8 bytes of key that fit the header beside the rest
    fits: bool  # a chunk fits the queue and a root's budget at all
    meta_json: bytes
    namespace_raw: bytes
    ns_id: str


#: One root's share of a batch: the root, the positions of its chunks in the batch (their
#: bytes reserved) and the victims evicted for them, whose files its first write removes.
Share = tuple[RootState, list[int], list[IndexEntry]]
#: A batch placed: ``(layout, digests, payloads, key_bytes, shares, dropped, started)``:
#: the batch's columns (by position), its shares and how many chunks could not be placed.
#: A plain tuple: one is built per store call.
Placed = tuple[Layout, list[str], Sequence[memoryview], list[bytes], list[Share], int, float]


class Placement:
    """Places the chunks of one store's writes on its roots and settles what was written."""

    def __init__(self, settings: NVMeSettings, catalog: Catalog, roots: Roots, room: Room,
                 stats: StoreStats) -> None:
        self._catalog = catalog
        self._roots = roots
        self._room = room
        self._stats = stats
        # the engine's writers share one temp-name suffix (see ``temp_name``); every write
        # share carries the file mode, directory mode and fsync level
        self._temp_suffix = temp_name("", writer=0)
        self._modes = (settings.file_mode, settings.dir_mode, _FSYNC_LEVEL[settings.fsync])
        # each root's write naming of a namespace (``RootLayout.write_naming``), made once
        self._naming: dict[tuple[int, str], engine.WriteNaming] = {}

    def place(self, layout: Layout, positions: Sequence[int], digests: list[str],
              payloads: Sequence[memoryview], key_bytes: list[bytes]) -> Placed:
        """Each position's root and reserved bytes; a chunk with no root or no room is
        dropped and counted."""
        by_root, homeless = self._roots.group(positions, digests.__getitem__)
        dropped = len(homeless)
        if homeless:
            self._stats.add(Counter.WRITE_FAILURES, len(homeless))
            self._catalog.end_pending(digests[i] for i in homeless)
        shares: list[Share] = []
        size = layout.file_size
        for root, mine in by_root:
            victims: list[IndexEntry] = []
            if self._room.reserve(root, len(mine) * size, victims):
                shares.append((root, mine, victims))
                continue
            self._room.evict_deferred(root, victims)  # no room for the whole share
            victims = []  # removed and counted as freed: not the share's to remove again
            fits: list[int] = []
            for i in mine:
                if self._room.reserve(root, size, victims):
                    fits.append(i)
                else:
                    self._stats.add(Counter.CAPACITY_DROPS)
                    self._catalog.end_pending([digests[i]])
                    dropped += 1
            if fits:
                shares.append((root, fits, victims))
            else:
                self._room.evict_deferred(root, victims)
        return layout, digests, payloads, key_bytes, shares, dropped, time.perf_counter()

    def shares(self, placed: Placed, gpu_checksums: bool) -> list[engine.WriteShare]:
        """The engine's write shares of a batch, one per root, with the GPU read path's
        checksum of each payload when files carry it."""
        layout, digests, payloads, key_bytes, shares, _, _ = placed
        file_mode, dir_mode, fsync = self._modes
        out: list[engine.WriteShare] = []
        for root, mine, victims in shares:
            tree = root.layout
            naming = self._naming.get((root.index, layout.ns_id))
            if naming is None:
                naming = self._naming[root.index, layout.ns_id] = \
                    tree.write_naming(layout.ns_id, self._temp_suffix)
            if len(mine) == len(digests):  # the whole batch, in order
                share, share_payloads, share_keys = digests, list(payloads), key_bytes
            else:
                share = [digests[i] for i in mine]
                share_payloads = [payloads[i] for i in mine]
                share_keys = [key_bytes[i] for i in mine]
            sums = None
            if gpu_checksums:
                self._stats.add(Counter.GPU_CHECKSUMS_RECORDED, len(share_payloads))
                sums = list(map(host_checksum, share_payloads))
            out.append((root.descriptor(), naming, layout.namespace_raw, layout.meta_json,
                        root.direct, file_mode, dir_mode, fsync,
                        tree.chunk_rels(victims) if victims else (), share, share_payloads,
                        share_keys, sums))
        return out

    def undo(self, placed: Placed) -> None:
        """Give back a batch's reservations and remove its victims' files now (they are out
        of the index already): the engine never took it."""
        layout, digests, _, _, shares, _, _ = placed
        for root, mine, victims in shares:
            self._catalog.release(root.index, len(mine) * layout.file_size)
            self._room.evict_deferred(root, victims)
            self._catalog.end_pending(digests[i] for i in mine)

    def settle(self, placed: Placed, result: engine.Batch | None) -> TaskOutcome:
        """Index what the engine wrote of a batch, count why the rest was not (``result``
        None: nothing was handed to it); the batch's outcome (positions in the batch)."""
        layout, digests, _, _, shares, dropped, started = placed
        one = len(shares) == 1
        order = shares[0][1] if one else [i for _, mine, _ in shares for i in mine]
        errors = self._errors(placed, order, result.details) if result and result.details \
            else {}
        written = [i for i in order if i not in errors] if errors else order
        count = len(written)
        for root, mine, victims in shares:
            if victims:
                self._room.guards[root.index].freed(sum(v.size for v in victims))
            if count and (not errors or any(i not in errors for i in mine)):
                root.consecutive_errors = 0
                note_space(root)
        whole = one and count == len(digests)  # every chunk of the batch, in order
        if count:
            roots = [shares[0][0].index] * count if one else \
                [root.index for root, mine, _ in shares for i in mine if i not in errors]
            self._catalog.publish_layout(digests if whole else [digests[i] for i in written],
                                         roots, layout.ns_id, layout.file_size, layout.meta,
                                         time.time_ns())
            self._stats.record_write(count * layout.nbytes,
                                     (time.perf_counter() - started) / count, count)
        if errors:
            self._catalog.end_pending(digests[i] for i in errors)
        ok = not errors and not dropped
        if not layout.nbytes:  # nothing of a chunk without payload is reported stored
            return TaskOutcome(ok, 0, [], [], [])
        stored = None if ok and whole else list(written)
        return TaskOutcome(ok, count * layout.nbytes, stored,
                           digests if stored is None else [digests[i] for i in written],
                           [layout.file_size] * count)

    def _errors(self, placed: Placed, order: list[int], details: list[tuple[int, int, int]]
                ) -> dict[int, OSError]:
        """The positions of a batch's chunks not published, each settled (reservation given
        back, reason counted); one that made its namespace's directory writes the name file."""
        layout, digests, _, _, shares, _, _ = placed
        root_of = {i: root for root, mine, _ in shares for i in mine}
        errors: dict[int, OSError] = {}
        for k, status, err in details:
            i = order[k]
            root = root_of[i]
            if status == engine.NEW_NAMESPACE:
                write_namespace_file(root.layout, layout.ns_id, layout.namespace,
                                     self._modes[0])
                continue
            self._catalog.release(root.index, layout.file_size)
            error = _os_error(err, root.layout.chunk_path(layout.ns_id, digests[i]))
            errors[i] = error
            if err != errno.ECANCELED:  # a closing store: not a failure
                self._failed(root, error)
        return errors

    def _failed(self, root: RootState, error: OSError) -> None:
        """Count one write that failed, by its reason."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            # A full filesystem is not a failing drive: drop this write, keep serving.
            self._stats.add(Counter.CAPACITY_DROPS)
            self._room.guards[root.index].refresh()
            note_full(root, error)
            return
        self._stats.add(Counter.WRITE_FAILURES)
        if isinstance(error, (NotAChunkFile, FileNotFoundError)):
            # A link or file planted where the tree needs a directory (never followed), or
            # the cache directory removed: this write is dropped, the drive is fine.
            if isinstance(error, FileNotFoundError):
                root.maybe_removed = True  # the next share checks the descriptor first
            logger.warning("NVMe tier: not writing %s: %s", error.filename, error.strerror)
            return
        self._roots.record_error(root, error)


def _os_error(err: int, path: Path) -> OSError:
    """The exception of a write that failed with ``err``: a link, or a file where the tree
    needs a directory, is ``NotAChunkFile`` (as ``safe_fs`` says)."""
    if err in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        return NotAChunkFile(err, "a link or a non-directory in the cache tree (never "
                                  "followed)", str(path))
    if err == errno.ENOENT:
        return FileNotFoundError(err, "the cache directory was removed", str(path))
    return OSError(err, os.strerror(err), str(path))
