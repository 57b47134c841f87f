/* lmcache_nvme_backend.io._native: batches of chunk reads and writes, run without the GIL.
 *
 * Python decides per batch (which files, which buffers, what to expect); this module runs
 * the per-chunk loop (chunkio.c) on its own threads and gives each batch back whole.  A
 * batch costs the interpreter at most one release and re-acquire of the GIL: `read_shares`
 * releases it once for the whole batch; `submit_read_shares` and `submit_shares` release
 * it only to wake sleeping workers, and one `wait` (which releases it only when nothing has
 * finished yet, or to signal the eventfds the previous batches' callbacks left to it) hands
 * back every batch finished by then.
 *
 * A batch is a sequence of shares, the two shapes of io/engine.py (ReadShare, WriteShare):
 * the chunks of one root in one namespace and layout, what is common said once, then
 * columns; each chunk's file names are made here from its digest and the share's naming.
 * Its chunks are numbered share by share, in order.
 *
 * Engine(threads, write_threads, task_size, recycle_bytes=0, recycle_suffix=None):
 *   recycle_bytes: up to this many bytes of removed chunk files (unlink, a write's victims)
 *   are kept, renamed <name><recycle_suffix> in their directory, and overwritten in place
 *   by later writes of their size (pool.h); close() removes the rest
 *   read_shares(shares) -> (statuses, details)
 *                                             blocking; the caller helps the read workers
 *   submit_read_shares(shares, token)         asynchronous; the batch comes back from wait
 *   submit_shares(shares, token)              asynchronous, on the write workers (nice 10,
 *                                             each waits up to 50 ms while reads are in flight)
 *   wait(timeout_s, signals=()) -> [(token, (statuses, details))], or None once closed and
 *                                             drained; first adds 1 to each eventfd in
 *                                             signals (at most MAX_WAIT_SIGNALS), in the
 *                                             same release of the GIL
 *   cancel_writes() -> int                    queued writes not started end as ECANCELED
 *   unlink(items) -> [errno]                  blocking, on the calling thread; with
 *                                             recycle_bytes, files kept for reuse (above)
 *   retired_bytes() -> int                    bytes in the files kept for reuse now
 *   thread_ids() -> [int]                     kernel ids, readers then writers
 *   close()                                   queued work finishes first
 * read share:  (root_fd, (shard_prefix, shard_levels, final_suffix), direct, payload_len,
 *               meta, digests, dests, keys); digests str (lowercase hex), keys and meta
 *               bytes (a key may hold lone surrogates, see format.text_bytes)
 * write share: (root_fd, (shard_prefix, shard_levels, final_suffix, temp_suffix), namespace,
 *               meta, direct, mode, dir_mode, fsync_level, victims, digests, payloads, keys,
 *               gpu_checksums); victims a tuple of files (rel, str) beneath the same root
 *               removed before the share's first write; gpu_checksums None or an (a, b) per
 *               chunk, recorded in its header
 * statuses: bytes, one chunk_status per chunk; details: for every chunk not CHUNK_OK,
 *   reads (index, errno, header or None, computed checksum), writes (index, status, errno).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "chunkio.h"
#include "xxh3.h"

#define WRITER_NICE 10
#define WRITERS_YIELD_NS 50000000L /* a write waits at most this long for reads in flight */
#define MAX_WAIT_SIGNALS 16          /* eventfds one wait() may signal */

static _Atomic uint64_t gil_releases;
static _Atomic uint64_t wake_releases; /* of which: to wake sleeping workers */

#define RELEASE_GIL_BEGIN               \
    atomic_fetch_add(&gil_releases, 1); \
    Py_BEGIN_ALLOW_THREADS
#define RELEASE_GIL_END Py_END_ALLOW_THREADS

enum batch_kind { BATCH_READ, BATCH_WRITE };

struct batch;

typedef struct write_job {
    chunk_write w;
    const char **victims;
    Py_ssize_t nvictims;
    struct batch *b;
    struct write_job *next;
} write_job;

typedef struct batch {
    PyObject *shares; /* a tuple of shares: keeps every string the requests point into */
    PyObject *token;
    Py_ssize_t n;
    int kind;
    chunk_read *reqs; /* reads */
    uint8_t *headers;
    chunk_piece *pieces;
    size_t npieces;
    write_job *jobs; /* writes */
    char *names;     /* a share batch's file names (share_batch_new) */
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    atomic_long left;
    int async;
    struct batch *next;     /* in the list of finished batches */
    struct batch *incoming; /* in the stack of submitted batches */
} batch;

/* Submitting never waits for a worker: a submitter may hold the GIL, and on a machine
 * with few cores a worker holding the queues' mutex can be descheduled for a whole time
 * slice.  Batches are pushed onto a lock-free stack (`incoming`) and the workers woken by
 * semaphores (posts never wait); a worker moves the stack into the FIFO queues under `mu`.
 * Workers recheck the queues before they sleep, so a post is only a wake-up.
 *
 * Closing seals the stack (`incoming` becomes SEALED, which refuses every later push): a
 * submitter that found the engine open can push after close() let the workers go, and a
 * batch pushed then would run on no thread and never come back.  A worker seals only once
 * stopped, with its queue and the stack empty under `mu`, and leaves only once it is sealed,
 * so every batch pushed before runs. */
typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t done_cv; /* a batch finished */
    sem_t read_sem, write_sem;
    _Atomic(batch *) incoming;
    chunk_piece *head, *tail;
    write_job *whead, *wtail;
    batch *done_head, *done_tail;
    atomic_long async_pending;
    atomic_long reads_in_flight;
    atomic_int read_sleepers, write_sleepers; /* workers in (or entering) sem_wait */
    atomic_int read_waking, write_waking;     /* of them, woken and not yet running */
    atomic_int stop;
    int nthreads, nwthreads;
    pthread_t *threads;
    pid_t *tids; /* kernel thread ids: readers first, then writers (recorded at start) */
    int readers_started, writers_started, readers_wanted;
    size_t task_size;
    chunk_pool *pool; /* removed chunk files kept for writes of their size (or NULL) */
} Engine;

static batch sealed_marker;
#define SEALED (&sealed_marker)

/* -- batches ----------------------------------------------------------------------------- */

static void batch_free(batch *b) {
    for (Py_ssize_t i = 0; i < b->nbufs; i++) PyBuffer_Release(&b->bufs[i]);
    if (b->reqs)
        for (Py_ssize_t i = 0; i < b->n; i++) chunk_read_free(&b->reqs[i]);
    if (b->jobs)
        for (Py_ssize_t i = 0; i < b->n; i++) free(b->jobs[i].victims);
    free(b->reqs);
    free(b->jobs);
    free(b->names);
    free(b->bufs);
    free(b->headers);
    free(b->pieces);
    Py_XDECREF(b->shares);
    Py_XDECREF(b->token);
    free(b);
}

/* A batch of `n` chunks holding `shares` (a tuple, which keeps alive every string and
 * object its requests point into). */
static batch *batch_alloc(PyObject *shares, int kind, Py_ssize_t n) {
    batch *b = calloc(1, sizeof(batch));
    if (b == NULL) return (batch *)PyErr_NoMemory();
    b->kind = kind;
    Py_INCREF(shares);
    b->shares = shares;
    b->n = n;
    b->bufs = calloc(b->n ? b->n : 1, sizeof(Py_buffer));
    if (b->bufs == NULL) {
        batch_free(b);
        return (batch *)PyErr_NoMemory();
    }
    return b;
}

