"""The optional native parts, built when a C compiler is there and skipped (with
setuptools' warning) when not: the I/O engine (lmcache_nvme_backend/io/csrc; without it the
package reads and writes through its Python engine and says so at start,
docs/architecture.md) and the L2 adapter's key strings (lmcache_nvme_backend/adapters/csrc;
without it object_keys.py formats them in Python)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_nvme_backend.io._native",
            sources=[f"lmcache_nvme_backend/io/csrc/{name}.c"
                     for name in ("module", "batches", "workers", "chunkio", "pool", "xxh3")],
            depends=[f"lmcache_nvme_backend/io/csrc/{name}.h"
                     for name in ("batches", "engine", "chunkio", "pool", "xxh3")],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-Wall",
                                "-Wextra"],
            optional=True,
        ),
        Extension(
            "lmcache_nvme_backend.adapters._keys",
            sources=["lmcache_nvme_backend/adapters/csrc/keys.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
            optional=True,
        ),
    ]
)
