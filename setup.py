"""The optional native I/O engine (lmcache_nvme_backend/io/csrc): built when a C compiler
is there, skipped (with setuptools' warning) when not; the package then reads and writes
through its Python engine and says so at start (docs/architecture.md)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lmcache_nvme_backend.io._native",
            sources=[f"lmcache_nvme_backend/io/csrc/{name}.c"
                     for name in ("module", "chunkio", "xxh3")],
            depends=[f"lmcache_nvme_backend/io/csrc/{name}.h" for name in ("chunkio", "xxh3")],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-Wall"],
            optional=True,
        )
    ]
)