/* The requests and headers of a read batch of b->n chunks; 0, or -1 with an exception. */
static int read_batch_alloc(batch *b) {
    b->reqs = calloc(b->n ? b->n : 1, sizeof(chunk_read));
    if (b->reqs == NULL ||
        posix_memalign((void **)&b->headers, CHUNK_ALIGNMENT,
                       (size_t)(b->n ? b->n : 1) * CHUNK_HEADER_SIZE) != 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Request i (chunk j of share s) reads into the buffer b->bufs[i] (acquired); 0, or -1
 * with an exception. */
static int read_request_set(Engine *self, batch *b, Py_ssize_t i, Py_ssize_t s, Py_ssize_t j,
                            unsigned long long payload_len) {
    chunk_read *r = &b->reqs[i];
    r->dest = b->bufs[i].buf;
    r->dest_len = (size_t)b->bufs[i].len;
    r->payload_len = payload_len;
    r->header = b->headers + (size_t)i * CHUNK_HEADER_SIZE;
    r->owner = b;
    if (r->dest_len < payload_len) {
        PyErr_Format(PyExc_ValueError, "share %zd: destination %zd holds %zu bytes, need %llu",
                     s, j, r->dest_len, payload_len);
        return -1;
    }
    b->npieces += chunk_read_piece_count(r, self->task_size);
    return 0;
}

/* Splits every request of a filled read batch into pieces; the batch, or NULL with an
 * exception (and the batch freed). */
static batch *read_batch_plan(batch *b, size_t task_size) {
    b->pieces = calloc(b->npieces ? b->npieces : 1, sizeof(chunk_piece));
    if (b->pieces == NULL) {
        PyErr_NoMemory();
        batch_free(b);
        return NULL;
    }
    size_t at = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        int planned = chunk_read_plan(&b->reqs[i], task_size, b->pieces + at);
        if (planned < 0) {
            PyErr_NoMemory();
            batch_free(b);
            return NULL;
        }
        at += (size_t)planned;
    }
    atomic_store(&b->left, (long)b->n);
    return b;
}

/* -- shares ------------------------------------------------------------------------------ */

/* The two shapes of a share (io/engine.py): a read share (root_fd, naming, direct,
 * payload_len, meta, digests, dests, keys) and a write share (root_fd, naming, namespace,
 * meta, direct, mode, dir_mode, fsync_level, victims, digests, payloads, keys,
 * gpu_checksums); the columns are lists of one length, from `digests` on. */
typedef struct {
    const char *what;
    const char *const *names; /* of the fields */
    Py_ssize_t fields;
    Py_ssize_t naming_fields; /* (shard_prefix, shard_levels, final_suffix[, temp_suffix]) */
    Py_ssize_t digests;       /* the digests' column; the buffers' and the keys' follow it */
    const char *columns;
} share_shape;

static const char *const READ_FIELDS[] = {"root_fd", "naming", "direct", "payload_len", "meta",
                                           "digests", "dests", "keys"};
static const char *const WRITE_FIELDS[] = {"root_fd", "naming", "namespace", "meta", "direct",
                                            "mode", "dir_mode", "fsync_level", "victims",
                                            "digests", "payloads", "keys", "gpu_checksums"};
static const share_shape READ_SHARE = {"read share", READ_FIELDS, 8, 3, 5,
                                       "digests, dests and keys"};
static const share_shape WRITE_SHARE = {"write share", WRITE_FIELDS, 13, 4, 9,
                                        "digests, payloads and keys"};

/* Shares are read field by field straight from their tuples, with the checks of the
 * PyArg_ParseTuple formats they replace ("i", "p", "y#", "K"): parsing the format strings
 * cost about 2 % of the interpreter's instructions per 2 MiB chunk.  A field that does not
 * convert is refused with an error that names it (the conversion's own TypeError or
 * OverflowError replaced; any other, say from an __index__, left as it is). */
static void field_refused(PyObject *share, const share_shape *shape, Py_ssize_t s, Py_ssize_t k,
                         const char *must) {
    PyObject *type = PyExc_TypeError;
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) type = PyExc_OverflowError;
    else if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) return;
    PyErr_Clear();
    if (type == PyExc_OverflowError)
        PyErr_Format(type, "share %zd: %s is out of range (%s)", s, shape->names[k], must);
    else
        PyErr_Format(type, "share %zd: %s must be %s, not %.100s", s, shape->names[k], must,
                     Py_TYPE(PyTuple_GET_ITEM(share, k))->tp_name);
}

static int field_int(PyObject *share, const share_shape *shape, Py_ssize_t s, Py_ssize_t k,
                     int *out) {
    long v = PyLong_AsLong(PyTuple_GET_ITEM(share, k));
    if ((v == -1 && PyErr_Occurred()) || v < INT_MIN || v > INT_MAX) {
        if (!PyErr_Occurred()) PyErr_SetNone(PyExc_OverflowError);
        field_refused(share, shape, s, k, "an int that fits a C int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int field_flag(PyObject *share, Py_ssize_t k, int *out) {
    int v = PyObject_IsTrue(PyTuple_GET_ITEM(share, k));
    if (v < 0) return -1;
    *out = v;
    return 0;
}

static int field_u64(PyObject *share, const share_shape *shape, Py_ssize_t s, Py_ssize_t k,
                     unsigned long long *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(share, k));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        field_refused(share, shape, s, k, "an int from 0 to 2**64 - 1");
        return -1;
    }
    *out = v;
    return 0;
}

static int field_bytes(PyObject *share, const share_shape *shape, Py_ssize_t s, Py_ssize_t k,
                       const uint8_t **out, size_t *len) {
    PyObject *o = PyTuple_GET_ITEM(share, k);
    if (!PyBytes_Check(o)) {
        field_refused(share, shape, s, k, "bytes");
        return -1;
    }
    *out = (const uint8_t *)PyBytes_AS_STRING(o);
    *len = (size_t)PyBytes_GET_SIZE(o);
    return 0;
}

/* Whether UTF-8 text of `len` bytes holds a NUL (a C path would end there). */
static int holds_nul(const char *text, Py_ssize_t len) { return strlen(text) != (size_t)len; }

/* A share's naming, RootLayout.chunk_naming or write_naming: a chunk's shard directory is
 * shard_prefix + d[0:2] (+ "/" + d[2:4] with two levels), its file d + final_suffix, its
 * temp name that + temp_suffix (writes), d its digest (docs/format.md). */
typedef struct {
    const char *prefix, *suffix, *temp;
    Py_ssize_t prefix_len, suffix_len, temp_len;
    int levels;
} naming;

static const char *naming_text(PyObject *o, Py_ssize_t *len) {
    return PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, len) : NULL;
}

/* Share `s`'s naming; 0, or -1 with an exception. */
static int naming_parse(PyObject *share, const share_shape *shape, Py_ssize_t s, naming *nm) {
    PyObject *o = PyTuple_GET_ITEM(share, 1);
    nm->temp = "";
    nm->temp_len = 0;
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != shape->naming_fields ||
        (nm->prefix = naming_text(PyTuple_GET_ITEM(o, 0), &nm->prefix_len)) == NULL ||
        !PyLong_Check(PyTuple_GET_ITEM(o, 1)) ||
        (nm->suffix = naming_text(PyTuple_GET_ITEM(o, 2), &nm->suffix_len)) == NULL ||
        (shape->naming_fields == 4 &&
         (nm->temp = naming_text(PyTuple_GET_ITEM(o, 3), &nm->temp_len)) == NULL)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "share %zd: naming is (shard_prefix, shard_levels, "
                         "final_suffix%s)", s, shape->naming_fields == 4 ? ", temp_suffix" : "");
        return -1;
    }
    long levels = PyLong_AsLong(PyTuple_GET_ITEM(o, 1));
    if (levels == -1 && PyErr_Occurred()) return -1;
    if (levels != 1 && levels != 2) {
        PyErr_Format(PyExc_ValueError, "share %zd: shard_levels must be 1 or 2, not %ld", s,
                     levels);
        return -1;
    }
    if (holds_nul(nm->prefix, nm->prefix_len) || holds_nul(nm->suffix, nm->suffix_len) ||
        holds_nul(nm->temp, nm->temp_len)) {
        PyErr_Format(PyExc_ValueError, "share %zd: naming holds a NUL character", s);
        return -1;
    }
    nm->levels = (int)levels;
    return 0;
}

