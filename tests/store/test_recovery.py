"""The periodic index snapshot (``ManifestKeeper``): how often it runs, and what it costs."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from support.chunks import put
from support.stores import StoreFactory

from lmcache_nvme_backend.store import recovery
from lmcache_nvme_backend.store.recovery import MANIFEST_CPU_SHARE, next_save_in


def test_a_save_that_costs_more_than_its_share_pushes_the_next_one_back() -> None:
    assert next_save_in(60.0, 0.1) == 60.0
    assert next_save_in(60.0, 1.5) == pytest.approx(1.5 / MANIFEST_CPU_SHARE)
    assert next_save_in(0.5, 0.0) == 0.5


def burn_cpu(seconds: float) -> None:
    """Busy for ``seconds`` of this thread's CPU time (as encoding a big manifest is)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


@pytest.mark.parametrize(("cpu_per_save_s", "most", "least"), [(0.0, None, 8), (0.02, 1, 1)],
                         ids=["cheap", "costly"])
def test_the_snapshot_thread_keeps_its_cpu_under_its_share(
        open_store: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        cpu_per_save_s: float, most: int | None, least: int) -> None:
    """Every ``nvme.manifest_interval_s`` while saving is cheap; a save that costs 20 ms of
    CPU waits 2 s (1 %) before the next, however short the interval."""
    saves: list[int] = []
    lock = threading.Lock()

    def save(index_dir: Path, entries: Sequence[Any], file_mode: int) -> None:
        burn_cpu(cpu_per_save_s)
        with lock:
            saves.append(len(entries))

    monkeypatch.setattr(recovery, "save_manifest", save)
    store = open_store(tmp_path, manifest_interval_s=0.02)
    put(store, "k", 4096)
    store.flush()
    time.sleep(0.5)
    with lock:
        periodic = len(saves)
    assert periodic >= least and (most is None or periodic <= most)
    store.close()
    assert len(saves) == periodic + 1 and saves[-1] == 1  # and once more at close
