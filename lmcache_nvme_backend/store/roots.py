"""The cache directories of a store: opening them, placement, health and quarantine.

A root is one ``nvme.path`` entry, usually one drive.  Chunks are placed by
rendezvous hashing (each digest ranks the roots by ``xxh64(root index, digest)``
and goes to the best healthy one), so adding or losing a root moves only its
share of the keys, and a reader that looks on disk (shared mode) tries the
roots in the order a writer would have chosen them.  A root that fails
``ROOT_ERROR_LIMIT`` I/Os in a row is taken out of service for ``ROOT_RETRY_S``
while the others keep serving.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..config import NVMeConfigError
from ..disk.layout import MARKER_NAME, RootLayout
from ..io.posix import probe_direct_io

logger = logging.getLogger(__name__)

# A root that fails this many I/Os in a row is taken out of service for a while.
ROOT_ERROR_LIMIT = 3
ROOT_RETRY_S = 30.0
MAX_QUARANTINED_FILES = 256


@dataclass
class RootState:
    """One cache directory and its health."""

    index: int
    layout: RootLayout
    direct: bool
    consecutive_errors: int = 0
    offline_until: float = 0.0

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.offline_until


@dataclass(frozen=True)
class RootInfo:
    """What the store tells the outside about one of its directories."""

    path: Path
    direct_io: bool
    healthy: bool


def open_root(index: int, path: Path, direct_io_mode: str) -> RootState:
    """Create the root's directories and marker, and probe O_DIRECT per ``nvme.direct_io``."""
    layout = RootLayout(path)
    for d in (layout.index_dir, layout.quarantine_dir, layout.namespaces_dir):
        d.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER_NAME
    if not marker.exists():
        marker.write_text("lmcache-nvme-backend cache root, chunk format 1\n")
    direct = direct_io_mode != "off" and probe_direct_io(path)
    if direct_io_mode == "on" and not direct:
        raise NVMeConfigError(
            f"nvme.direct_io: '{path}' does not support O_DIRECT (tmpfs, some network or "
            "overlay filesystems). Put the cache on a local NVMe filesystem such as ext4 or "
            "xfs, or set nvme.direct_io to 'auto' to fall back to buffered I/O.")
    if direct_io_mode == "auto" and not direct:
        logger.warning("NVMe tier: %s does not support O_DIRECT; using buffered I/O there "
                       "(page cache in the data path).", path)
    return RootState(index, layout, direct)


class Roots(Sequence[RootState]):
    """The store's roots, in ``nvme.path`` order."""

    def __init__(self, states: list[RootState]) -> None:
        self._states = states

    @classmethod
    def open(cls, paths: Sequence[Path], direct_io_mode: str) -> Roots:
        return cls([open_root(i, path, direct_io_mode) for i, path in enumerate(paths)])

    def __getitem__(self, i: int) -> RootState:  # type: ignore[override]
        return self._states[i]

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RootState]:
        return iter(self._states)

    def healthy(self, index: int) -> bool:
        return self._states[index].healthy

    def in_placement_order(self, digest: str) -> list[RootState]:
        """Healthy roots, the one a writer would choose for ``digest`` first."""
        return sorted((r for r in self._states if r.healthy), reverse=True,
                      key=lambda r: xxhash.xxh64_intdigest(f"{r.index}:{digest}".encode()))

    def choose(self, digest: str) -> RootState | None:
        """The root that holds ``digest`` (None when every root is out of service)."""
        order = self.in_placement_order(digest)
        return order[0] if order else None

    def record_error(self, root: RootState, exc: BaseException) -> None:
        """An I/O error on ``root``: too many in a row take it out of service for a while."""
        root.consecutive_errors += 1
        logger.warning("NVMe tier: I/O error on %s: %s", root.layout.root, exc)
        if root.consecutive_errors >= ROOT_ERROR_LIMIT and root.healthy:
            root.offline_until = time.monotonic() + ROOT_RETRY_S
            logger.error("NVMe tier: taking %s out of service for %.0f s after %d errors in "
                         "a row; other paths keep serving.", root.layout.root, ROOT_RETRY_S,
                         root.consecutive_errors)

    def describe(self) -> list[RootInfo]:
        return [RootInfo(r.layout.root, r.direct, r.healthy) for r in self._states]


def quarantine_file(root: RootState, digest: str, path: Path) -> bool:
    """Move a file that failed validation aside (deleted when it cannot be moved).

    Returns whether it was moved.  At most ``MAX_QUARANTINED_FILES`` are kept per
    root, the oldest removed first.
    """
    moved = True
    try:
        os.rename(path, root.layout.quarantine_path(digest))
    except OSError:
        moved = False
        unlink_quietly(path)
    try:
        files = sorted(root.layout.quarantine_dir.iterdir())
    except OSError:
        return moved
    for old in files[: max(0, len(files) - MAX_QUARANTINED_FILES)]:
        unlink_quietly(old)
    return moved


def unlink_quietly(path: Path) -> None:
    """Remove a file; one that is already gone is fine, other failures are logged."""
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            logger.debug("could not remove %s: %s", path, exc)