/* Chunk j's digest in share `s`, as its file names take it: lowercase hex (a str), two
 * characters or more per shard level; NULL with an exception if it is not. */
static const char *digest_text(PyObject *share, const share_shape *shape, Py_ssize_t s,
                               Py_ssize_t j, int levels, Py_ssize_t *len) {
    PyObject *o = PyList_GET_ITEM(PyTuple_GET_ITEM(share, shape->digests), j);
    if (!PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "share %zd: digest %zd must be str, not %.100s", s, j,
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    const char *text = PyUnicode_AsUTF8AndSize(o, len);
    if (text == NULL) return NULL;
    int hex = *len >= 2 * levels;
    for (Py_ssize_t i = 0; hex && i < *len; i++)
        hex = (text[i] >= '0' && text[i] <= '9') || (text[i] >= 'a' && text[i] <= 'f');
    if (!hex) {
        PyErr_Format(PyExc_ValueError, "share %zd: digest %R is not lowercase hex of %d "
                     "characters or more", s, o, 2 * levels);
        return NULL;
    }
    return text;
}

/* Chunk j's digest in share `s`, checked by shares_measure. */
static const char *digest_at(PyObject *share, const share_shape *shape, Py_ssize_t j,
                             Py_ssize_t *len) {
    return PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(PyTuple_GET_ITEM(share, shape->digests), j),
                                   len);
}

/* Chunk j's key in share `s` (bytes: a key may hold lone surrogates, format.text_bytes). */
static int key_at(PyObject *share, const share_shape *shape, Py_ssize_t s, Py_ssize_t j,
                  const uint8_t **key, size_t *len) {
    PyObject *o = PyList_GET_ITEM(PyTuple_GET_ITEM(share, shape->digests + 2), j);
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "share %zd: key %zd must be bytes, not %.100s", s, j,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *key = (const uint8_t *)PyBytes_AS_STRING(o);
    *len = (size_t)PyBytes_GET_SIZE(o);
    return 0;
}

/* Checks the shape, naming and columns of every share of `shares` (a tuple) and each
 * chunk's digest; counts the chunks (*n) and the bytes of their names (*arena); 0, or -1
 * with an exception naming the share. */
static int shares_measure(PyObject *shares, const share_shape *shape, Py_ssize_t *n,
                          size_t *arena) {
    *n = 0;
    *arena = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(shares); s++) {
        PyObject *share = PyTuple_GET_ITEM(shares, s);
        naming nm;
        if (!PyTuple_Check(share) || PyTuple_GET_SIZE(share) != shape->fields) {
            PyErr_Format(PyExc_TypeError, "share %zd is not a tuple of %zd (a %s)", s,
                         shape->fields, shape->what);
            return -1;
        }
        if (naming_parse(share, shape, s, &nm) != 0) return -1;
        PyObject *digests = PyTuple_GET_ITEM(share, shape->digests),
                 *buffers = PyTuple_GET_ITEM(share, shape->digests + 1),
                 *keys = PyTuple_GET_ITEM(share, shape->digests + 2);
        if (!PyList_Check(digests) || !PyList_Check(buffers) || !PyList_Check(keys) ||
            PyList_GET_SIZE(buffers) != PyList_GET_SIZE(digests) ||
            PyList_GET_SIZE(keys) != PyList_GET_SIZE(digests)) {
            PyErr_Format(PyExc_TypeError, "share %zd: %s must be lists of one length", s,
                         shape->columns);
            return -1;
        }
        Py_ssize_t size = PyList_GET_SIZE(digests);
        if (size == 0 && shape == &WRITE_SHARE) { /* its victims would be left behind */
            PyErr_Format(PyExc_ValueError, "share %zd has no chunks", s);
            return -1;
        }
        /* the shard directory (prefix + 3 * levels - 1), then a read's "/" + file name,
         * a write's NUL, file name, NUL, temp name; each NUL-terminated */
        size_t dir = (size_t)nm.prefix_len + 3 * (size_t)nm.levels;
        for (Py_ssize_t j = 0; j < size; j++) {
            Py_ssize_t len;
            if (digest_text(share, shape, s, j, nm.levels, &len) == NULL) return -1;
            size_t file = (size_t)len + (size_t)nm.suffix_len + 1;
            *arena += dir + file + (shape == &WRITE_SHARE ? file + (size_t)nm.temp_len : 0);
        }
        *n += size;
    }
    return 0;
}

/* Writes a chunk's shard directory at `at` (no NUL); returns where it ends. */
static char *put_shard_dir(char *at, const naming *nm, const char *d) {
    memcpy(at, nm->prefix, (size_t)nm->prefix_len);
    at += nm->prefix_len;
    *at++ = d[0];
    *at++ = d[1];
    if (nm->levels == 2) {
        *at++ = '/';
        *at++ = d[2];
        *at++ = d[3];
    }
    return at;
}

/* Writes d + final_suffix (+ temp_suffix) and a NUL at `at`; returns where it ends. */
static char *put_file_name(char *at, const naming *nm, const char *d, Py_ssize_t len, int temp) {
    memcpy(at, d, (size_t)len);
    at += len;
    memcpy(at, nm->suffix, (size_t)nm->suffix_len);
    at += nm->suffix_len;
    if (temp) {
        memcpy(at, nm->temp, (size_t)nm->temp_len);
        at += nm->temp_len;
    }
    *at++ = '\0';
    return at;
}

/* A batch of the chunks of `shares` (a sequence of `shape`), its names' arena allocated;
 * NULL with an exception. */
static batch *shares_batch(PyObject *shares, const share_shape *shape, int kind) {
    PyObject *tuple = PySequence_Tuple(shares);
    Py_ssize_t n;
    size_t arena;
    if (tuple == NULL) return NULL;
    batch *b = NULL;
    if (shares_measure(tuple, shape, &n, &arena) == 0) b = batch_alloc(tuple, kind, n);
    Py_DECREF(tuple);
    if (b && (b->names = malloc(arena ? arena : 1)) == NULL) {
        batch_free(b);
        return (batch *)PyErr_NoMemory();
    }
    return b;
}

/* A read call's chunks as shares, one per root, namespace and layout: each chunk's path
 * made here from its digest as RootLayout.chunk_rel makes it, the directory, "/" and the
 * file name; the chunks numbered share by share, in order. */
static batch *read_batch_new(Engine *self, PyObject *shares) {
    batch *b = shares_batch(shares, &READ_SHARE, BATCH_READ);
    if (b == NULL || read_batch_alloc(b) != 0) goto fail;
    char *at = b->names;
    Py_ssize_t i = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(b->shares); s++) {
        PyObject *share = PyTuple_GET_ITEM(b->shares, s);
        PyObject *dests = PyTuple_GET_ITEM(share, 6);
        int root_fd, direct;
        unsigned long long payload_len;
        const uint8_t *meta;
        size_t meta_len;
        naming nm;
        const share_shape *shape = &READ_SHARE;
        if (naming_parse(share, shape, s, &nm) != 0 ||
            field_int(share, shape, s, 0, &root_fd) != 0 || field_flag(share, 2, &direct) != 0 ||
            field_u64(share, shape, s, 3, &payload_len) != 0 ||
            field_bytes(share, shape, s, 4, &meta, &meta_len) != 0)
            goto fail;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(dests); j++, i++) {
            chunk_read *r = &b->reqs[i];
            Py_ssize_t len;
            const char *d = digest_at(share, &READ_SHARE, j, &len);
            if (d == NULL || key_at(share, &READ_SHARE, s, j, &r->key, &r->key_len) != 0 ||
                PyObject_GetBuffer(PyList_GET_ITEM(dests, j), &b->bufs[i], PyBUF_WRITABLE) != 0)
                goto fail;
            b->nbufs = i + 1;
            r->rel = at;
            at = put_shard_dir(at, &nm, d);
            *at++ = '/';
            at = put_file_name(at, &nm, d, len, 0);
            r->root_fd = root_fd;
            r->direct = direct;
            r->meta = meta;
            r->meta_len = meta_len;
            if (read_request_set(self, b, i, s, j, payload_len) != 0) goto fail;
        }
    }
    return read_batch_plan(b, self->task_size);
