"""What the three adapters share: opening the tier, saying so, and LMCache key translation.

Each constructor runs one chain: LMCache's version checked (``lmcache_range``) → settings →
``ChunkStore`` (a bad setting is logged as ``NOT loaded`` at error level: LMCache's plugin
launchers hide constructor exceptions) → metrics observer → one ``ready`` line.  The
in-process adapters also check that chunk keys survive a restart (``hashing.py``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..config import NVMeConfigError, NVMeSettings
from ..metrics import TierObserver
from ..store import ChunkStore, Counter, RootInfo
from .hashing import TokenHashing, restart_miss_warning, token_hashing
from .lmcache_range import describe_lmcache, lmcache_imports, range_warning, supported_range
from .model_build import ModelBuilds

with lmcache_imports():
    from lmcache.logging import init_logger
    from lmcache.utils import CacheEngineKey

# The package logger carries LMCache's formatting; every adapter logs through it.
logger = init_logger("lmcache_nvme_backend")

#: Lookups after a start that recovered chunks: when none of them hit, say why that may be.
RESTART_MISS_LOOKUPS = 64

_warned: set[str] = set()  # tiers that logged the hashing warning in this process
_range_checked = False  # the LMCache version was checked in this process
_ignored: set[tuple[str, frozenset[str]]] = set()  # unknown arguments logged (tier, names)


def check_lmcache_range() -> None:
    """Warn once per process when the installed LMCache is outside the supported range."""
    global _range_checked
    if not _range_checked:
        _range_checked = True
        if warning := range_warning():
            logger.warning("%s", warning)


def ignore_unknown_arguments(tier: str, arguments: Mapping[str, Any]) -> None:
    """Log keyword arguments a newer LMCache passes (plugins take ``**kwargs``) once per
    tier and set of names; use none of them."""
    names = frozenset(arguments)
    if not names or (tier, names) in _ignored:
        return
    _ignored.add((tier, names))
    logger.warning("NVMe tier: ignoring arguments this version does not know: %s, from %s; "
                   "supported LMCache range %s (%s).", ", ".join(sorted(names)),
                   describe_lmcache(), supported_range(), tier)


@contextmanager
def loading(tier: str, consequence: str = "") -> Iterator[None]:
    """Check LMCache's version, then log ``<tier> NOT loaded: <problem>`` at error level
    when the settings are wrong."""
    check_lmcache_range()
    try:
        yield
    except NVMeConfigError as exc:
        logger.error("%s NOT loaded: %s%s", tier, exc, f" {consequence}" if consequence else "")
        raise


def open_store(tier: str, settings_of: Callable[[], NVMeSettings],
               consequence: str = "") -> ChunkStore:
    """Validate the settings and open the store, logging a bad setting as ``NOT loaded``."""
    with loading(tier, consequence):
        return ChunkStore(settings_of())


def announce(adapter: str, tier: str, store: ChunkStore,
             stats: Callable[[], dict[str, float]], details: str = "") -> TierObserver:
    """Start exporting the tier's metrics and log its ``ready`` line."""
    observer = TierObserver.for_store(adapter, store, stats)
    roots = store.describe_roots()
    logger.info("%s ready: %s, budget %.1f GiB, %d chunks found, direct I/O on %d of %d "
                "path(s), %s I/O, %s%s.", tier, ", ".join(str(r.path) for r in roots),
                store.settings.max_size_gb, store.usage()["entries"],
                sum(r.direct_io for r in roots), len(roots), store.io_engine_name,
                describe_deadlines(roots), details)
    return observer


def describe_deadlines(roots: list[RootInfo]) -> str:
    """Which paths' reads have a deadline (``nvme.io_deadline_s``), for the ready line."""
    timed = [r for r in roots if r.deadline_s > 0]
    if not timed:
        return "no read deadline (reads straight into the caller's buffers)"
    return "read deadline " + ", ".join(f"{r.deadline_s:g} s on {r.path} ({r.filesystem})"
                                        for r in timed)


class BackgroundCalls:
    """Calls run in order on one thread of their own: work that may wait on the drive.  One
    ``SimpleQueue.put`` per call (an executor's future costs ~120 opcodes more)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., object], tuple[Any, ...]] | None] \
            = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[..., object], *args: Any) -> None:
        self._calls.put((function, args))

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call[0](*call[1])
            except Exception:
                logger.exception("NVMe tier: %s failed in the background", call[0])

    def close(self) -> None:
        """Run the calls handed over so far, then stop the thread."""
        self._calls.put(None)
        self._thread.join()


class EngineKeyNames:
    """The store's key string and namespace (the model bound to its build) of an in-process
    LMCache key; both in-process hooks use it, so they read each other's files."""

    def __init__(self, store: ChunkStore) -> None:
        self._builds = ModelBuilds(store.settings.model_build, store.namespace_names)

    def __call__(self, key: CacheEngineKey) -> tuple[str, str]:
        return key.to_string(), self._builds.namespace(key.model_name)

    def many(self, keys: Iterable[CacheEngineKey]) -> Iterator[tuple[str, str]]:
        self._builds.recheck_if_due()  # once a batch, not once a key
        bound = self._builds.bound
        return ((key.to_string(), bound(key.model_name)) for key in keys)


def check_token_hashing(tier: str, config: Any) -> TokenHashing:
    """Warn (once per tier and process) when the engine's chunk keys will not survive a
    restart: ``pre_caching_hash_algorithm`` of LMCache ``config`` and the environment."""
    hashing = token_hashing(getattr(config, "pre_caching_hash_algorithm", None))
    if not hashing.stable and tier not in _warned:
        _warned.add(tier)
        logger.warning("%s", hashing.warning(tier))
    return hashing


class RestartMissWatch:
    """Call after every lookup: after a start that found chunks, one warning if none of the
    first ``RESTART_MISS_LOOKUPS`` lookups hit (watching stops at the first hit)."""

    def __init__(self, tier: str, store: ChunkStore, hashing: TokenHashing) -> None:
        self._tier, self._store, self._hashing = tier, store, hashing
        self._window = RESTART_MISS_LOOKUPS
        self.recovered = int(store.counter(Counter.RECOVERED_ENTRIES))
        self._lookups0 = store.counter(Counter.LOOKUPS)
        self._hits0 = store.counter(Counter.HITS)
        self._lock = threading.Lock()
        self.active = self.recovered > 0

    def __call__(self) -> None:
        if not self.active:
            return
        with self._lock:
            if not self.active:
                return
            if self._store.counter(Counter.HITS) > self._hits0:
                self.active = False
                return
            lookups = int(self._store.counter(Counter.LOOKUPS) - self._lookups0)
            if lookups >= self._window:
                self.active = False
                logger.warning("%s", restart_miss_warning(self._tier, self.recovered, lookups,
                                                          self._hashing))
