/* One chunk file read or written without the GIL; see chunkio.h. */
#define _GNU_SOURCE
#include "chunkio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "xxh3.h"

/* disk/format.py: "<8sHHIQQQHHH" then key, namespace, metadata; checksum at 4088 */
#define FIXED_SIZE 46
#define OFF_VERSION 8
#define OFF_HEADER_SIZE 10
#define OFF_FLAGS 12
#define OFF_PAYLOAD_LEN 16
#define OFF_CHECKSUM 24
#define OFF_CREATED 32
#define OFF_KEY_LEN 40
#define OFF_NS_LEN 42
#define OFF_META_LEN 44
#define HEADER_CHECKSUM_OFFSET (CHUNK_HEADER_SIZE - 8)
#define GPU_CHECKSUM_OFFSET (HEADER_CHECKSUM_OFFSET - 16)
#define VARIABLE_SPACE (HEADER_CHECKSUM_OFFSET - FIXED_SIZE)
#define FLAG_GPU_CHECKSUM 0x1u
#define FORMAT_VERSION 2
#define MAX_PAYLOAD_BYTES (1ull << 36)
#define MAX_IO_CALL (0x7FFFF000u / CHUNK_ALIGNMENT * CHUNK_ALIGNMENT)
#define MAX_IOV 8

static const uint8_t MAGIC[8] = {'L', 'M', 'C', 'N', 'V', 'M', 'E', 0};
static const uint8_t ZEROS[CHUNK_ALIGNMENT];

_Atomic uint64_t chunkio_hashed_bytes;
_Atomic uint64_t chunkio_hash_sampled_ns;
_Atomic uint64_t chunkio_hash_sampled_bytes;
_Atomic uint64_t chunkio_overlapped_writes;
_Atomic uint64_t chunkio_recycled_writes;

static size_t chunk_padded(size_t n) { return (n + CHUNK_ALIGNMENT - 1) / CHUNK_ALIGNMENT * CHUNK_ALIGNMENT; }

static uint64_t rd_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static unsigned rd_u16(const uint8_t *p) { return (unsigned)p[0] | ((unsigned)p[1] << 8); }