fail:
    if (b) batch_free(b);
    return NULL;
}

/* Share `s`'s GPU checksums: None, or one (a, b) of unsigned 64-bit ints per chunk, which
 * the header records (disk/gpusum.py); a list of `size`, or NULL (None, or an exception). */
static PyObject *gpu_checksums_of(PyObject *share, Py_ssize_t s, Py_ssize_t size) {
    PyObject *sums = PyTuple_GET_ITEM(share, 12);
    if (sums == Py_None) return NULL;
    if (!PyList_Check(sums)) {
        PyErr_Format(PyExc_TypeError, "share %zd: gpu_checksums must be None or a list, not "
                     "%.100s", s, Py_TYPE(sums)->tp_name);
        return NULL;
    }
    if (PyList_GET_SIZE(sums) != size) {
        PyErr_Format(PyExc_ValueError, "share %zd: gpu_checksums holds %zd pairs for %zd "
                     "chunks", s, PyList_GET_SIZE(sums), size);
        return NULL;
    }
    return sums;
}

/* Chunk j's GPU checksum, sums[j], into `w`; 0, or -1 with an exception. */
static int gpu_checksum_set(chunk_write *w, PyObject *sums, Py_ssize_t s, Py_ssize_t j) {
    PyObject *pair = PyList_GET_ITEM(sums, j);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
        !PyLong_Check(PyTuple_GET_ITEM(pair, 0)) || !PyLong_Check(PyTuple_GET_ITEM(pair, 1))) {
        PyErr_Format(PyExc_TypeError, "share %zd: gpu_checksums[%zd] must be an (a, b) tuple "
                     "of ints", s, j);
        return -1;
    }
    for (int k = 0; k < 2; k++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, k));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "share %zd: gpu_checksums[%zd] must hold unsigned "
                         "64-bit ints", s, j);
            return -1;
        }
        w->gpu_checksum[k] = v;
    }
    w->has_gpu_checksum = 1;
    return 0;
}

/* Share `s`'s victims (a tuple of paths beneath its root, str) into the job of its first
 * chunk, which removes them before it writes; 0, or -1 with an exception. */
static int victims_set(write_job *job, PyObject *share, Py_ssize_t s) {
    PyObject *victims = PyTuple_GET_ITEM(share, 8);
    if (!PyTuple_Check(victims)) {
        PyErr_Format(PyExc_TypeError, "share %zd: victims must be a tuple, not %.100s", s,
                     Py_TYPE(victims)->tp_name);
        return -1;
    }
    if (PyTuple_GET_SIZE(victims) == 0) return 0;
    job->victims = calloc((size_t)PyTuple_GET_SIZE(victims), sizeof(char *));
    if (job->victims == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t v = 0; v < PyTuple_GET_SIZE(victims); v++, job->nvictims++) {
        PyObject *o = PyTuple_GET_ITEM(victims, v);
        Py_ssize_t len;
        if (!PyUnicode_Check(o) || (job->victims[v] = PyUnicode_AsUTF8AndSize(o, &len)) == NULL ||
            holds_nul(job->victims[v], len)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "share %zd: victim %zd is not a path (a str "
                             "with no NUL)", s, v);
            return -1;
        }
    }
    return 0;
}

/* A store task's writes as shares, one per root: each chunk's shard directory, final and
 * temp names made here from its digest as RootLayout.write_names makes them; a share's
 * victims removed before its first write; the chunks numbered share by share, in order. */
static batch *write_batch_new(PyObject *shares) {
    batch *b = shares_batch(shares, &WRITE_SHARE, BATCH_WRITE);
    if (b == NULL) return NULL;
    b->jobs = calloc(b->n ? (size_t)b->n : 1, sizeof(write_job));
    if (b->jobs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    char *at = b->names;
    Py_ssize_t i = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(b->shares); s++) {
        PyObject *share = PyTuple_GET_ITEM(b->shares, s), *sums;
        PyObject *payloads = PyTuple_GET_ITEM(share, 10);
        Py_ssize_t size = PyList_GET_SIZE(payloads);
        int root_fd, direct, mode, dir_mode, fsync_level;
        const uint8_t *ns, *meta;
        size_t ns_len, meta_len;
        naming nm;
        const share_shape *shape = &WRITE_SHARE;
        if (naming_parse(share, shape, s, &nm) != 0 ||
            field_int(share, shape, s, 0, &root_fd) != 0 ||
            field_bytes(share, shape, s, 2, &ns, &ns_len) != 0 ||
            field_bytes(share, shape, s, 3, &meta, &meta_len) != 0 ||
            field_flag(share, 4, &direct) != 0 || field_int(share, shape, s, 5, &mode) != 0 ||
            field_int(share, shape, s, 6, &dir_mode) != 0 ||
            field_int(share, shape, s, 7, &fsync_level) != 0 ||
            victims_set(&b->jobs[i], share, s) != 0 ||
            ((sums = gpu_checksums_of(share, s, size)) == NULL && PyErr_Occurred()))
            goto fail;
        for (Py_ssize_t j = 0; j < size; j++, i++) {
            write_job *job = &b->jobs[i];
            chunk_write *w = &job->w;
            Py_ssize_t len;
            const char *d = digest_at(share, &WRITE_SHARE, j, &len);
            if (d == NULL || key_at(share, &WRITE_SHARE, s, j, &w->key, &w->key_len) != 0 ||
                (sums && gpu_checksum_set(w, sums, s, j) != 0) ||
                PyObject_GetBuffer(PyList_GET_ITEM(payloads, j), &b->bufs[i], PyBUF_SIMPLE) != 0)
                goto fail;
            b->nbufs = i + 1;
            w->dir_rel = at;
            at = put_shard_dir(at, &nm, d);
            *at++ = '\0';
            w->final_name = at;
            at = put_file_name(at, &nm, d, len, 0);
            w->tmp_name = at;
            at = put_file_name(at, &nm, d, len, 1);
            w->root_fd = root_fd;
            w->payload = b->bufs[i].buf;
            w->payload_len = (size_t)b->bufs[i].len;
            w->ns = ns;
            w->ns_len = ns_len;
            w->meta = meta;
            w->meta_len = meta_len;
            w->direct = direct;
            w->mode = (mode_t)mode;
            w->dir_mode = (mode_t)dir_mode;
            w->fsync_level = fsync_level;
            w->status = CHUNK_FAILED;
            job->b = b;
        }
    }
    atomic_store(&b->left, (long)b->n);
    return b;
fail:
    batch_free(b);
    return NULL;
}

