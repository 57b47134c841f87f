"""What the three adapters share: opening the tier, saying so, and LMCache key translation.

Each adapter's constructor runs the same chain: settings → ``ChunkStore`` → (on a
bad setting) an error-level ``NOT loaded`` line, because LMCache's plugin
launchers only log constructor exceptions where nobody looks → the metrics
observer → one ``ready`` line that says what the tier found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

from ..config import NVMeConfigError, NVMeSettings
from ..metrics import TierObserver
from ..store import ChunkStore

# The package logger carries LMCache's formatting; every adapter logs through it.
logger = init_logger("lmcache_nvme_backend")


@contextmanager
def loading(tier: str, consequence: str = "") -> Iterator[None]:
    """Log ``<tier> NOT loaded: <problem>`` at error level when the settings are wrong."""
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
                "path(s)%s.", tier, ", ".join(str(r.path) for r in roots),
                store.settings.max_size_gb, store.usage()["entries"],
                sum(r.direct_io for r in roots), len(roots), details)
    return observer


def key_and_namespace(key: CacheEngineKey) -> tuple[str, str]:
    """The store's key string and namespace (the model) of an in-process LMCache key.

    ``NVMeBackend`` and ``NVMeConnector`` use the same translation, so the two
    hooks read each other's files.
    """
    return key.to_string(), key.model_name


def keys_and_namespaces(keys: Iterable[CacheEngineKey]) -> Iterator[tuple[str, str]]:
    return (key_and_namespace(key) for key in keys)