static void wr_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static void wr_u16(uint8_t *p, unsigned v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The checksum's CPU time is sampled: one hash call in HASH_SAMPLE_EVERY per thread reads
 * the thread CPU clock around itself (a system call each way: no vDSO for thread clocks),
 * every call counts its bytes, and the share is the sampled ns per byte times all bytes. */
#define HASH_SAMPLE_EVERY 8
static _Thread_local unsigned hash_calls;

static uint64_t hash_timer_start(void) {
    return hash_calls++ % HASH_SAMPLE_EVERY == 0 ? thread_cpu_ns() : 0;
}

static void hash_timer_stop(uint64_t started, uint64_t bytes) {
    atomic_fetch_add_explicit(&chunkio_hashed_bytes, bytes, memory_order_relaxed);
    if (started == 0) return;
    atomic_fetch_add_explicit(&chunkio_hash_sampled_ns, thread_cpu_ns() - started,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&chunkio_hash_sampled_bytes, bytes, memory_order_relaxed);
}

static int is_aligned(const void *p) { return ((uintptr_t)p % CHUNK_ALIGNMENT) == 0; }

/* -- opening beneath a root (disk/safe_fs.py) ------------------------------------------ */

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_NO_SYMLINKS 0x04
#define RESOLVE_BENEATH 0x08

struct open_how_v0 {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

static atomic_int openat2_unavailable;

static int walk_open(int root_fd, const char *rel, int flags, mode_t mode) {
    char name[PATH_MAX];
    if (snprintf(name, sizeof(name), "%s", rel) >= (int)sizeof(name)) return -ENAMETOOLONG;
    int fd = root_fd;
    char *part = name;
    for (;;) {
        char *slash = strchr(part, '/');
        if (slash == NULL) break;
        *slash = 0;
        int next = openat(fd, part, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int err = errno;
        if (fd != root_fd) close(fd);
        if (next < 0) return -err;
        fd = next;
        part = slash + 1;
    }
    int out = openat(fd, part, flags | O_NOFOLLOW | O_CLOEXEC, mode);
    int err = errno;
    if (fd != root_fd) close(fd);
    return out < 0 ? -err : out;
}

/* open(root_fd / rel, flags, mode) without following a link in any component;
 * returns a descriptor or -errno. */
static int chunk_open_beneath(int root_fd, const char *rel, int flags, mode_t mode) {
    if (!atomic_load_explicit(&openat2_unavailable, memory_order_relaxed)) {
        struct open_how_v0 how = {(uint64_t)(flags | O_CLOEXEC),
                                  (flags & O_CREAT) ? (uint64_t)mode : 0,
                                  RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
        long fd = syscall(SYS_openat2, root_fd, rel, &how, sizeof(how));
        if (fd >= 0) return (int)fd;
        if (errno != ENOSYS && errno != EPERM) return -errno;
        atomic_store(&openat2_unavailable, 1); /* an old kernel, or a seccomp filter */
    }
    return walk_open(root_fd, rel, flags, mode);
}

/* -- hashing ------------------------------------------------------------------------------ */

/* The version of a header of this format, or 0. */
static unsigned header_version(const uint8_t *h) {
    return memcmp(h, MAGIC, 8) == 0 ? rd_u16(h + OFF_VERSION) : 0;
}

/* Hashes the format's checksum blocks of the payload that lie wholly in [begin, end). */
static void hash_blocks(const uint8_t *payload, uint64_t payload_len, size_t begin, size_t end,
                        uint64_t *digests, uint8_t *hashed) {
    uint64_t started = hash_timer_start();
    uint64_t bytes = 0;
    if (end > payload_len) end = (size_t)payload_len;
    for (size_t b = (begin + CHUNK_BLOCK_SIZE - 1) / CHUNK_BLOCK_SIZE;; b++) {
        size_t lo = b * (size_t)CHUNK_BLOCK_SIZE;
        size_t hi = lo + CHUNK_BLOCK_SIZE < payload_len ? lo + CHUNK_BLOCK_SIZE
                                                       : (size_t)payload_len;
        if (lo >= end || hi > end) break;
        digests[b] = xxh3_64(payload + lo, hi - lo);
        if (hashed) hashed[b] = 1;
        bytes += hi - lo;
    }
    if (bytes) hash_timer_stop(started, bytes);
}

static uint64_t combine_digests(const uint64_t *digests, size_t blocks) {
    return xxh3_64(digests, blocks * 8);
}

/* -- the header ----------------------------------------------------------------------- */

int chunk_encode_header(uint8_t *out, const uint8_t *key, size_t key_len, const uint8_t *ns,
                        size_t ns_len, const uint8_t *meta, size_t meta_len,
                        uint64_t payload_len, uint64_t checksum, uint64_t created_ns,
                        const uint64_t *gpu_checksum) {
    if (key_len + ns_len + meta_len > VARIABLE_SPACE || payload_len > MAX_PAYLOAD_BYTES)
        return -EINVAL;
    size_t strings_end = FIXED_SIZE + key_len + ns_len + meta_len;
    if (strings_end > GPU_CHECKSUM_OFFSET) gpu_checksum = NULL; /* no room: left out */
    memset(out, 0, CHUNK_HEADER_SIZE);
    memcpy(out, MAGIC, 8);
    wr_u16(out + OFF_VERSION, FORMAT_VERSION);
    wr_u16(out + OFF_HEADER_SIZE, CHUNK_HEADER_SIZE);
    uint32_t flags = gpu_checksum ? FLAG_GPU_CHECKSUM : 0;
    memcpy(out + OFF_FLAGS, &flags, 4);
    wr_u64(out + OFF_PAYLOAD_LEN, payload_len);
    wr_u64(out + OFF_CHECKSUM, checksum);
    wr_u64(out + OFF_CREATED, created_ns);
    wr_u16(out + OFF_KEY_LEN, (unsigned)key_len);
    wr_u16(out + OFF_NS_LEN, (unsigned)ns_len);
    wr_u16(out + OFF_META_LEN, (unsigned)meta_len);
    memcpy(out + FIXED_SIZE, key, key_len);
    memcpy(out + FIXED_SIZE + key_len, ns, ns_len);
    memcpy(out + FIXED_SIZE + key_len + ns_len, meta, meta_len);
    if (gpu_checksum) {
        wr_u64(out + GPU_CHECKSUM_OFFSET, gpu_checksum[0]);
        wr_u64(out + GPU_CHECKSUM_OFFSET + 8, gpu_checksum[1]);
    }
    wr_u64(out + HEADER_CHECKSUM_OFFSET, xxh3_64(out, HEADER_CHECKSUM_OFFSET));
    return 0;
}

/* UTF-8 as Python decodes it with "surrogatepass" (encoded surrogates allowed). */
static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t more = (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : 0;
        if (more == 0) return 0; /* a continuation byte, or no lead byte of UTF-8 */
        uint32_t cp = c & (0x3F >> more); /* the lead byte's bits of the code point */
        for (size_t k = 1; k <= more; k++) {
            if (i + k >= n || (s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((more == 1 && cp < 0x80) || (more == 2 && cp < 0x800) ||
            (more == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
            return 0;
        i += more + 1;
    }
    return 1;
}

/* Whether the header is ours, intact, and names exactly what the reader expects, and the
 * payload that landed matches its checksum: then disk/validate.judge_chunk would serve it
 * too.  Anything else goes to that validator, which names the defect. */
static int quick_verdict(const chunk_read *req) {
    const uint8_t *h = req->header;
    unsigned version = header_version(h);
    if ((version != 1 && version != 2) || rd_u16(h + OFF_HEADER_SIZE) != CHUNK_HEADER_SIZE)
        return 0;
    if (xxh3_64(h, HEADER_CHECKSUM_OFFSET) != rd_u64(h + HEADER_CHECKSUM_OFFSET)) return 0;
    size_t key_len = rd_u16(h + OFF_KEY_LEN), ns_len = rd_u16(h + OFF_NS_LEN),
           meta_len = rd_u16(h + OFF_META_LEN);
    if (key_len + ns_len + meta_len > VARIABLE_SPACE) return 0;
    uint32_t flags;
    memcpy(&flags, h + OFF_FLAGS, 4);
    if ((flags & FLAG_GPU_CHECKSUM) && FIXED_SIZE + key_len + ns_len + meta_len > GPU_CHECKSUM_OFFSET)
        return 0;
    if (rd_u64(h + OFF_PAYLOAD_LEN) != req->payload_len) return 0;
    if (key_len != req->key_len || memcmp(h + FIXED_SIZE, req->key, key_len) != 0) return 0;
    if (!utf8_ok(h + FIXED_SIZE + key_len, ns_len)) return 0;
    if (meta_len != req->meta_len ||
        memcmp(h + FIXED_SIZE + key_len + ns_len, req->meta, meta_len) != 0)
        return 0;
    return rd_u64(h + OFF_CHECKSUM) == req->computed;
}

/* -- reads -------------------------------------------------------------------------------- */

static void split_for_direct(const chunk_read *req, size_t *in_place, size_t *staged) {
    size_t len = (size_t)req->payload_len;
    if (!req->direct) {
        *in_place = len;
        *staged = 0;
    } else if (!is_aligned(req->dest)) {
        *in_place = 0;
        *staged = len;
    } else if (req->dest_len >= chunk_padded(len)) {
        *in_place = chunk_padded(len);
        *staged = 0;
    } else {
        *in_place = len / CHUNK_ALIGNMENT * CHUNK_ALIGNMENT;
        *staged = len - *in_place;
    }
}

size_t chunk_read_piece_count(const chunk_read *req, size_t task_size) {
    size_t in_place, staged;
    split_for_direct(req, &in_place, &staged);
    size_t n = (in_place + task_size - 1) / task_size + (staged ? 1 : 0);
    return n ? n : 1;
}

int chunk_read_plan(chunk_read *req, size_t task_size, chunk_piece *pieces) {
    size_t n = 0;
    split_for_direct(req, &req->in_place, &req->staged);
    req->blocks = ((size_t)req->payload_len + CHUNK_BLOCK_SIZE - 1) / CHUNK_BLOCK_SIZE;
    req->staging = NULL;
    req->digests = calloc(req->blocks ? req->blocks : 1, sizeof(uint64_t) + 1);
    if (req->digests == NULL) return -ENOMEM;
    req->hashed = (uint8_t *)(req->digests + (req->blocks ? req->blocks : 1));
    size_t room = req->direct ? chunk_padded(req->staged) : req->staged;
    if (req->staged && posix_memalign((void **)&req->staging, CHUNK_ALIGNMENT, room) != 0)
        return -ENOMEM; /* chunk_read_free frees the digests */
    for (size_t off = 0; off < req->in_place; off += task_size) {
        size_t len = req->in_place - off < task_size ? req->in_place - off : task_size;
        pieces[n++] = (chunk_piece){req, off, len, 0, NULL};
    }
    if (req->staged) pieces[n++] = (chunk_piece){req, req->in_place, req->staged, 1, NULL};
    if (n == 0) pieces[n++] = (chunk_piece){req, 0, 0, 0, NULL}; /* the header alone */
    atomic_store(&req->pieces_left, (int)n);
    atomic_store(&req->error, 0);
    req->status = CHUNK_FAILED;
    return (int)n;
}

/* Moves past the first `n` bytes of the vector (those moved). */
static void iov_skip(struct iovec **iov, int *count, size_t n) {
    while (*count > 0 && n >= (*iov)->iov_len) {
        n -= (*iov)->iov_len;
        (*iov)++;
        (*count)--;
    }
    if (*count > 0) {
        (*iov)->iov_base = (uint8_t *)(*iov)->iov_base + n;
        (*iov)->iov_len -= n;
    }
}

/* Reads (or, `writing`, writes) exactly the iovec's bytes at `offset`; 0, or an errno
 * (ENODATA: a read met the end of the file). */
static int pio_full(int fd, struct iovec *iov, int count, off_t offset, int writing) {
    while (count > 0) {
        ssize_t n = writing ? pwritev(fd, iov, count, offset) : preadv(fd, iov, count, offset);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return errno;
        if (n == 0 && !writing) return ENODATA;
        offset += n;
        iov_skip(&iov, &count, (size_t)n);
    }
    return 0;
}

/* Reads one piece into place, the header with the first: 0 or an errno. */
static int transfer(chunk_piece *piece) {
    chunk_read *req = piece->req;
    int fd = chunk_open_beneath(req->root_fd, req->rel,
                                O_RDONLY | O_NOFOLLOW | O_NONBLOCK | (req->direct ? O_DIRECT : 0),
                                0);
    if (fd < 0) return -fd;
    size_t need = CHUNK_HEADER_SIZE + (req->direct ? chunk_padded((size_t)req->payload_len)
                                                   : (size_t)req->payload_len);
    uint8_t *target = piece->staged ? req->staging : req->dest + piece->start;
    size_t len = piece->staged && req->direct ? chunk_padded(piece->len) : piece->len;
    struct iovec iov[2];
    int count = 0, err = 0;
    off_t at = CHUNK_HEADER_SIZE + (off_t)piece->start;
    if (piece->start == 0) {
        iov[count++] = (struct iovec){req->header, CHUNK_HEADER_SIZE};
        at = 0;
    }
    if (len) iov[count++] = (struct iovec){target, len};
    struct stat st;
    if (fstat(fd, &st) != 0)
        err = errno;
    else if (!S_ISREG(st.st_mode))
        err = EINVAL; /* not a regular file: never read (the Python path names what it is) */
    else if (piece->start == 0 && (size_t)st.st_size < need)
        err = ENODATA;
    else if (count)
        err = pio_full(fd, iov, count, at, 0);
    if (!err && piece->staged) memcpy(req->dest + piece->start, req->staging, piece->len);
    close(fd);
    return err;
}

static void finalize(chunk_read *req) {
    int err = atomic_load(&req->error);
    if (err) {
        req->status = CHUNK_FAILED;
        return;
    }
    if (header_version(req->header) == 1) {
        uint64_t started = hash_timer_start();
        req->computed = xxh3_64(req->dest, (size_t)req->payload_len);
        hash_timer_stop(started, req->payload_len);
    } else {
        for (size_t b = 0; b < req->blocks; b++)
            if (!req->hashed[b])
                hash_blocks(req->dest, req->payload_len, b * (size_t)CHUNK_BLOCK_SIZE,
                            (b + 1) * (size_t)CHUNK_BLOCK_SIZE, req->digests, req->hashed);
        req->computed = combine_digests(req->digests, req->blocks);
    }
    req->status = quick_verdict(req) ? CHUNK_OK : CHUNK_JUDGE;
}

int chunk_read_run(chunk_piece *piece) {
    chunk_read *req = piece->req;
    if (!atomic_load(&req->error)) {
        int err = transfer(piece), none = 0;
        if (err) {
            atomic_compare_exchange_strong(&req->error, &none, err);
        } else {
            /* a version 1 file is checked over the whole payload at the end */
            if (piece->start != 0 || header_version(req->header) != 1)
                hash_blocks(req->dest, req->payload_len, piece->start,
                            piece->start + piece->len, req->digests, req->hashed);
        }
    }
    if (atomic_fetch_sub(&req->pieces_left, 1) != 1) return 0;
    finalize(req);
    return 1;
}

void chunk_read_free(chunk_read *req) {
    free(req->staging);
    free(req->digests);
}

/* -- writes -------------------------------------------------------------------------------- */

/* Per-thread aligned buffers: the header, and a staging area for unaligned payloads. */
static pthread_key_t buffers_key;
static pthread_once_t buffers_once = PTHREAD_ONCE_INIT;

typedef struct {
    uint8_t header[CHUNK_HEADER_SIZE] __attribute__((aligned(CHUNK_ALIGNMENT)));
    uint8_t *staging;
    size_t staging_size;
    aio_context_t aio; /* for overlapped writes; aio_state 0 untried, 1 set up, -1 none */
    int aio_state;
} thread_buffers;

static void free_buffers(void *p) {
    thread_buffers *b = p;
    if (b->aio_state == 1) syscall(SYS_io_destroy, b->aio);
    free(b->staging);
    free(b);
}

static void make_key(void) { pthread_key_create(&buffers_key, free_buffers); }

static thread_buffers *my_buffers(size_t staging) {
    pthread_once(&buffers_once, make_key);
    thread_buffers *b = pthread_getspecific(buffers_key);
    if (b == NULL) {
        if (posix_memalign((void **)&b, CHUNK_ALIGNMENT, sizeof(*b)) != 0) return NULL;
        memset(b, 0, sizeof(*b));
        pthread_setspecific(buffers_key, b);
    }
    if (staging > b->staging_size) {
        free(b->staging);
        b->staging = NULL;
        b->staging_size = 0;
        if (posix_memalign((void **)&b->staging, CHUNK_ALIGNMENT, staging) != 0) return NULL;
        b->staging_size = staging;
    }
    return b;
}

/* payload[0, len) at payload offset `offset` (a 4 KiB multiple), zero padded to 4 KiB at
 * its end; with `header`, the header first in the same call (file offset 0).  O_DIRECT:
 * an aligned payload goes out in place in task-size pieces, an unaligned one (or the
 * sub-4 KiB tail of an aligned one) through this thread's staging buffer. */
static int write_payload(int fd, const uint8_t *header, const uint8_t *data, size_t len,
                         size_t offset, int direct, size_t task_size) {
    off_t at = header ? 0 : (off_t)(CHUNK_HEADER_SIZE + offset);
    struct iovec iov[3];
    int count = 0;
    if (header) iov[count++] = (struct iovec){(void *)header, CHUNK_HEADER_SIZE};
    if (!direct) {
        size_t pad = chunk_padded(len) - len;
        if (len) iov[count++] = (struct iovec){(void *)data, len};
        if (pad) iov[count++] = (struct iovec){(void *)ZEROS, pad};
        return count ? pio_full(fd, iov, count, at, 1) : 0;
    }
    size_t bulk = is_aligned(data) ? len / CHUNK_ALIGNMENT * CHUNK_ALIGNMENT : 0;
    size_t done = 0;
    while (done < len) {
        size_t n, out;
        if (done < bulk) {
            n = out = bulk - done < task_size ? bulk - done : task_size;
            iov[count++] = (struct iovec){(void *)(data + done), n};
        } else {
            n = len - done < task_size ? len - done : task_size;
            out = chunk_padded(n);
            thread_buffers *b = my_buffers(out);
            if (b == NULL) return ENOMEM;
            memcpy(b->staging, data + done, n);
            memset(b->staging + n, 0, out - n);
            iov[count++] = (struct iovec){b->staging, out};
        }
        int err = pio_full(fd, iov, count, at, 1);
        if (err) return err;
        at += (off_t)out + (count == 2 ? CHUNK_HEADER_SIZE : 0);
        done += n;
        count = 0;
    }
    return count ? pio_full(fd, iov, count, at, 1) : 0; /* an empty payload: the header */
}

/* The job's header, into `out`, from its payload's block digests: 0 or EINVAL. */
static int encode_job_header(const chunk_write *job, uint8_t *out, const uint64_t *digests,
                             size_t blocks, uint64_t created) {
    return chunk_encode_header(out, job->key, job->key_len, job->ns, job->ns_len, job->meta,
                               job->meta_len, job->payload_len,
                               combine_digests(digests, blocks), created,
                               job->has_gpu_checksum ? job->gpu_checksum : NULL) != 0
               ? EINVAL
               : 0;
}

/* -- writing a chunk ------------------------------------------------------------------------ */

/* I/Os one chunk's overlapped write keeps in flight at most: its blocks go in this many
 * groups or fewer.  Each group is one more system call and one more extent conversion when
 * it completes (16 groups cost a 16 MiB store 1.36x fs_native's CPU outside the checksum,
 * 4 groups 1.11x); 4 already hide three quarters of a large chunk's hash. */
#define WRITE_GROUPS 4

/* This thread's AIO context, set up on first use; 0 where the kernel gives none (a seccomp
 * filter, fs.aio-max-nr reached): its chunks are then written in one synchronous call. */
static aio_context_t my_aio(thread_buffers *b) {
    if (b->aio_state == 0) b->aio_state = syscall(SYS_io_setup, WRITE_GROUPS, &b->aio) == 0 ? 1 : -1;
    return b->aio_state == 1 ? b->aio : 0;
}

/* Waits for `in_flight` submitted groups (their vectors in `vecs`) and writes
 * synchronously what the kernel wrote short.  Returns the first error, or 0.  It asks for
 * every group at once: woken per group, a writer slept and woke twice as often per chunk
 * (5.6 voluntary context switches per 16 MiB chunk against 2.8). */
static int reap_groups(thread_buffers *b, int fd, struct iovec (*vecs)[2], int in_flight) {
    struct io_event events[WRITE_GROUPS];
    int err = 0;
    while (in_flight > 0) {
        long got = syscall(SYS_io_getevents, b->aio, in_flight, in_flight, events, NULL);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) { /* never for a valid context; destroying it waits for its I/O */
            err = errno;
            syscall(SYS_io_destroy, b->aio);
            b->aio_state = -1;
            return err;
        }
        for (long e = 0; e < got; e++) {
            struct iocb *cb = (struct iocb *)(uintptr_t)events[e].obj;
            struct iovec *iov = vecs[cb->aio_data];
            int count = iov[1].iov_len ? 2 : 1;
            size_t want = iov[0].iov_len + iov[1].iov_len;
            if (events[e].res < 0) {
                if (!err) err = (int)-events[e].res;
            } else if ((size_t)events[e].res < want && !err) {
                iov_skip(&iov, &count, (size_t)events[e].res);
                err = pio_full(fd, iov, count, (off_t)cb->aio_offset + events[e].res, 1);
            }
        }
        in_flight -= (int)got;
    }
    return err;
}

/* An aligned O_DIRECT payload of several blocks, written while it is hashed, so that the
 * drive is busy while the CPU hashes: the blocks in up to WRITE_GROUPS groups, last group
 * first, each submitted (Linux AIO) as soon as its digests are known, and the first group
 * with the header in one I/O once they all are.  The file's blocks are allocated first
 * (fallocate; its size alone where the filesystem cannot): ext4 waits at submission for an
 * O_DIRECT write that extends a file, which would serialise the groups again, and groups
 * written last first into a hole could be placed last first (a recycled file, `allocated`,
 * has its blocks already).  A group the kernel does not take is written synchronously.
 * Returns an errno, 0, or -1 when it wrote nothing (no AIO here): the caller writes
 * synchronously. */
static int write_overlapped(const chunk_write *job, int fd, int allocated, thread_buffers *b,
                            uint64_t *digests, size_t blocks, uint64_t created) {
    aio_context_t ctx = my_aio(b);
    if (ctx == 0) return -1;
    off_t size = (off_t)(CHUNK_HEADER_SIZE + job->payload_len);
    if (!allocated && fallocate(fd, 0, 0, size) != 0 &&
        (errno != EOPNOTSUPP || ftruncate(fd, size) != 0))
        return errno; /* no room (ENOSPC) is said before anything is written */
    size_t group = (blocks + WRITE_GROUPS - 1) / WRITE_GROUPS * (size_t)CHUNK_BLOCK_SIZE;
    size_t groups = (job->payload_len + group - 1) / group;
    struct iocb cbs[WRITE_GROUPS];
    struct iovec vecs[WRITE_GROUPS][2];
    int in_flight = 0, err = 0;
    for (size_t g = groups; g-- > 0 && !err;) {
        size_t start = g * group;
        size_t n = job->payload_len - start < group ? job->payload_len - start : group;
        hash_blocks(job->payload, job->payload_len, start, start + n, digests, NULL);
        struct iovec *iov = vecs[g];
        iov[1] = (struct iovec){(void *)(job->payload + start), n};
        if (g > 0) {
            iov[0] = iov[1];
            iov[1] = (struct iovec){NULL, 0};
        } else if ((err = encode_job_header(job, b->header, digests, blocks, created)) != 0) {
            break;
        } else {
            iov[0] = (struct iovec){b->header, CHUNK_HEADER_SIZE};
        }
        struct iocb *cb = &cbs[g];
        memset(cb, 0, sizeof(*cb));
        cb->aio_data = g;
        cb->aio_lio_opcode = IOCB_CMD_PWRITEV;
        cb->aio_fildes = (uint32_t)fd;
        cb->aio_buf = (uintptr_t)iov;
        cb->aio_nbytes = iov[1].iov_len ? 2 : 1;
        cb->aio_offset = g > 0 ? (int64_t)(CHUNK_HEADER_SIZE + start) : 0;
        struct iocb *one[1] = {cb};
        if (syscall(SYS_io_submit, ctx, 1, one) == 1)
            in_flight++;
        else
            err = pio_full(fd, iov, (int)cb->aio_nbytes, (off_t)cb->aio_offset, 1);
    }
    int reaped = reap_groups(b, fd, vecs, in_flight);
    atomic_fetch_add_explicit(&chunkio_overlapped_writes, 1, memory_order_relaxed);
    return err ? err : reaped;
}

/* Writes the whole file (header and padded payload) at `fd`: a new file, or a recycled
 * one of the same size (`allocated`), every byte of which is overwritten. */
static int write_temp(chunk_write *job, int fd, int allocated, size_t task_size) {
    size_t blocks = (job->payload_len + CHUNK_BLOCK_SIZE - 1) / CHUNK_BLOCK_SIZE;
    uint64_t stack_digests[64];
    uint64_t *digests = blocks <= 64 ? stack_digests : malloc(blocks * sizeof(uint64_t));
    thread_buffers *b = my_buffers(0);
    if (digests == NULL || b == NULL) {
        if (digests != stack_digests) free(digests);
        return ENOMEM;
    }
    size_t piece = task_size / CHUNK_BLOCK_SIZE * CHUNK_BLOCK_SIZE;
    if (piece < CHUNK_BLOCK_SIZE) piece = CHUNK_BLOCK_SIZE;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t created = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    int err = -1; /* nothing written yet */
    if (job->payload_len <= piece && blocks > 1 && job->direct && is_aligned(job->payload) &&
        job->payload_len % CHUNK_ALIGNMENT == 0)
        err = write_overlapped(job, fd, allocated, b, digests, blocks, created);
    if (err < 0 && job->payload_len <= piece) { /* one piece: hash first, one call for all */
        hash_blocks(job->payload, job->payload_len, 0, job->payload_len, digests, NULL);
        err = encode_job_header(job, b->header, digests, blocks, created);
        if (!err)
            err = write_payload(fd, b->header, job->payload, job->payload_len, 0, job->direct,
                                task_size);
    } else if (err < 0) { /* piece by piece, each hashed just before it is written; the header last */
        err = 0;
        for (size_t start = 0; !err && start < job->payload_len; start += piece) {
            size_t n = job->payload_len - start < piece ? job->payload_len - start : piece;
            hash_blocks(job->payload, job->payload_len, start, start + n, digests, NULL);
            err = write_payload(fd, NULL, job->payload + start, n, start, job->direct,
                                task_size);
        }
        if (!err) err = encode_job_header(job, b->header, digests, blocks, created);
        if (!err) {
            struct iovec iov = {b->header, CHUNK_HEADER_SIZE};
            err = pio_full(fd, &iov, 1, 0, 1);
        }
    }
    if (digests != stack_digests) free(digests);
    if (!err && job->fsync_level >= 1 && fdatasync(fd) != 0) err = errno;
    return err;
}

/* Gives a file or directory just created exactly `mode`, whatever the umask: a chmod only
 * where the creation left another mode (an fstat reads; a chmod is one more journalled
 * inode change per chunk written).  0 or an errno. */
static int exact_mode(int fd, mode_t mode) {
    struct stat st;
    if (fstat(fd, &st) != 0) return errno;
    if ((st.st_mode & 07777) != mode && fchmod(fd, mode) != 0) return errno;
    return 0;
}

/* Makes directory `name` in `dir_fd` with exactly `mode` (or finds it there) and opens it,
 * O_NOFOLLOW: a link there is ELOOP or ENOTDIR, never followed.  *created: whether this call
 * made it.  Returns a descriptor or -errno. */
static int make_dir_at(int dir_fd, const char *name, mode_t mode, int *created) {
    *created = mkdirat(dir_fd, name, mode) == 0;
    if (!*created && errno != EEXIST) return -errno;
    int fd = openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -errno;
    int err = *created ? exact_mode(fd, mode) : 0; /* mkdir applied the umask */
    if (err) {
        close(fd);
        return -err;
    }
    return fd;
}

/* Opens `rel` beneath the root, creating its missing directories with exactly `mode`
 * (disk/safe_fs.open_dirs_beneath): each component opened O_NOFOLLOW relative to its
 * parent, so a link anywhere is ELOOP or ENOTDIR, never followed.  A new shard's parent
 * nearly always exists (a tree fills leaf by leaf): it is opened beneath the root and only
 * the leaf made, not every component tried from the root.  *created_at is the index of the
 * first component created (-1: none); returns a descriptor or -errno. */
static int make_dirs_beneath(int root_fd, const char *rel, mode_t mode, int *created_at) {
    char name[PATH_MAX];
    if (snprintf(name, sizeof(name), "%s", rel) >= (int)sizeof(name)) return -ENAMETOOLONG;
    *created_at = -1;
    int created, depth = 0;
    char *leaf = strrchr(name, '/');
    if (leaf) {
        *leaf = 0;
        int parent = chunk_open_beneath(root_fd, name, O_RDONLY | O_DIRECTORY, 0);
        *leaf = '/';
        if (parent >= 0) {
            int fd = make_dir_at(parent, leaf + 1, mode, &created);
            close(parent);
            if (fd >= 0 && created) { /* the leaf's index: the slashes before it */
                *created_at = 0;
                for (const char *c = name; c < leaf + 1; c++) *created_at += *c == '/';
            }
            return fd;
        }
        if (parent != -ENOENT) return parent;
    }
    int fd = root_fd;
    for (char *part = name; part; depth++) {
        char *slash = strchr(part, '/');
        if (slash) *slash = 0;
        int next = make_dir_at(fd, part, mode, &created);
        if (fd != root_fd) close(fd);
        if (next < 0) return next;
        if (created && *created_at < 0) *created_at = depth;
        fd = next;
        part = slash ? slash + 1 : NULL;
    }
    return fd;
}

/* The chunk file's size on disk: the header and the payload padded to the alignment. */
static off_t chunk_file_size(const chunk_write *job) {
    return (off_t)(CHUNK_HEADER_SIZE + chunk_padded(job->payload_len));
}

/* Opens a file taken from the pool for a write of `job`; its shard directory's descriptor
 * goes to *file_dir (the job's own `dir_fd` when it is the same directory).  A file that is
 * not as it was put (a link, another size or mode, more links) is removed.  Returns a
 * descriptor, or -1. */
static int open_recycled(const chunk_write *job, const pooled_file *f, int dir_fd, int flags,
                         int *file_dir) {
    int pdir = strcmp(f->dir_rel, job->dir_rel) == 0
                   ? dir_fd
                   : chunk_open_beneath(job->root_fd, f->dir_rel, O_PATH | O_DIRECTORY, 0);
    if (pdir < 0) return -1;
    int fd = openat(pdir, f->name, flags | O_NONBLOCK); /* never waits on a FIFO put there */
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
        st.st_size == chunk_file_size(job) && (st.st_mode & 07777) == job->mode) {
        *file_dir = pdir;
        return fd;
    }
    if (fd >= 0) close(fd);
    unlinkat(pdir, f->name, 0);
    if (pdir != dir_fd) close(pdir);
    return -1;
}

/* Writes the job's chunk into `fd` (`name` in directory `file_dir`: a new temp file, or a
 * `recycled` one), closes it and renames it to the job's final name in `dir_fd`; on
 * failure the file is removed.  Returns 0 or an errno. */
static int write_and_rename(chunk_write *job, int fd, int file_dir, const char *name, int dir_fd,
                            int recycled, size_t task_size) {
    int err = 0;
    if (!recycled) err = exact_mode(fd, job->mode);
    if (!err) err = write_temp(job, fd, recycled, task_size);
    if (close(fd) != 0 && !err) err = errno;
    if (!err && renameat(file_dir, name, dir_fd, job->final_name) != 0) err = errno;
    if (err) unlinkat(file_dir, name, 0);
    return err;
}

void chunk_write_run(chunk_write *job, size_t task_size) {
    job->error = 0;
    int created_at = -1;
    /* O_PATH: a descriptor only to name entries by (lighter to open and close); fsync
     * needs a real one */
    int dir_flags = (job->fsync_level >= 2 ? O_RDONLY : O_PATH) | O_DIRECTORY;
    int dir_fd = chunk_open_beneath(job->root_fd, job->dir_rel, dir_flags, 0);
    if (dir_fd == -ENOENT)
        dir_fd = make_dirs_beneath(job->root_fd, job->dir_rel, job->dir_mode, &created_at);
    if (dir_fd < 0) {
        job->status = CHUNK_FAILED;
        job->error = -dir_fd;
        return;
    }
    int flags = O_WRONLY | O_NOFOLLOW | O_CLOEXEC | (job->direct ? O_DIRECT : 0);
    int err = -1; /* not written yet */
    pooled_file taken = {0};
    if (job->pool && chunk_pool_take(job->pool, job->root_fd, chunk_file_size(job), &taken)) {
        int file_dir, fd = open_recycled(job, &taken, dir_fd, flags, &file_dir);
        if (fd >= 0) {
            err = write_and_rename(job, fd, file_dir, taken.name, dir_fd, 1, task_size);
            if (file_dir != dir_fd) close(file_dir);
            if (!err) atomic_fetch_add_explicit(&chunkio_recycled_writes, 1, memory_order_relaxed);
        } /* one that failed (removed by another process meanwhile?): a new file below */
        pooled_file_clear(&taken);
    }
    if (err) {
        int fd = openat(dir_fd, job->tmp_name, flags | O_CREAT | O_EXCL, job->mode);
        if (fd < 0 && errno == EEXIST) { /* left by a dead writer with this thread's name */
            unlinkat(dir_fd, job->tmp_name, 0);
            fd = openat(dir_fd, job->tmp_name, flags | O_CREAT | O_EXCL, job->mode);
        }
        err = fd < 0 ? errno : write_and_rename(job, fd, dir_fd, job->tmp_name, dir_fd, 0,
                                                task_size);
    }
    if (!err && job->fsync_level >= 2 && fsync(dir_fd) != 0) err = errno;
    close(dir_fd);
    /* dir_rel is ns/<namespace id>/aa/bb: component 1 is the namespace's directory */
    job->status = err ? CHUNK_FAILED
                      : (created_at >= 0 && created_at <= 1 ? CHUNK_NEW_NAMESPACE : CHUNK_OK);
    job->error = err;
}

int chunk_unlink(chunk_pool *pool, int root_fd, const char *rel) {
    const char *slash = strrchr(rel, '/');
    if (slash == NULL) return unlinkat(root_fd, rel, 0) == 0 ? 0 : errno;
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof(dir), "%.*s", (int)(slash - rel), rel) >= (int)sizeof(dir))
        return ENAMETOOLONG;
    int dir_fd = chunk_open_beneath(root_fd, dir, O_PATH | O_DIRECTORY, 0);
    if (dir_fd < 0) return -dir_fd;
    int err = pool ? chunk_pool_put(pool, root_fd, dir, dir_fd, slash + 1) : -1;
    if (err < 0) err = unlinkat(dir_fd, slash + 1, 0) == 0 ? 0 : errno;
    close(dir_fd);
    return err;
}