static PyObject *read_details(batch *b, PyObject *details) {
    for (Py_ssize_t i = 0; i < b->n; i++) {
        chunk_read *r = &b->reqs[i];
        if (r->status == CHUNK_OK) continue;
        PyObject *item;
        if (r->status == CHUNK_JUDGE)
            item = Py_BuildValue("(niy#K)", i, 0, (const char *)r->header,
                                 (Py_ssize_t)CHUNK_HEADER_SIZE,
                                 (unsigned long long)r->computed);
        else
            item = Py_BuildValue("(niOK)", i, atomic_load(&r->error), Py_None, 0ULL);
        if (item == NULL || PyList_Append(details, item) != 0) {
            Py_XDECREF(item);
            return NULL;
        }
        Py_DECREF(item);
    }
    return details;
}

static PyObject *write_details(batch *b, PyObject *details) {
    for (Py_ssize_t i = 0; i < b->n; i++) {
        chunk_write *w = &b->jobs[i].w;
        if (w->status == CHUNK_OK) continue;
        PyObject *item = Py_BuildValue("(nii)", i, w->status, w->error);
        if (item == NULL || PyList_Append(details, item) != 0) {
            Py_XDECREF(item);
            return NULL;
        }
        Py_DECREF(item);
    }
    return details;
}

/* (statuses, details) of a finished batch; frees it. */
static PyObject *batch_results(batch *b) {
    PyObject *statuses = PyBytes_FromStringAndSize(NULL, b->n);
    PyObject *details = PyList_New(0);
    PyObject *result = NULL;
    if (statuses && details) {
        char *out = PyBytes_AS_STRING(statuses);
        for (Py_ssize_t i = 0; i < b->n; i++)
            out[i] = (char)(b->kind == BATCH_READ ? b->reqs[i].status : b->jobs[i].w.status);
        if ((b->kind == BATCH_READ ? read_details(b, details) : write_details(b, details)))
            result = Py_BuildValue("(OO)", statuses, details);
    }
    Py_XDECREF(statuses);
    Py_XDECREF(details);
    batch_free(b);
    return result;
}

/* -- the threads --------------------------------------------------------------------------- */

/* One request of `b` ended.  The thread that ends the last one of a synchronous batch must
 * not read `b` after its decrement: the caller of read() may see `left` reach 0, free the
 * batch, and another batch may be allocated in its memory (a write batch taken for this
 * one would come back finished before its writes ran). */
static void batch_request_done(Engine *self, batch *b) {
    int reading = b->kind == BATCH_READ, async = b->async;
    if (atomic_fetch_sub(&b->left, 1) != 1) return;
    if (reading) atomic_fetch_sub(&self->reads_in_flight, 1);
    pthread_mutex_lock(&self->mu);
    if (async) {
        b->next = NULL;
        if (self->done_tail) self->done_tail->next = b;
        else self->done_head = b;
        self->done_tail = b;
    }
    pthread_cond_broadcast(&self->done_cv);
    pthread_mutex_unlock(&self->mu);
}

static void run_piece(Engine *self, chunk_piece *p) {
    if (chunk_read_run(p)) batch_request_done(self, (batch *)p->req->owner);
}

static void run_write(Engine *self, write_job *job) {
    for (Py_ssize_t v = 0; v < job->nvictims; v++)
        chunk_unlink(self->pool, job->w.root_fd, job->victims[v]);
    job->w.pool = self->pool;
    chunk_write_run(&job->w, self->task_size);
    batch_request_done(self, job->b);
}

/* Called with mu held. */
static chunk_piece *pop_piece(Engine *self) {
    chunk_piece *p = self->head;
    if (p) {
        self->head = p->next;
        if (self->head == NULL) self->tail = NULL;
    }
    return p;
}

static PyObject *closed_error(void) {
    PyErr_SetString(PyExc_RuntimeError, "the native I/O engine is closed");
    return NULL;
}

/* Hands a batch to the threads without waiting for any of them (see Engine); returns how
 * many workers to wake for it, or -1 when the engine is closed (the batch is not taken).
 * The batch may be finished (and freed) by the time this returns, so nothing of it is read
 * after it is pushed. */
static int push_batch(Engine *self, batch *b) {
    int reading = b->kind == BATCH_READ;
    size_t work = reading ? b->npieces : (size_t)b->n;
    int threads = reading ? self->nthreads : self->nwthreads;
    if (reading) atomic_fetch_add(&self->reads_in_flight, 1);
    batch *top = atomic_load(&self->incoming);
    do {
        if (top == SEALED) {
            if (reading) atomic_fetch_sub(&self->reads_in_flight, 1);
            return -1;
        }
        b->incoming = top;
    } while (!atomic_compare_exchange_weak(&self->incoming, &top, b));
    return work < (size_t)threads ? (int)work : threads;
}

static void wake(sem_t *sem, int count) {
    for (int i = 0; i < count; i++) sem_post(sem);
}

/* Pushes an asynchronous batch and wakes its workers (0), or refuses it when closed (-1).
 * Waking a sleeping thread is a system call that costs a VM tens of microseconds, so it
 * happens without the GIL (as LMCache's native connectors submit); while every worker is
 * busy, or every sleeper already has a wake on its way (a woken writer, at nice 10, may take
 * a while to run), a post is an atomic add or a futex call that finds no one to wake, and
 * the GIL is kept.  Every post is made either way: ``waking`` only decides whether to let go
 * of the GIL. */
static int push_and_wake(Engine *self, batch *b) {
    int reading = b->kind == BATCH_READ;
    sem_t *sem = reading ? &self->read_sem : &self->write_sem;
    atomic_int *sleepers = reading ? &self->read_sleepers : &self->write_sleepers;
    atomic_int *waking = reading ? &self->read_waking : &self->write_waking;
    int count = push_batch(self, b);
    if (count < 0) return -1;
    int asleep = atomic_load(sleepers) - atomic_load(waking);
    if (asleep > 0) {
        atomic_fetch_add(waking, count < asleep ? count : asleep);
        atomic_fetch_add(&wake_releases, 1);
        RELEASE_GIL_BEGIN
        wake(sem, count);
        RELEASE_GIL_END
    } else {
        wake(sem, count);
    }
    return 0;
}

/* A worker sleeps until a post (and no longer counts as being woken). */
static void sleep_on(sem_t *sem, atomic_int *sleepers, atomic_int *waking) {
    atomic_fetch_add(sleepers, 1);
    while (sem_wait(sem) != 0 && errno == EINTR) {}
    atomic_fetch_sub(sleepers, 1);
    int w = atomic_load(waking);
    while (w > 0 && !atomic_compare_exchange_weak(waking, &w, w - 1)) {}
}

/* Moves submitted batches into the FIFO queues, oldest first.  Called with mu held. */
static void drain_incoming(Engine *self) {
    batch *stack = atomic_load(&self->incoming), *fifo = NULL;
    while (stack && stack != SEALED &&
           !atomic_compare_exchange_weak(&self->incoming, &stack, NULL)) {}
    if (stack == SEALED) stack = NULL; /* sealed empty: nothing was pushed since */
    while (stack) { /* reverse: the stack holds the newest first */
        batch *next = stack->incoming;
        stack->incoming = fifo;
        fifo = stack;
        stack = next;
    }
    for (batch *b = fifo; b; b = b->incoming) {
        if (b->kind == BATCH_READ) {
            for (size_t i = 0; i < b->npieces; i++) {
                chunk_piece *p = &b->pieces[i];
                p->next = NULL;
                if (self->tail) self->tail->next = p;
                else self->head = p;
                self->tail = p;
            }
        } else {
            for (Py_ssize_t i = 0; i < b->n; i++) {
                write_job *j = &b->jobs[i];
                j->next = NULL;
                if (self->wtail) self->wtail->next = j;
                else self->whead = j;
                self->wtail = j;
            }
        }
    }
}

/* Whether a stopped worker whose queue is empty may leave: it seals the empty stack (or
 * finds it sealed), after which nothing can be pushed; a wait() then may see the engine
 * drained.  Called with mu held, so no batch is between the stack and a queue.  A stopped
 * worker that may not leave (a batch was pushed after its drain) goes round again rather
 * than sleep: the batch's posts may be for the other workers, and close() posts only once. */
