/* Removed chunk files kept for reuse by the native engine (nvme.recycle_mb). */
#ifndef NVME_POOL_H
#define NVME_POOL_H

#include <stdint.h>
#include <sys/types.h>

/* Chunk files removed from the cache but kept, renamed to a temp name of this process in
 * their shard directory, for the next write of the same size to overwrite in place: no
 * inode or blocks freed and allocated again, no fallocate, no extent conversion.  Bounded
 * by `max_bytes`; NULL (or 0 bytes) keeps none.  Thread-safe. */
typedef struct chunk_pool chunk_pool;

/* A pool whose files are named <chunk name><suffix>; NULL when out of memory. */
chunk_pool *chunk_pool_new(const char *suffix, uint64_t max_bytes);
/* Removes every file in the pool and takes no more. */
void chunk_pool_drain(chunk_pool *pool);
/* chunk_pool_drain, and frees it. */
void chunk_pool_free(chunk_pool *pool);
/* Bytes in the pool's files now. */
uint64_t chunk_pool_bytes(chunk_pool *pool);

/* A file in the pool: where it is and its size. */
typedef struct {
    int root_fd;
    char *dir_rel; /* its shard directory beneath the root */
    char *name;    /* its name there: the chunk's name and the pool's suffix */
    off_t size;
} pooled_file;

/* Frees a pooled_file's strings. */
void pooled_file_clear(pooled_file *f);
/* Moves `name` of `dir_fd` (directory `dir_rel` beneath `root_fd`) into the pool: 0 when it
 * went there, an errno when it could not be touched (ENOENT: gone), -1 when the pool does
 * not take it (full, not a lone regular file, a file of that name already retired, or a
 * filesystem without RENAME_NOREPLACE): the caller removes it. */
int chunk_pool_put(chunk_pool *pool, int root_fd, const char *dir_rel, int dir_fd,
                   const char *name);
/* Takes the file last put beneath `root_fd` whose size is `size` out of the pool into
 * *out (the caller clears it); 1 when there was one. */
int chunk_pool_take(chunk_pool *pool, int root_fd, off_t size, pooled_file *out);

#endif
