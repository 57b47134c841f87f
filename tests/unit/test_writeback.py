"""WriteBackQueue (the bytes handed to the engine, bounded) and ReadPriorityGate (the Python
engine's writers yield to readers)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmcache_nvme_backend.disk.format import TensorMeta
from lmcache_nvme_backend.io.python_engine import ReadPriorityGate
from lmcache_nvme_backend.store.writeback import (
    ChunkWrite,
    WriteBackQueue,
)

CAPACITY = 1000
JOIN_S = 10  # generous bound so a broken implementation fails instead of hanging


class SignallingCondition(threading.Condition):
    """A Condition that announces when a thread starts waiting on it.

    Lets a test release a blocked thread only once it is provably blocked, without sleeps.
    """

    def __init__(self, lock: Any = None, waiting: threading.Event | None = None) -> None:
        super().__init__(lock)
        self.waiting = waiting if waiting is not None else threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


class Worker(threading.Thread):
    """Runs ``fn`` and keeps its result (or exception)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.exc: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # re-raised by finish()
            self.exc = exc

    def finish(self) -> Any:
        self.join(JOIN_S)
        assert not self.is_alive(), "worker still blocked"
        if self.exc is not None:
            raise self.exc
        return self.result


MakeJob = Callable[[str, int], ChunkWrite]


@pytest.fixture
def job() -> MakeJob:
    def make(name: str, nbytes: int) -> ChunkWrite:
        meta = TensorMeta(shapes=((nbytes,),), dtypes=("uint8",), fmt=1, nbytes=nbytes)
        return ChunkWrite(key=name, namespace="ns", meta=meta, payload=memoryview(bytes(nbytes)),
                          release=lambda: None)

    return make


@pytest.fixture
def queue() -> Iterator[WriteBackQueue]:
    q = WriteBackQueue(CAPACITY)
    cond = SignallingCondition(q._lock)
    q._cond = cond  # type: ignore[assignment]
    yield q
    q.close()


def cond_of(obj: WriteBackQueue | ReadPriorityGate) -> SignallingCondition:
    cond = obj._cond
    assert isinstance(cond, SignallingCondition)
    return cond


# -- WriteBackQueue ---------------------------------------------------------------------------


def test_job_nbytes_is_payload_length(job: MakeJob) -> None:
    assert job("a", 123).nbytes == 123


def test_offer_within_capacity(queue: WriteBackQueue, job: MakeJob) -> None:
    assert queue.offer([400], wait_s=0)[0]
    assert queue.offer([600], wait_s=0)[0]  # exactly at capacity
    assert (queue.bytes_held, queue.accepted) == (1000, 2)


def test_offer_beyond_capacity_fails_at_once(queue: WriteBackQueue, job: MakeJob) -> None:
    assert queue.offer([600], wait_s=0)[0]
    assert not queue.offer([401], wait_s=0)[0]
    assert (queue.bytes_held, queue.accepted) == (600, 1)
    assert not cond_of(queue).waiting.is_set()  # it did not block to find out
    assert queue.offer([400], wait_s=0)[0]  # a smaller one still fits


def test_job_larger_than_capacity_is_never_accepted(queue: WriteBackQueue,
                                                    job: MakeJob) -> None:
    assert not queue.offer([CAPACITY + 1], wait_s=0)[0]
    assert (queue.bytes_held, queue.accepted) == (0, 0)


def test_waiting_offer_succeeds_when_space_is_freed(queue: WriteBackQueue,
                                                    job: MakeJob) -> None:
    first = job("a", 800)
    assert queue.offer([first.nbytes], wait_s=0)[0]
    assert queue.bytes_held == 800  # handed to the engine; its bytes held until done
    second = job("b", 500)
    offerer = Worker(lambda: queue.offer([second.nbytes], wait_s=60)[0])
    offerer.start()
    assert cond_of(queue).waiting.wait(JOIN_S)
    assert queue.accepted == 1  # still blocked: nothing accepted yet
    queue.release(first.nbytes, 1)
    assert offerer.finish() is True
    assert (queue.bytes_held, queue.accepted) == (500, 2)


def test_done_and_wait_empty(queue: WriteBackQueue, job: MakeJob) -> None:
    assert queue.wait_empty(0)  # empty from the start
    a, b = job("a", 100), job("b", 200)
    queue.offer([a.nbytes], wait_s=0)
    queue.offer([b.nbytes], wait_s=0)
    assert queue.wait_empty(0) is False  # handed over is not done
    queue.release(a.nbytes, 1)
    assert queue.bytes_held == 200 and queue.wait_empty(0) is False
    queue.release(b.nbytes, 1)
    assert queue.bytes_held == 0 and queue.wait_empty(0) is True