static int may_leave(Engine *self) {
    if (!atomic_load(&self->stop)) return 0;
    batch *empty = NULL;
    if (!atomic_compare_exchange_strong(&self->incoming, &empty, SEALED) && empty != SEALED)
        return 0;
    pthread_cond_broadcast(&self->done_cv);
    return 1;
}

/* The next write job.  Called with mu held. */
static write_job *pop_write(Engine *self) {
    write_job *j = self->whead;
    if (j) {
        self->whead = j->next;
        if (self->whead == NULL) self->wtail = NULL;
    }
    return j;
}

/* Records the calling thread's kernel id (readers first in `tids`, then writers), and
 * makes it a batch thread: waking it never preempts the thread that woke it (SCHED_BATCH,
 * same share of the CPU otherwise), so a submitter that holds the GIL keeps running. */
static void thread_started(Engine *self, int writer) {
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &none);
    pthread_mutex_lock(&self->mu);
    int slot = writer ? self->readers_wanted + self->writers_started++ : self->readers_started++;
    self->tids[slot] = (pid_t)syscall(SYS_gettid);
    pthread_cond_broadcast(&self->done_cv);
    pthread_mutex_unlock(&self->mu);
}

static void *read_worker(void *arg) {
    Engine *self = arg;
    pthread_setname_np(pthread_self(), "nvme-native-rd");
    thread_started(self, 0);
    for (;;) {
        pthread_mutex_lock(&self->mu);
        drain_incoming(self);
        chunk_piece *p = pop_piece(self);
        int leave = p == NULL && may_leave(self);
        pthread_mutex_unlock(&self->mu);
        if (p) {
            run_piece(self, p);
        } else if (leave) {
            break; /* stopped and drained */
        } else if (!atomic_load(&self->stop)) { /* stopped: never sleeps (see may_leave) */
            sleep_on(&self->read_sem, &self->read_sleepers, &self->read_waking);
        }
    }
    return NULL;
}

static void *write_worker(void *arg) {
    Engine *self = arg;
    pthread_setname_np(pthread_self(), "nvme-native-wr");
    /* background work: never take a core from the inference engine (a thread's own nice) */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), WRITER_NICE);
    thread_started(self, 1);
    for (;;) {
        pthread_mutex_lock(&self->mu);
        drain_incoming(self);
        write_job *j = pop_write(self);
        int leave = j == NULL && may_leave(self);
        if (j && atomic_load(&self->reads_in_flight) > 0 && !atomic_load(&self->stop)) {
            struct timespec until; /* reads go first, for a while */
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += WRITERS_YIELD_NS;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            while (atomic_load(&self->reads_in_flight) > 0 && !atomic_load(&self->stop))
                if (pthread_cond_timedwait(&self->done_cv, &self->mu, &until) == ETIMEDOUT) break;
        }
        pthread_mutex_unlock(&self->mu);
        if (j) {
            run_write(self, j);
        } else if (leave) {
            break; /* stopped and drained */
        } else if (!atomic_load(&self->stop)) { /* stopped: never sleeps (see may_leave) */
            sleep_on(&self->write_sem, &self->write_sleepers, &self->write_waking);
        }
    }
    return NULL;
}

/* The calling thread runs queued pieces (its own or others') until its batch is done. */
static void help_until_done(Engine *self, batch *b) {
    pthread_mutex_lock(&self->mu);
    while (atomic_load(&b->left) > 0) {
        drain_incoming(self);
        chunk_piece *p = pop_piece(self);
        if (p) {
            pthread_mutex_unlock(&self->mu);
            run_piece(self, p);
            pthread_mutex_lock(&self->mu);
        } else {
            pthread_cond_wait(&self->done_cv, &self->mu);
        }
    }
    pthread_mutex_unlock(&self->mu);
}

/* -- Engine methods ----------------------------------------------------------------------- */

static int Engine_init(Engine *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"threads", "write_threads", "task_size", "recycle_bytes",
                            "recycle_suffix", NULL};
    int threads, write_threads;
    Py_ssize_t task_size;
    unsigned long long recycle_bytes = 0;
    const char *recycle_suffix = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iin|Kz", names, &threads, &write_threads,
                                     &task_size, &recycle_bytes, &recycle_suffix))
        return -1;
    if (recycle_bytes && (recycle_suffix == NULL || *recycle_suffix == 0 ||
                          strchr(recycle_suffix, '/') != NULL)) {
        PyErr_SetString(PyExc_ValueError, "recycle_bytes needs recycle_suffix: a file name "
                                          "suffix without '/'");
        return -1;
    }
    if (threads < 1 || write_threads < 1 || task_size < CHUNK_ALIGNMENT ||
        task_size % CHUNK_ALIGNMENT) {
        PyErr_SetString(PyExc_ValueError, "threads and write_threads must be >= 1 and "
                                          "task_size a positive multiple of 4096");
        return -1;
    }
    if (self->threads) {
        PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->done_cv, NULL);
    sem_init(&self->read_sem, 0, 0);
    sem_init(&self->write_sem, 0, 0);
    self->task_size = (size_t)task_size;
    if (recycle_bytes && (self->pool = chunk_pool_new(recycle_suffix, recycle_bytes)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->readers_wanted = threads;
    self->threads = calloc((size_t)(threads + write_threads), sizeof(pthread_t));
    self->tids = calloc((size_t)(threads + write_threads), sizeof(pid_t));
    if (self->threads == NULL || self->tids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < threads + write_threads; i++) {
        int err = pthread_create(&self->threads[i], NULL, i < threads ? read_worker : write_worker,
                                 self);
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (i < threads) self->nthreads = i + 1;
        else self->nwthreads = i + 1 - threads;
    }
    return 0;
}

static PyObject *Engine_thread_ids(Engine *self, PyObject *Py_UNUSED(ignored)) {
    int total = self->nthreads + self->nwthreads;
    pthread_mutex_lock(&self->mu);
    while (self->readers_started + self->writers_started < total)
        pthread_cond_wait(&self->done_cv, &self->mu);
    pthread_mutex_unlock(&self->mu);
    PyObject *out = PyList_New(total);
    for (int i = 0; out && i < total; i++)
        PyList_SET_ITEM(out, i, PyLong_FromLong((long)self->tids[i]));
    return out;
}

/* A quick refusal before a batch is built; push_batch has the last word. */
static int engine_open(Engine *self) {
    if (self->threads == NULL || atomic_load(&self->stop)) {
        closed_error();
        return 0;
    }
    return 1;
}

/* Runs a read batch on the threads, the calling thread helping, and hands back its results. */
static PyObject *run_read(Engine *self, batch *b) {
    if (b == NULL) return NULL;
    if (b->n) {
        int count;
        RELEASE_GIL_BEGIN
        count = push_batch(self, b);
        if (count >= 0) {
            wake(&self->read_sem, count);
            help_until_done(self, b);
        }
        RELEASE_GIL_END
        if (count < 0) {
            batch_free(b);
            return closed_error();
        }
    }
    return batch_results(b);
}

static PyObject *Engine_read_shares(Engine *self, PyObject *shares) {
    if (!engine_open(self)) return NULL;
    return run_read(self, read_batch_new(self, shares));
}

/* Hands an asynchronous batch to the threads; it comes back from wait().  It counts as
 * pending before it can be refused, so a wait() that saw the engine sealed with nothing
 * pending never misses it; a refusal wakes a wait() that saw it pending. */
static PyObject *submit(Engine *self, batch *b, PyObject *token) {
    b->async = 1;
    Py_INCREF(token);
    b->token = token;
    atomic_fetch_add(&self->async_pending, 1);
    if (b->n == 0 && atomic_load(&self->incoming) != SEALED) {
        /* nothing to do: finished at once (this takes mu, rarely) */
        atomic_store(&b->left, 1);
        if (b->kind == BATCH_READ) atomic_fetch_add(&self->reads_in_flight, 1);
        batch_request_done(self, b);
    } else if (b->n == 0 || push_and_wake(self, b) < 0) {
        atomic_fetch_sub(&self->async_pending, 1);
        pthread_mutex_lock(&self->mu);
        pthread_cond_broadcast(&self->done_cv);
        pthread_mutex_unlock(&self->mu);
        batch_free(b);
        return closed_error();
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_submit_read_shares(Engine *self, PyObject *args) {
    PyObject *shares, *token;
    if (!PyArg_ParseTuple(args, "OO", &shares, &token) || !engine_open(self)) return NULL;
    batch *b = read_batch_new(self, shares);
    return b == NULL ? NULL : submit(self, b, token);
}

static PyObject *Engine_submit_shares(Engine *self, PyObject *args) {
    PyObject *shares, *token;
    if (!PyArg_ParseTuple(args, "OO", &shares, &token) || !engine_open(self)) return NULL;
    batch *b = write_batch_new(shares);
    return b == NULL ? NULL : submit(self, b, token);
}

static PyObject *Engine_cancel_writes(Engine *self, PyObject *Py_UNUSED(ignored)) {
    if (self->threads == NULL) return PyLong_FromLong(0);
    pthread_mutex_lock(&self->mu);
    drain_incoming(self);
    write_job *j = self->whead;
    self->whead = self->wtail = NULL;
    pthread_mutex_unlock(&self->mu);
    long cancelled = 0;
    while (j) {
        write_job *next = j->next;
        j->w.status = CHUNK_FAILED;
        j->w.error = ECANCELED;
        batch_request_done(self, j->b);
        cancelled++;
        j = next;
    }
    return PyLong_FromLong(cancelled);
}

/* Takes the finished asynchronous batches.  Called with mu held. */
static batch *take_done(Engine *self) {
    batch *done = self->done_head;
    self->done_head = self->done_tail = NULL;
    for (batch *b = done; b; b = b->next) atomic_fetch_sub(&self->async_pending, 1);
    return done;
}

/* Whether the engine is closed and drained: sealed (nothing more can come) and every
 * asynchronous batch taken. */
static int drained(Engine *self) {
    return atomic_load(&self->incoming) == SEALED && atomic_load(&self->async_pending) == 0;
}

/* Waits up to ``timeout`` seconds for finished batches (without the GIL); sets ``closed``
 * when the engine is closed and drained. */
static batch *wait_done(Engine *self, double timeout, int *closed) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)timeout;
    until.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&self->mu);
    while (self->done_head == NULL && !drained(self)) {
        if (pthread_cond_timedwait(&self->done_cv, &self->mu, &until) == ETIMEDOUT) break;
    }
    batch *done = take_done(self);
    *closed = done == NULL && drained(self);
    pthread_mutex_unlock(&self->mu);
    return done;
}

