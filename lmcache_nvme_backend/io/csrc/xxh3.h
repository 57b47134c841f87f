/* XXH3-64 (seed 0, default secret), written from the xxHash specification
 * (doc/xxhash_spec.md of the xxHash project, "XXH3 Algorithm Description").
 *
 * The chunk format's payload and header checksums are XXH3-64; the Python side hashes with
 * the `xxhash` package, this is the same function for the native I/O engine, which hashes
 * without the GIL.  tests/unit/test_native_io.py checks it against `xxhash` for every length
 * from 0 to a few KiB and for large buffers, with each accumulate loop (scalar, SSE2, AVX2).
 */
#ifndef NVME_XXH3_H
#define NVME_XXH3_H

#include <stddef.h>
#include <stdint.h>

/* The accumulate loops this build can run, best first; xxh3_select picks one. */
enum xxh3_simd { XXH3_SCALAR = 0, XXH3_SSE2 = 1, XXH3_AVX2 = 2 };

/* Chooses the best loop the CPU supports; returns it. */
int xxh3_init(void);
/* Forces a loop (tests); returns 0, or -1 when this CPU or build cannot run it. */
int xxh3_select(int simd);
uint64_t xxh3_64(const void *data, size_t len);

#endif
