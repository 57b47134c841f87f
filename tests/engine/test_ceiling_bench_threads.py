"""bench/instruments/bench_ceiling.py's CPU by thread: busy threads show under their own
names, a thread Python does not know under its OS name, and the per-thread table reads from
window results; nothing about speed."""

from __future__ import annotations

import _thread
import importlib
import threading
import time
from types import ModuleType
from typing import Any

import pytest
from support.paths import BENCH_DIR

BUSY_S = 0.3


@pytest.fixture
def ceiling(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR / "instruments"))  # a script: not a package
    return importlib.import_module("bench_ceiling")


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_busy_threads_are_charged_by_name(ceiling: ModuleType) -> None:
    stop, unknown_done = threading.Event(), threading.Event()
    main_id = threading.get_native_id()

    def unknown() -> None:  # started by _thread: threading never hears of it
        spin(stop)
        unknown_done.set()

    workers = [threading.Thread(target=spin, args=(stop,), name=f"burner-{i}") for i in (1, 2)]
    before = ceiling.cpu_by_thread(main_id)
    for worker in workers:
        worker.start()
    _thread.start_new_thread(unknown, ())
    time.sleep(BUSY_S)
    after = ceiling.cpu_by_thread(main_id)
    stop.set()
    for worker in workers:
        worker.join()
    assert unknown_done.wait(10)

    ran = {name: after[name] - before.get(name, 0.0) for name in after}
    # two spinning threads and one more share the GIL: together about BUSY_S of CPU
    assert ran["burner"] + ran[next(n for n in ran if n.endswith("(native)"))] > BUSY_S / 3
    assert ran["burner"] > 0.02
    assert not any(name.startswith("burner-") for name in ran)  # numbers stripped
    assert ran["MainThread"] < ran["burner"]  # asleep meanwhile


def test_thread_table_gives_each_systems_medians(ceiling: ModuleType) -> None:
    def window(system: str, main: float, workers: float, hashed: float | None) -> dict[str, Any]:
        return {"size_mb": 2, "op": "store", "system": system, "hash_cpu_s_per_gib": hashed,
                "cpu_s_per_gib_by_thread": {"MainThread": main, "nvme-native-wr": workers,
                                            "idle": 0.0001}}

    results = [window("nvme", 0.02, 0.10, 0.05), window("nvme", 0.04, 0.12, 0.07),
               window("nvme", 0.03, 0.14, 0.06), window("fs_native", 0.01, 0.08, None)]
    lines = ceiling.thread_cpu_table(results, ["nvme", "fs_native"], [2], ["store"])
    assert lines[2] == ("| 2 MiB | store | nvme | nvme-native-wr 0.1200, MainThread 0.0300 "
                        "| 0.0600 |")
    assert lines[3] == ("| 2 MiB | store | fs_native | nvme-native-wr 0.0800, MainThread "
                        "0.0100 | - |")