/* Adds 1 to each eventfd (a waiter's wake-up: a system call that may cost a VM tens of
 * microseconds, so it is made without the GIL).  A full counter (EAGAIN) already signals. */
static void signal_eventfds(const int *fds, Py_ssize_t n) {
    const uint64_t one = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        ssize_t written;
        do written = write(fds[i], &one, sizeof one);
        while (written < 0 && errno == EINTR);
    }
}

static PyObject *Engine_wait(Engine *self, PyObject *args) {
    double timeout;
    PyObject *signals = NULL;
    int fds[MAX_WAIT_SIGNALS];
    if (!PyArg_ParseTuple(args, "d|O!", &timeout, &PyTuple_Type, &signals)) return NULL;
    Py_ssize_t nsignals = signals ? PyTuple_GET_SIZE(signals) : 0;
    if (nsignals > MAX_WAIT_SIGNALS) {
        PyErr_Format(PyExc_ValueError, "wait() signals at most %d eventfds", MAX_WAIT_SIGNALS);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nsignals; i++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(signals, i));
        if (fd < 0 || fd > INT_MAX) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "not a file descriptor");
            return NULL;
        }
        fds[i] = (int)fd;
    }
    int closed = 0;
    if (self->threads == NULL) {
        signal_eventfds(fds, nsignals);
        Py_RETURN_NONE;
    }
    /* batches already finished are taken without letting go of the GIL (the workers hold
     * mu only for moments), unless there are eventfds to signal: then one release serves
     * both */
    batch *done = NULL;
    if (nsignals == 0) {
        pthread_mutex_lock(&self->mu);
        done = take_done(self);
        pthread_mutex_unlock(&self->mu);
    }
    if (done == NULL) {
        RELEASE_GIL_BEGIN
        signal_eventfds(fds, nsignals);
        done = wait_done(self, timeout, &closed);
        RELEASE_GIL_END
    }
    if (closed) Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    while (done) {
        batch *b = done;
        done = b->next;
        PyObject *token = b->token;
        Py_INCREF(token);
        PyObject *results = batch_results(b);
        PyObject *item = results ? Py_BuildValue("(NN)", token, results) : NULL;
        if (results == NULL) Py_DECREF(token);
        if (item == NULL || out == NULL || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            continue; /* still free the remaining batches */
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *Engine_unlink(Engine *self, PyObject *items) {
    PyObject *tuple = PySequence_Tuple(items);
    if (tuple == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    int *fds = calloc(n ? (size_t)n : 1, sizeof(int));
    const char **rels = calloc(n ? (size_t)n : 1, sizeof(char *));
    int *errors = calloc(n ? (size_t)n : 1, sizeof(int));
    PyObject *result = NULL;
    if (fds == NULL || rels == NULL || errors == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(tuple, i), "is;an unlink item is (root_fd, rel)",
                              &fds[i], &rels[i]))
            goto done;
    if (n) {
        RELEASE_GIL_BEGIN
        for (Py_ssize_t i = 0; i < n; i++) errors[i] = chunk_unlink(self->pool, fds[i], rels[i]);
        RELEASE_GIL_END
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i++)
        PyList_SET_ITEM(result, i, PyLong_FromLong(errors[i]));
done:
    free(fds);
    free(rels);
    free(errors);
    Py_DECREF(tuple);
    return result;
}

/* Only the first caller stops and joins the threads (two close() calls at once would join
 * each thread twice); the others return at once, and wait() tells when all is drained. */
static void engine_stop(Engine *self) {
    if (self->threads == NULL || atomic_exchange(&self->stop, 1)) return;
    pthread_mutex_lock(&self->mu);
    pthread_cond_broadcast(&self->done_cv); /* writers waiting for reads go at once */
    pthread_mutex_unlock(&self->mu);
    for (int i = 0; i < self->nthreads; i++) sem_post(&self->read_sem);
    for (int i = 0; i < self->nwthreads; i++) sem_post(&self->write_sem);
    for (int i = 0; i < self->nthreads + self->nwthreads; i++) pthread_join(self->threads[i], NULL);
    chunk_pool_drain(self->pool); /* a closed store leaves no retired file behind */
}

static PyObject *Engine_close(Engine *self, PyObject *Py_UNUSED(ignored)) {
    /* queued work finishes first; finished asynchronous batches stay for wait() */
    RELEASE_GIL_BEGIN
    engine_stop(self);
    RELEASE_GIL_END
    Py_RETURN_NONE;
}

static void Engine_dealloc(Engine *self) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(self);
    Py_END_ALLOW_THREADS
    while (self->done_head) {
        batch *b = self->done_head;
        self->done_head = b->next;
        batch_free(b);
    }
    chunk_pool_free(self->pool);
    if (self->threads) {
        free(self->threads);
        free(self->tids);
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->done_cv);
        sem_destroy(&self->read_sem);
        sem_destroy(&self->write_sem);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_retired_bytes(Engine *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(chunk_pool_bytes(self->pool));
}

static PyMethodDef Engine_methods[] = {
    {"retired_bytes", (PyCFunction)Engine_retired_bytes, METH_NOARGS,
     "retired_bytes() -> int: bytes in removed chunk files kept for reuse now."},
    {"read_shares", (PyCFunction)Engine_read_shares, METH_O,
     "read_shares(shares) -> (statuses, details): read and verify a batch given as read "
     "shares (each a call's chunks of one root, namespace and layout as columns; their paths "
     "made here from their digests), waiting for it; the chunks numbered share by share."},
    {"submit_read_shares", (PyCFunction)Engine_submit_read_shares, METH_VARARGS,
     "submit_read_shares(shares, token): start reading a batch of read shares; wait() "
     "returns it with its token."},
    {"submit_shares", (PyCFunction)Engine_submit_shares, METH_VARARGS,
     "submit_shares(shares, token): start a store task's write batch, given as one write "
     "share per root (its chunks named here from their digests, their GPU checksums None or "
     "an (a, b) each); wait() returns it with its token."},
    {"wait", (PyCFunction)Engine_wait, METH_VARARGS,
     "wait(timeout_s, signals=()) -> [(token, statuses, details)], or None once closed and "
     "drained; first adds 1 to each eventfd of the tuple signals, without the GIL."},
    {"cancel_writes", (PyCFunction)Engine_cancel_writes, METH_NOARGS,
     "cancel_writes() -> int: queued writes not started yet end as ECANCELED."},
    {"unlink", (PyCFunction)Engine_unlink, METH_O,
     "unlink(items) -> [errno]: remove chunk files (root_fd, rel), 0 where removed."},
    {"thread_ids", (PyCFunction)Engine_thread_ids, METH_NOARGS,
     "thread_ids() -> [int]: kernel ids of the engine's threads, readers then writers."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "close(): finish queued reads and writes and stop the threads."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmcache_nvme_backend.io._native.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Chunk reads and writes on native threads, a batch per GIL round trip.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

/* -- module functions ------------------------------------------------------------------- */

static PyObject *py_xxh3_64(PyObject *mod, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) return NULL;
    uint64_t h = xxh3_64(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_memory_view(PyObject *mod, PyObject *args) {
    unsigned long long address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "Kn", &address, &length)) return NULL;
    if (length < 0 || (address == 0 && length > 0)) {
        PyErr_SetString(PyExc_ValueError, "memory_view needs an address and a length >= 0");
        return NULL;
    }
    static char empty;
    return PyMemoryView_FromMemory(length ? (char *)(uintptr_t)address : &empty, length,
                                   PyBUF_WRITE);
}

static PyObject *py_encode_header(PyObject *mod, PyObject *args) {
    const char *key, *ns, *meta;
    Py_ssize_t key_len, ns_len, meta_len;
    unsigned long long payload_len, checksum, created;
    PyObject *gpu;
    if (!PyArg_ParseTuple(args, "y#y#y#KKKO", &key, &key_len, &ns, &ns_len, &meta, &meta_len,
                          &payload_len, &checksum, &created, &gpu))
        return NULL;
    uint64_t gpu_sum[2];
    if (gpu != Py_None) {
        unsigned long long a, b;
        if (!PyArg_ParseTuple(gpu, "KK", &a, &b)) return NULL;
        gpu_sum[0] = a;
        gpu_sum[1] = b;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, CHUNK_HEADER_SIZE);
    if (out == NULL) return NULL;
    if (chunk_encode_header((uint8_t *)PyBytes_AS_STRING(out), (const uint8_t *)key,
                            (size_t)key_len, (const uint8_t *)ns, (size_t)ns_len,
                            (const uint8_t *)meta, (size_t)meta_len, payload_len, checksum,
                            created, gpu == Py_None ? NULL : gpu_sum) != 0) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_ValueError, "key, namespace and metadata do not fit the header");
        return NULL;
    }
    return out;
}

static PyObject *py_counters(PyObject *mod, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "gil_releases",
                         (unsigned long long)atomic_load(&gil_releases), "wake_releases",
                         (unsigned long long)atomic_load(&wake_releases), "hashed_bytes",
                         (unsigned long long)atomic_load(&chunkio_hashed_bytes),
                         "hash_sampled_ns",
                         (unsigned long long)atomic_load(&chunkio_hash_sampled_ns),
                         "hash_sampled_bytes",
                         (unsigned long long)atomic_load(&chunkio_hash_sampled_bytes),
                         "overlapped_writes",
                         (unsigned long long)atomic_load(&chunkio_overlapped_writes),
                         "recycled_writes",
                         (unsigned long long)atomic_load(&chunkio_recycled_writes));
}