def test_wait_empty_wakes_on_done(queue: WriteBackQueue, job: MakeJob) -> None:
    a = job("a", 100)
    queue.offer([a.nbytes], wait_s=0)
    waiter = Worker(lambda: queue.wait_empty(60))
    waiter.start()
    assert cond_of(queue).waiting.wait(JOIN_S)
    queue.release(a.nbytes, 1)
    assert waiter.finish() is True


def test_offer_after_close_is_refused(queue: WriteBackQueue, job: MakeJob) -> None:
    queue.close()
    assert queue.offer([1], wait_s=0)[0] is False
    assert queue.offer([1], wait_s=60)[0] is False
    assert queue.accepted == 0


def test_close_wakes_blocked_offer(queue: WriteBackQueue, job: MakeJob) -> None:
    queue.offer([CAPACITY], wait_s=0)
    offerer = Worker(lambda: queue.offer([1], wait_s=60)[0])
    offerer.start()
    assert cond_of(queue).waiting.wait(JOIN_S)
    queue.close()
    assert offerer.finish() is False


def test_offer_wait_expires(queue: WriteBackQueue, job: MakeJob) -> None:
    queue.offer([CAPACITY], wait_s=0)
    # returns although nothing freed
    assert queue.offer([1], wait_s=0.01)[0] is False
    assert queue.accepted == 1


# -- ReadPriorityGate -------------------------------------------------------------------------


@pytest.fixture
def gate() -> ReadPriorityGate:
    g = ReadPriorityGate(max_wait_s=60)
    g._cond = SignallingCondition()  # type: ignore[assignment]
    return g


def test_gate_without_readers_does_not_wait(gate: ReadPriorityGate) -> None:
    assert gate.wait_for_readers() is False
    assert not cond_of(gate).waiting.is_set()


def test_gate_reader_exit_is_counted_after_exception(gate: ReadPriorityGate) -> None:
    with pytest.raises(RuntimeError), gate.reading():
        raise RuntimeError("read failed")
    assert gate.wait_for_readers() is False


def test_gate_waits_for_reader(gate: ReadPriorityGate) -> None:
    inside = threading.Event()
    state = {"reader_done": False}

    def reader() -> None:
        with gate.reading():
            inside.set()
            assert cond_of(gate).waiting.wait(JOIN_S)  # the writer is blocked on us
            state["reader_done"] = True

    t = Worker(reader)
    t.start()
    assert inside.wait(JOIN_S)
    assert gate.wait_for_readers() is True
    assert state["reader_done"] is True  # returned only after the reader left
    t.finish()


def test_gate_waits_for_all_readers(gate: ReadPriorityGate) -> None:
    release_second = threading.Event()
    inside = threading.Barrier(3)
    order: list[str] = []

    def reader(name: str, wait_for: threading.Event | None) -> None:
        with gate.reading():
            inside.wait(JOIN_S)
            if wait_for is not None:
                assert wait_for.wait(JOIN_S)
            order.append(name)

    first = Worker(lambda: reader("first", None))
    second = Worker(lambda: reader("second", release_second))
    first.start()
    second.start()
    inside.wait(JOIN_S)
    first.finish()  # one reader gone, one still reading
    waiter = Worker(gate.wait_for_readers)
    waiter.start()
    assert cond_of(gate).waiting.wait(JOIN_S)
    assert waiter.is_alive()
    release_second.set()
    assert waiter.finish() is True
    assert order == ["first", "second"]
    second.finish()


def test_gate_wait_is_bounded() -> None:
    gate = ReadPriorityGate(max_wait_s=0.01)
    with gate.reading():
        # The reader never leaves while the writer waits: the writer still gets through.
        assert gate.wait_for_readers() is True
        assert gate.wait_for_readers() is True
    assert gate.wait_for_readers() is False


def test_handed_over_batch_that_fits_is_held_at_once(queue: WriteBackQueue,
                                                     job: MakeJob) -> None:
    jobs = [job(str(i), 300) for i in range(3)]
    assert queue.offer([j.nbytes for j in jobs], wait_s=0) == [True] * 3
    assert queue.bytes_held == 900
    assert queue.offer([200], wait_s=0) == [False]
    queue.release(sum(j.nbytes for j in jobs), len(jobs))
    assert queue.bytes_held == 0 and queue.wait_empty(0.01)
    queue.close()
    assert queue.offer([1], wait_s=0) == [False]  # closed
