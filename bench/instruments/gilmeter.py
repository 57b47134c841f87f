"""Exact GIL-held time and GIL acquisitions of this process (CPython 3.11 or 3.12, Linux).

``build()`` compiles ``gilmeter.c`` (a few lines wrapping ``pthread_mutex_unlock``) with
the system C compiler; a process started with ``LD_PRELOAD=<that library>`` calls
``start()`` once, then ``read()`` as often as it likes::

    held_s, acquisitions, held_cpu_s = gilmeter.read()

``start()`` finds CPython's GIL inside ``_PyRuntime``: with the GIL held, the GIL state
is the only place that holds the switch interval (microseconds), then the current thread
state (``last_holder``) and ``locked == 1`` at the offsets of ``struct
_gil_runtime_state`` (the same in 3.11 and 3.12); the mutex follows the condition
variable.  In 3.11 the state is near the start of ``_PyRuntime``; in 3.12 it is the main
interpreter's ``_gil``, further in, so the scan runs to the end of the memory mapping that
holds ``_PyRuntime`` (never past it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "gilmeter.c"
# struct _gil_runtime_state (CPython 3.11, 64-bit): interval, last_holder, locked,
# switch_number, cond (pthread_cond_t: 48 bytes with glibc), mutex
_LAST_HOLDER, _LOCKED, _COND = 8, 16, 32
_COND_SIZE = 48
_SCAN_LIMIT = 64 << 20
SUPPORTED = ((3, 11), (3, 12))


def build(out_dir: Path) -> Path:
    """Compile the meter into ``out_dir``; returns the library's path."""
    if sys.version_info[:2] not in SUPPORTED or not sys.platform.startswith("linux"):
        raise RuntimeError("the GIL meter knows CPython 3.11 and 3.12 on Linux only")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) to build the GIL meter")
    lib = out_dir / "gilmeter.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(lib), str(SOURCE), "-ldl"],
                   check=True)
    return lib


_lib: ctypes.CDLL | None = None


def _mapped_bytes_from(address: int) -> int:
    """How many bytes from ``address`` to the end of its mapping (``/proc/self/maps``),
    at most ``_SCAN_LIMIT``: reading past a mapping's end would crash the process."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split(None, 1)[0].split("-"))
            if start <= address < end:
                return min(end - address, _SCAN_LIMIT)
    raise RuntimeError(f"_PyRuntime at {address:#x} is in no mapping of /proc/self/maps")


def start() -> None:
    """Find the GIL and hand it to the preloaded meter (call with LD_PRELOAD set)."""
    global _lib
    lib = ctypes.PyDLL(None)  # calls keep the GIL: the meter sees the caller holding it
    if not hasattr(lib, "gilmeter_register"):
        raise RuntimeError("gilmeter.so is not preloaded (LD_PRELOAD)")
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    ctypes.pythonapi.PyThreadState_Get.restype = ctypes.c_void_p
    tstate = ctypes.pythonapi.PyThreadState_Get()
    interval = round(sys.getswitchinterval() * 1e6)
    scan = _mapped_bytes_from(runtime)
    raw = ctypes.string_at(runtime, scan)
    for offset in range(0, scan - _COND - _COND_SIZE, 8):
        if int.from_bytes(raw[offset:offset + 8], "little") != interval:
            continue
        holder = int.from_bytes(raw[offset + _LAST_HOLDER:offset + _LAST_HOLDER + 8], "little")
        locked = int.from_bytes(raw[offset + _LOCKED:offset + _LOCKED + 4], "little")
        if holder == tstate and locked == 1:
            gil = runtime + offset
            lib.gilmeter_register(ctypes.c_void_p(gil + _COND + _COND_SIZE),
                                  ctypes.c_void_p(gil + _LOCKED))
            _lib = lib
            return
    raise RuntimeError("could not find the GIL state in _PyRuntime")


def read_thread(native_id: int) -> tuple[float, int, float]:
    """``read()`` of one thread (``Thread.native_id``)."""
    if _lib is None:
        raise RuntimeError("gilmeter.start() was not called")
    out = (ctypes.c_uint64 * 3)()
    _lib.gilmeter_read_thread(ctypes.c_long(native_id), out)
    return out[0] / 1e9, int(out[1]), out[2] / 1e9


def read() -> tuple[float, int, float]:
    """(GIL-held seconds, GIL acquisitions, CPU seconds of the holders while they held it)
    of the whole process since ``start()``."""
    if _lib is None:
        raise RuntimeError("gilmeter.start() was not called")
    out = (ctypes.c_uint64 * 3)()
    _lib.gilmeter_read(out)
    return out[0] / 1e9, int(out[1]), out[2] / 1e9
