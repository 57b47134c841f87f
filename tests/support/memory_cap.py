"""A cap on the host memory any LMCache engine in the tests may ask for.

LMCache allocates ``max_local_cpu_size`` GB of host memory up front (its
``MixedMemoryAllocator``), and the example YAMLs ask for 20 GB, as a server would: a test
that loads one without overriding ``max_local_cpu_size`` once took 21 GB of this 24 GB
machine.  :func:`install` makes every allocation above :data:`MAX_HOST_GB` fail the test
instead, with the fix in the message.  ``tests/conftest.py`` installs it for the test
process; the child processes that build engines (``support.engine_child``) install it too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: The most host memory (GB, as LMCache counts: 2**30 bytes) one allocator may take in a test.
MAX_HOST_GB = 2.0


class HostMemoryCapExceeded(BaseException):
    """Raised where a test cannot fail through pytest (a child process).  A BaseException, so
    that LMCache's plugin launcher and ``except Exception`` blocks do not swallow it."""


def message(size_bytes: int) -> str:
    return (f"this test asks LMCache for {size_bytes / 2**30:g} GB of host memory, above the "
            f"tests' cap of {MAX_HOST_GB:g} GB (tests/support/memory_cap.py): override "
            "max_local_cpu_size (e.g. support.engines.example_config_overrides, or "
            "load_config(..., {'max_local_cpu_size': 0.5}))")


def install(fail: Callable[[str], Any] | None = None) -> None:
    """Wrap LMCache's host allocator so that a size above the cap calls ``fail(message)``
    (default: raise :class:`HostMemoryCapExceeded`).  Idempotent."""
    from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator

    init = MixedMemoryAllocator.__init__
    if getattr(init, "_memory_cap", False):
        return

    def on_excess(text: str) -> None:
        if fail is not None:
            fail(text)
        raise HostMemoryCapExceeded(text)

    @functools.wraps(init)
    def capped(self: Any, size: int, *args: Any, **kwargs: Any) -> None:
        if size > MAX_HOST_GB * 2**30:
            on_excess(message(size))
        init(self, size, *args, **kwargs)

    capped._memory_cap = True  # type: ignore[attr-defined]
    MixedMemoryAllocator.__init__ = capped  # type: ignore[method-assign]