/* The cycle collector stops tracking each object (if it did): for objects that can never be
 * part of a reference cycle and live long in great numbers (the store's index and its
 * entries), which every full collection would otherwise visit while holding the GIL. */
static PyObject *py_gc_untrack(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    for (Py_ssize_t i = 0; i < nargs; i++)
        if (PyObject_IS_GC(args[i])) PyObject_GC_UnTrack(args[i]);
    Py_RETURN_NONE;
}

static const char *SIMD_NAMES[] = {"scalar", "sse2", "avx2"};
static int simd_in_use;

static PyObject *py_simd(PyObject *mod, PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_FromString(SIMD_NAMES[simd_in_use]);
}

static PyObject *py_select_simd(PyObject *mod, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    for (int i = 0; i < 3; i++) {
        if (strcmp(name, SIMD_NAMES[i]) == 0) {
            if (xxh3_select(i) != 0) break;
            simd_in_use = i;
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE;
}

static PyMethodDef module_methods[] = {
    {"xxh3_64", py_xxh3_64, METH_O, "xxh3_64(buffer) -> int: XXH3-64 of the bytes."},
    {"memory_view", py_memory_view, METH_VARARGS,
     "memory_view(address, length) -> memoryview: writable bytes at address (the caller "
     "keeps the memory alive while the view is used)."},
    {"encode_header", py_encode_header, METH_VARARGS,
     "encode_header(key, namespace, meta, payload_len, checksum, created_ns, gpu_checksum)"
     " -> bytes: a chunk header as the native writer builds it."},
    {"counters", py_counters, METH_NOARGS,
     "counters() -> dict: GIL releases (and of them, to wake workers), bytes hashed, and "
     "the thread CPU nanoseconds and bytes of the hash calls timed (one in eight), and the "
     "chunks written while hashed (overlapped)."},
    {"gc_untrack", (PyCFunction)(void (*)(void))py_gc_untrack, METH_FASTCALL,
     "gc_untrack(*objs): the cycle collector no longer tracks these objects (which must "
     "never be part of a reference cycle)."},
    {"simd", py_simd, METH_NOARGS, "simd() -> str: the hashing loop in use."},
    {"select_simd", py_select_simd, METH_O,
     "select_simd(name) -> bool: use the scalar, sse2 or avx2 hashing loop (tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_native",
    "Chunk reads and writes in batches on native threads, without the GIL.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    simd_in_use = xxh3_init();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0 ||
        PyModule_AddIntConstant(m, "OK", CHUNK_OK) < 0 ||
        PyModule_AddIntConstant(m, "JUDGE", CHUNK_JUDGE) < 0 ||
        PyModule_AddIntConstant(m, "FAILED", CHUNK_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "NEW_NAMESPACE", CHUNK_NEW_NAMESPACE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WAIT_SIGNALS", MAX_WAIT_SIGNALS) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
