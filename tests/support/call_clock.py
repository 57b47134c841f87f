"""How long a member's public store calls take: the worst of each kind, and the call in
flight (the fault harness, ``support.fault_harness``, reads both while the member runs,
so a call that never returns is seen too)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class CallClock:
    """Times calls by name (``with clock.call("load"): ...``); thread-safe snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.worst: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._in_flight: tuple[str, float] | None = None  # one caller thread

    @contextlib.contextmanager
    def call(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self._in_flight = (name, started)
        try:
            yield
        finally:
            took = time.monotonic() - started
            self._in_flight = None
            with self._lock:
                self.worst[name] = max(took, self.worst.get(name, 0.0))
                self.calls[name] = self.calls.get(name, 0) + 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``worst``: seconds by call, a call still running counted with its age so far;
        ``calls``: how many of each returned."""
        in_flight = self._in_flight
        with self._lock:
            worst = dict(self.worst)
            calls = dict(self.calls)
        if in_flight is not None:
            name, started = in_flight
            worst[name] = max(worst.get(name, 0.0), time.monotonic() - started)
        return {"worst": worst, "calls": {k: float(v) for k, v in calls.items()}}
