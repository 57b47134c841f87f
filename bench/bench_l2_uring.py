"""Experiment: the paired L2 benchmark with whole-chunk reads on one io_uring thread.

The store's read engine runs every chunk read as a job on its ``nvme-io`` thread
pool (``io/posix.py``): open, one vectored read of header and payload, hash, check,
complete.  This script asks whether one thread driving an io_uring does better
(no hand-off between threads per chunk): it replaces the engine's whole-chunk
reads by one thread that opens each file (through ``disk/safe_fs.py``, as the
store does), submits one ``readv`` of header and payload into the caller's buffer,
keeps ``--depth`` reads in flight, and on each completion hashes the blocks and
completes the request.  That is the path of ``NVMeL2Adapter``'s loads
(``submit_reads``); everything else (writes, waiting reads, reads that need a
staging copy) is the normal engine.  Then it runs ``bench_l2_paired.py`` for one object size.

Run processes with ``--engine pool`` (the store as shipped) and ``--engine uring``
alternately and compare their ``nvme/fs_native`` ratios (``docs/benchmarks.md``,
"One io_uring thread instead of the read pool")::

    for i in 1 2 3; do for e in pool uring; do
      sudo LMCACHE_TRACK_USAGE=false python bench/bench_l2_uring.py /var/tmp/l2pair \\
          --engine $e --sizes-mb 16 --rounds 5
    done; done

Needs the ``liburing`` Python binding.  Its 2026 wheels stop with an illegal
instruction on CPUs without AVX-512; version 2024.5.3 builds from source with the
system compiler: ``pip install --no-binary liburing liburing==2024.5.3``.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache_nvme_backend.disk.format import HEADER_SIZE, padded_length
from lmcache_nvme_backend.io import posix
from lmcache_nvme_backend.io.buffers import AlignedBuffer, is_aligned
from lmcache_nvme_backend.io.files import open_for_read_sized
from lmcache_nvme_backend.io.read_jobs import ReadRequest


def uring_engine_class(depth: int) -> type[posix.PosixIOEngine]:
    """A ``PosixIOEngine`` whose aligned whole-chunk O_DIRECT reads go through io_uring."""
    import liburing as uring  # imported here: the error below names the fix

    class UringReadEngine(posix.PosixIOEngine):
        name = "posix+io_uring"
        completions = 0

        def __init__(self, task_size: int, pool: ThreadPoolExecutor) -> None:
            super().__init__(task_size, pool)
            self._ring = uring.io_uring()
            uring.io_uring_queue_init(2 * depth, self._ring, 0)
            # liburing's Python wrappers keep the GIL while they wait for completions,
            # so the thread sleeps in read() on an eventfd the ring signals instead.
            self._wakeup = os.eventfd(0, os.EFD_CLOEXEC)
            uring.io_uring_register_eventfd(self._ring, self._wakeup)
            self._queue: collections.deque[ReadRequest] = collections.deque()
            self._headers = [AlignedBuffer(HEADER_SIZE) for _ in range(depth)]
            self._free_slots = list(range(depth))
            self._in_flight: dict[int, tuple[ReadRequest, int, Any, int]] = {}
            threading.Thread(target=self._run, name="nvme-uring", daemon=True).start()

        def submit_reads(self, requests: Any) -> None:
            rest = []
            for req in requests:
                if req.direct and req.payload_len and is_aligned(req.dest) \
                        and len(req.dest) >= padded_length(req.payload_len):
                    req.expect_pieces([(0, req.payload_len)])
                    self._queue.append(req)
                else:
                    rest.append(req)
            if rest:
                super().submit_reads(rest)
            os.eventfd_write(self._wakeup, 1)

        def _fail(self, req: ReadRequest, error: BaseException) -> None:
            req.fail(error)
            req.piece_done(0, req.payload_len)
            posix._finish(req)

        def _start(self, req: ReadRequest) -> bool:
            need = HEADER_SIZE + padded_length(req.payload_len)
            try:
                fd, size = open_for_read_sized(req.path, True)
            except Exception as exc:
                self._fail(req, exc)
                return False
            if size < need:
                os.close(fd)
                self._fail(req, posix.ShortFileError(
                    errno.EIO, "chunk file shorter than its payload", str(req.path)))
                return False
            slot = self._free_slots.pop()
            iov = uring.iovec([self._headers[slot].view[:HEADER_SIZE],
                               req.dest[: padded_length(req.payload_len)]])
            sqe = uring.io_uring_get_sqe(self._ring)
            uring.io_uring_prep_readv(sqe, fd, iov, 0)
            uring.io_uring_sqe_set_data64(sqe, slot + 1)  # user data 0 reads as "none"
            self._in_flight[slot] = (req, fd, iov, need)
            return True

        def _complete(self, slot: int, result: int) -> None:
            req, fd, _iov, need = self._in_flight.pop(slot)
            os.close(fd)
            type(self).completions += 1
            if result < 0:
                req.fail(OSError(-result, os.strerror(-result), str(req.path)))
            elif result < need:
                req.fail(posix.ShortFileError(errno.EIO, "short read", str(req.path)))
            req.header = bytes(self._headers[slot].view[:HEADER_SIZE])
            self._free_slots.append(slot)
            req.piece_done(0, req.payload_len)  # hashes every block (xxh3 drops the GIL)
            posix._finish(req)

        def _run(self) -> None:
            cqe = uring.io_uring_cqe()
            while True:
                os.eventfd_read(self._wakeup)
                while True:
                    started = 0
                    while self._free_slots and self._queue:
                        started += self._start(self._queue.popleft())
                    if started:
                        uring.io_uring_submit(self._ring)
                    reaped = 0
                    while self._in_flight and uring.io_uring_peek_cqe(self._ring, cqe) == 0:
                        slot, result = cqe.user_data - 1, cqe.res
                        uring.io_uring_cqe_seen(self._ring, cqe)
                        self._complete(slot, result)
                        reaped += 1
                    if not reaped and not (self._free_slots and self._queue):
                        break

    return UringReadEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("pool", "uring"), default="uring",
                        help="pool: the store as shipped; uring: one io_uring read thread")
    parser.add_argument("--depth", type=int, default=8,
                        help="io_uring: chunk reads in flight (default 8, as nvme.io_threads)")
    args, rest = parser.parse_known_args()
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print("\nEvery other option is bench_l2_paired.py's (python bench/bench_l2_paired.py -h).")
        return 0
    sizes = rest[rest.index("--sizes-mb") + 1] if "--sizes-mb" in rest else ""
    if not sizes or "," in sizes:
        parser.error("give one object size: --sizes-mb N")
    if args.engine == "uring":
        try:
            engine_class = uring_engine_class(args.depth)
        except ImportError:
            parser.error("the liburing Python binding is not installed: "
                         "pip install --no-binary liburing liburing==2024.5.3")
        from lmcache_nvme_backend.store import chunk_store
        chunk_store.PosixIOEngine = engine_class
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_l2_paired

    sys.argv = [bench_l2_paired.__file__, *rest, "--one-size"]
    status = bench_l2_paired.main()
    if args.engine == "uring":
        print(f"engine: io_uring read thread, {engine_class.completions} chunk reads "
              "completed through it")
    else:
        print("engine: the store's read pool")
    return status


if __name__ == "__main__":
    sys.exit(main())
