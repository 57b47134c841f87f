/* One chunk file read or written without the GIL: the per-chunk loop of the native engine.
 *
 * Mirrors the Python engine (io/posix.py, io/files.py, disk/safe_fs.py) step for step:
 * opens resolve beneath the cache root without following any link (openat2 with
 * RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or an O_NOFOLLOW walk), reads take only regular
 * files (O_NONBLOCK + fstat), the header comes in the same vectored call as the first
 * payload piece, payloads land in place when the buffer is 4 KiB aligned, every payload
 * block is hashed (format v2: xxh3 of each 1 MiB block; v1: xxh3 of the payload), and a
 * write goes to a temp name created O_EXCL | O_NOFOLLOW with an exact mode, then is renamed
 * into place through one descriptor of its shard directory.  The on-disk format is
 * docs/format.md; disk/format.py is its reference implementation.
 */
#ifndef NVME_CHUNKIO_H
#define NVME_CHUNKIO_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "pool.h"

#define CHUNK_HEADER_SIZE 4096
#define CHUNK_ALIGNMENT 4096
#define CHUNK_BLOCK_SIZE (1u << 20)

/* Outcome of one read or write, as the Python side sees it. */
enum chunk_status {
    CHUNK_OK = 0,       /* read: served (header, key, length, metadata, checksum all match);
                           write: published */
    CHUNK_JUDGE = 1,    /* read: the bytes landed but the quick check did not pass: the
                           Python validator judges the header and checksum given back */
    CHUNK_FAILED = 2,   /* an error (errno in `error`) */
    CHUNK_NEW_NAMESPACE = 3, /* write: published, and the namespace's directory was
                                created for it (the caller writes the name file) */
};

/* Shared counters of the engine (atomics, read by native.counters()). */
extern _Atomic uint64_t chunkio_hashed_bytes;
extern _Atomic uint64_t chunkio_hash_sampled_ns;
extern _Atomic uint64_t chunkio_hash_sampled_bytes;
extern _Atomic uint64_t chunkio_overlapped_writes; /* chunks written while hashed (AIO) */
extern _Atomic uint64_t chunkio_recycled_writes;   /* chunks written into a retired file */

/* -- reads -------------------------------------------------------------------------- */

typedef struct chunk_read chunk_read;

/* One I/O of a read: payload bytes [start, start + len) of `req`. */
typedef struct chunk_piece {
    chunk_read *req;
    size_t start;
    size_t len;
    int staged; /* lands in req->staging, copied to the destination after the read */
    struct chunk_piece *next;
} chunk_piece;

struct chunk_read {
    /* what to read (set by the caller) */
    int root_fd;
    const char *rel;
    uint8_t *dest;
    size_t dest_len;
    uint64_t payload_len;
    int direct;
    const uint8_t *key;
    size_t key_len;
    const uint8_t *meta;
    size_t meta_len;
    uint8_t *header; /* CHUNK_HEADER_SIZE bytes, 4 KiB aligned */
    /* plan (chunk_read_plan) */
    size_t in_place;
    size_t staged;
    uint8_t *staging;
    uint64_t *digests;
    uint8_t *hashed;
    size_t blocks;
    atomic_int pieces_left;
    /* outcome */
    atomic_int error;
    uint64_t computed; /* the payload checksum of the bytes that landed */
    int status;
    void *owner; /* the caller's (the batch the request belongs to) */
};

/* Splits `req` into pieces of at most `task_size` bytes; fills `pieces` (room for
 * chunk_read_piece_count) and returns how many, or -errno (allocation; chunk_read_free
 * frees what it made either way). */
size_t chunk_read_piece_count(const chunk_read *req, size_t task_size);
int chunk_read_plan(chunk_read *req, size_t task_size, chunk_piece *pieces);
/* Runs one piece; returns 1 when it was the request's last (the request is then final). */
int chunk_read_run(chunk_piece *piece);
/* Frees what the plan allocated (after the request is final). */
void chunk_read_free(chunk_read *req);

/* -- writes ------------------------------------------------------------------------- */

typedef struct {
    int root_fd;
    const char *dir_rel;
    const char *tmp_name;
    const char *final_name;
    const uint8_t *payload;
    size_t payload_len;
    const uint8_t *key;
    size_t key_len;
    const uint8_t *ns;
    size_t ns_len;
    const uint8_t *meta;
    size_t meta_len;
    int has_gpu_checksum;
    uint64_t gpu_checksum[2];
    int direct;
    mode_t mode;     /* of the chunk file */
    mode_t dir_mode; /* of the directories it creates */
    int fsync_level; /* 0 none, 1 data (fdatasync), 2 full (and the directory) */
    chunk_pool *pool; /* where a file of the same size may be taken from, or NULL */
    /* outcome */
    int status;
    int error;
} chunk_write;

/* Writes, syncs as asked and publishes one chunk file (temp name + rename), creating its
 * shard directories (exactly dir_mode, no link followed) when they are missing. */
void chunk_write_run(chunk_write *job, size_t task_size);

/* Removes the file `rel` beneath the root (its directory reached without following a
 * link; a link at `rel` itself is removed, never its target); 0 or an errno.  With a pool
 * that has room, a regular file is moved into it instead. */
int chunk_unlink(chunk_pool *pool, int root_fd, const char *rel);

/* Builds the 4 KiB header; returns 0, or -EINVAL when the strings do not fit. */
int chunk_encode_header(uint8_t *out, const uint8_t *key, size_t key_len, const uint8_t *ns,
                        size_t ns_len, const uint8_t *meta, size_t meta_len,
                        uint64_t payload_len, uint64_t checksum, uint64_t created_ns,
                        const uint64_t *gpu_checksum);

#endif
