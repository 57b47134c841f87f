/* Batches from and back to Python (batches.h): a list of shares parsed into one batch, and
 * a finished batch's outcome built as Python objects.
 *
 * A batch holds what its requests point into: the tuple of its shares and a copy of each
 * share's columns (every string and bytes object; the name arena is made from them) and
 * the buffers of its destinations or payloads, acquired while it is built and let go when
 * it is freed; the threads see only the batch inside (engine.h).  What a malformed share
 * holds is let go at once: a refused batch leaves every buffer resizable again. */
#include "batches.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* A batch and the Python objects it holds; a batch made here is the first member of one. */
typedef struct {
    batch b;
    PyObject *shares;  /* a tuple of shares: keeps every string the requests point into */
    PyObject *columns; /* a tuple of each share's columns, copied (see columns_of) */
    PyObject *token;
    Py_buffer *bufs; /* a chunk's destination (reads) or payload (writes), in chunk order */
    Py_ssize_t nbufs;
} py_batch;

void batch_free(batch *b) {
    py_batch *p = (py_batch *)b;
    for (Py_ssize_t i = 0; i < p->nbufs; i++) PyBuffer_Release(&p->bufs[i]);
    if (b->reqs)
        for (size_t i = 0; i < b->n; i++) chunk_read_free(&b->reqs[i]);
    if (b->jobs)
        for (size_t i = 0; i < b->n; i++) free(b->jobs[i].victims);
    free(b->reqs);
    free(b->jobs);
    free(b->names);
    free(p->bufs);
    free(b->headers);
    free(b->pieces);
    Py_XDECREF(p->shares);
    Py_XDECREF(p->columns);
    Py_XDECREF(p->token);
    free(p);
}

void batch_set_token(batch *b, PyObject *token) { ((py_batch *)b)->token = Py_NewRef(token); }

/* -- shares -------------------------------------------------------------------------------- */

/* The two shapes of a share (io/engine.py), a read share and a write share, their fields
 * named below; the columns are lists of one length, from `digests` on. */
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

/* A share's columns are copied when its batch is made (digests, buffers, keys and, for
 * writes, GPU checksums; each a tuple): the threads read the keys long after, and Python
 * code run meanwhile (an __index__ or __bool__ of a field while the batch is made, or a
 * caller reusing its lists once it is submitted) can neither change what was measured nor
 * free a key in use. */
enum { COL_DIGESTS, COL_BUFFERS, COL_KEYS, COL_GPU };

/* Share `s`'s GPU checksums: None, or a list of one (a, b) of unsigned 64-bit ints per
 * chunk, which the header records (disk/gpusum.py); a copy (a tuple) or None, as a new
 * reference, or NULL with an exception. */
static PyObject *gpu_checksums_of(PyObject *share, Py_ssize_t s, Py_ssize_t size) {
    PyObject *sums = PyTuple_GET_ITEM(share, 12);
    if (sums == Py_None) return Py_NewRef(sums);
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
    return PyList_AsTuple(sums);
}

/* Share `s`'s columns (lists of one length, not empty for a write: its victims would be
 * left behind), copied; a new tuple (COL_*), or NULL with an exception. */
static PyObject *columns_of(PyObject *share, const share_shape *shape, Py_ssize_t s) {
    PyObject *digests = PyTuple_GET_ITEM(share, shape->digests),
             *buffers = PyTuple_GET_ITEM(share, shape->digests + 1),
             *keys = PyTuple_GET_ITEM(share, shape->digests + 2), *gpu, *cols;
    if (!PyList_Check(digests) || !PyList_Check(buffers) || !PyList_Check(keys) ||
        PyList_GET_SIZE(buffers) != PyList_GET_SIZE(digests) ||
        PyList_GET_SIZE(keys) != PyList_GET_SIZE(digests)) {
        PyErr_Format(PyExc_TypeError, "share %zd: %s must be lists of one length", s,
                     shape->columns);
        return NULL;
    }
    Py_ssize_t size = PyList_GET_SIZE(digests);
    if (shape == &WRITE_SHARE && size == 0) {
        PyErr_Format(PyExc_ValueError, "share %zd has no chunks", s);
        return NULL;
    }
    gpu = shape == &WRITE_SHARE ? gpu_checksums_of(share, s, size) : Py_NewRef(Py_None);
    if (gpu == NULL || (cols = PyTuple_New(4)) == NULL) {
        Py_XDECREF(gpu);
        return NULL;
    }
    PyTuple_SET_ITEM(cols, COL_GPU, gpu);
    for (int c = COL_DIGESTS; c <= COL_KEYS; c++) {
        PyObject *copy = PyList_AsTuple(PyTuple_GET_ITEM(share, shape->digests + c));
        if (copy == NULL) {
            Py_DECREF(cols);
            return NULL;
        }
        PyTuple_SET_ITEM(cols, c, copy);
    }
    return cols;
}

/* Chunk j's digest in share `s`, as its file names take it: lowercase hex (a str), two
 * characters or more per shard level; NULL with an exception if it is not. */
static const char *digest_text(PyObject *cols, Py_ssize_t s, Py_ssize_t j, int levels,
                               Py_ssize_t *len) {
    PyObject *o = PyTuple_GET_ITEM(PyTuple_GET_ITEM(cols, COL_DIGESTS), j);
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

/* Chunk j's digest, checked by shares_measure (its UTF-8 is kept with the str). */
static const char *digest_at(PyObject *cols, Py_ssize_t j, Py_ssize_t *len) {
    return PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(PyTuple_GET_ITEM(cols, COL_DIGESTS), j), len);
}

/* Chunk j's key in share `s` (bytes: a key may hold lone surrogates, format.text_bytes). */
static int key_at(PyObject *cols, Py_ssize_t s, Py_ssize_t j, const uint8_t **key,
                  size_t *len) {
    PyObject *o = PyTuple_GET_ITEM(PyTuple_GET_ITEM(cols, COL_KEYS), j);
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "share %zd: key %zd must be bytes, not %.100s", s, j,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *key = (const uint8_t *)PyBytes_AS_STRING(o);
    *len = (size_t)PyBytes_GET_SIZE(o);
    return 0;
}

/* Checks the shape, naming and columns of every share of `shares` (a tuple), copying the
 * columns into `columns` (a tuple as long), and each chunk's digest; counts the chunks (*n)
 * and the bytes of their names (*arena); 0, or -1 with an exception naming the share. */
static int shares_measure(PyObject *shares, const share_shape *shape, PyObject *columns,
                          Py_ssize_t *n, size_t *arena) {
    *n = 0;
    *arena = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(shares); s++) {
        PyObject *share = PyTuple_GET_ITEM(shares, s), *cols;
        naming nm;
        if (!PyTuple_Check(share) || PyTuple_GET_SIZE(share) != shape->fields) {
            PyErr_Format(PyExc_TypeError, "share %zd is not a tuple of %zd (a %s)", s,
                         shape->fields, shape->what);
            return -1;
        }
        if (naming_parse(share, shape, s, &nm) != 0 ||
            (cols = columns_of(share, shape, s)) == NULL)
            return -1;
        PyTuple_SET_ITEM(columns, s, cols);
        Py_ssize_t size = PyTuple_GET_SIZE(PyTuple_GET_ITEM(cols, COL_DIGESTS));
        /* the shard directory (prefix + 3 * levels - 1), then a read's "/" + file name,
         * a write's NUL, file name, NUL, temp name; each NUL-terminated */
        size_t dir = (size_t)nm.prefix_len + 3 * (size_t)nm.levels;
        for (Py_ssize_t j = 0; j < size; j++) {
            Py_ssize_t len;
            if (digest_text(cols, s, j, nm.levels, &len) == NULL) return -1;
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

/* A batch of the chunks of `shares` (a sequence of `shape`), checked and measured, with
 * room for their requests (reads) or jobs (writes), buffers and file names; NULL with an
 * exception. */
static py_batch *shares_batch(PyObject *shares, const share_shape *shape, int kind) {
    py_batch *p = calloc(1, sizeof(py_batch));
    if (p == NULL) return (py_batch *)PyErr_NoMemory();
    Py_ssize_t n;
    size_t arena;
    if ((p->shares = PySequence_Tuple(shares)) == NULL ||
        (p->columns = PyTuple_New(PyTuple_GET_SIZE(p->shares))) == NULL ||
        shares_measure(p->shares, shape, p->columns, &n, &arena) != 0) {
        batch_free(&p->b);
        return NULL;
    }
    size_t room = n ? (size_t)n : 1;
    p->b.kind = kind;
    p->b.n = (size_t)n;
    p->bufs = calloc(room, sizeof(Py_buffer));
    p->b.names = malloc(arena ? arena : 1);
    int failed = p->bufs == NULL || p->b.names == NULL;
    if (kind == BATCH_READ)
        failed = failed || (p->b.reqs = calloc(room, sizeof(chunk_read))) == NULL ||
                 posix_memalign((void **)&p->b.headers, CHUNK_ALIGNMENT,
                                room * CHUNK_HEADER_SIZE) != 0;
    else
        failed = failed || (p->b.jobs = calloc(room, sizeof(write_job))) == NULL;
    if (failed) {
        batch_free(&p->b);
        return (py_batch *)PyErr_NoMemory();
    }
    return p;
}

/* -- reads --------------------------------------------------------------------------------- */

/* A read call's chunks as shares, one per root, namespace and layout: each chunk's path
 * made here from its digest as RootLayout.chunk_rel makes it, the directory, "/" and the
 * file name; the chunks numbered share by share, in order. */
batch *read_batch_new(PyObject *shares, size_t task_size) {
    py_batch *p = shares_batch(shares, &READ_SHARE, BATCH_READ);
    if (p == NULL) return NULL;
    batch *b = &p->b;
    char *at = b->names;
    Py_ssize_t i = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(p->shares); s++) {
        PyObject *share = PyTuple_GET_ITEM(p->shares, s), *cols = PyTuple_GET_ITEM(p->columns, s);
        PyObject *dests = PyTuple_GET_ITEM(cols, COL_BUFFERS);
        chunk_read common = {.owner = b}; /* what the share's chunks share */
        unsigned long long payload_len;
        naming nm;
        const share_shape *shape = &READ_SHARE;
        if (naming_parse(share, shape, s, &nm) != 0 ||
            field_int(share, shape, s, 0, &common.root_fd) != 0 ||
            (common.direct = PyObject_IsTrue(PyTuple_GET_ITEM(share, 2))) < 0 ||
            field_u64(share, shape, s, 3, &payload_len) != 0 ||
            field_bytes(share, shape, s, 4, &common.meta, &common.meta_len) != 0)
            goto fail;
        common.payload_len = payload_len;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(dests); j++, i++) {
            chunk_read *r = &b->reqs[i];
            *r = common;
            Py_ssize_t len;
            const char *d = digest_at(cols, j, &len);
            if (d == NULL || key_at(cols, s, j, &r->key, &r->key_len) != 0 ||
                PyObject_GetBuffer(PyTuple_GET_ITEM(dests, j), &p->bufs[i], PyBUF_WRITABLE) != 0)
                goto fail;
            p->nbufs = i + 1;
            r->rel = at;
            at = put_shard_dir(at, &nm, d);
            *at++ = '/';
            at = put_file_name(at, &nm, d, len, 0);
            r->dest = p->bufs[i].buf;
            r->dest_len = (size_t)p->bufs[i].len;
            r->header = b->headers + (size_t)i * CHUNK_HEADER_SIZE;
            if (r->dest_len < payload_len) {
                PyErr_Format(PyExc_ValueError, "share %zd: destination %zd holds %zu bytes, "
                             "need %llu", s, j, r->dest_len, payload_len);
                goto fail;
            }
            b->npieces += chunk_read_piece_count(r, task_size);
        }
    }
    b->pieces = calloc(b->npieces ? b->npieces : 1, sizeof(chunk_piece));
    if (b->pieces == NULL) goto no_memory;
    chunk_piece *next = b->pieces;
    for (size_t k = 0; k < b->n; k++) {
        int planned = chunk_read_plan(&b->reqs[k], task_size, next);
        if (planned < 0) goto no_memory;
        next += planned;
    }
    atomic_store(&b->left, (long)b->n);
    return b;
no_memory:
    PyErr_NoMemory();
fail:
    batch_free(b);
    return NULL;
}

/* -- writes -------------------------------------------------------------------------------- */

/* Chunk j's GPU checksum, sums[j] (a tuple of them), into `w`; 0, or -1 with an
 * exception. */
static int gpu_checksum_set(chunk_write *w, PyObject *sums, Py_ssize_t s, Py_ssize_t j) {
    PyObject *pair = PyTuple_GET_ITEM(sums, j);
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
batch *write_batch_new(PyObject *shares) {
    py_batch *p = shares_batch(shares, &WRITE_SHARE, BATCH_WRITE);
    if (p == NULL) return NULL;
    batch *b = &p->b;
    char *at = b->names;
    Py_ssize_t i = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(p->shares); s++) {
        PyObject *share = PyTuple_GET_ITEM(p->shares, s), *cols = PyTuple_GET_ITEM(p->columns, s);
        PyObject *payloads = PyTuple_GET_ITEM(cols, COL_BUFFERS);
        PyObject *sums = PyTuple_GET_ITEM(cols, COL_GPU);
        chunk_write common = {.status = CHUNK_FAILED}; /* what the share's chunks share */
        int mode, dir_mode;
        naming nm;
        const share_shape *shape = &WRITE_SHARE;
        if (naming_parse(share, shape, s, &nm) != 0 ||
            field_int(share, shape, s, 0, &common.root_fd) != 0 ||
            field_bytes(share, shape, s, 2, &common.ns, &common.ns_len) != 0 ||
            field_bytes(share, shape, s, 3, &common.meta, &common.meta_len) != 0 ||
            (common.direct = PyObject_IsTrue(PyTuple_GET_ITEM(share, 4))) < 0 ||
            field_int(share, shape, s, 5, &mode) != 0 ||
            field_int(share, shape, s, 6, &dir_mode) != 0 ||
            field_int(share, shape, s, 7, &common.fsync_level) != 0 ||
            victims_set(&b->jobs[i], share, s) != 0)
            goto fail;
        common.mode = (mode_t)mode;
        common.dir_mode = (mode_t)dir_mode;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(payloads); j++, i++) {
            write_job *job = &b->jobs[i];
            chunk_write *w = &job->w;
            *w = common;
            Py_ssize_t len;
            const char *d = digest_at(cols, j, &len);
            if (d == NULL || key_at(cols, s, j, &w->key, &w->key_len) != 0 ||
                (sums != Py_None && gpu_checksum_set(w, sums, s, j) != 0) ||
                PyObject_GetBuffer(PyTuple_GET_ITEM(payloads, j), &p->bufs[i], PyBUF_SIMPLE) != 0)
                goto fail;
            p->nbufs = i + 1;
            w->dir_rel = at;
            at = put_shard_dir(at, &nm, d);
            *at++ = '\0';
            w->final_name = at;
            at = put_file_name(at, &nm, d, len, 0);
            w->tmp_name = at;
            at = put_file_name(at, &nm, d, len, 1);
            w->payload = p->bufs[i].buf;
            w->payload_len = (size_t)p->bufs[i].len;
            job->b = b;
        }
    }
    atomic_store(&b->left, (long)b->n);
    return b;
fail:
    batch_free(b);
    return NULL;
}

/* -- results ------------------------------------------------------------------------------- */

PyObject *batch_results(batch *b) {
    PyObject *statuses = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)b->n);
    PyObject *details = PyList_New(0);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; statuses && details && i < (Py_ssize_t)b->n; i++) {
        chunk_read *r = b->kind == BATCH_READ ? &b->reqs[i] : NULL;
        int status = r ? r->status : b->jobs[i].w.status;
        PyBytes_AS_STRING(statuses)[i] = (char)status;
        if (status == CHUNK_OK) continue;
        PyObject *item;
        if (r == NULL)
            item = Py_BuildValue("(nii)", i, status, b->jobs[i].w.error);
        else if (status == CHUNK_JUDGE)
            item = Py_BuildValue("(niy#K)", i, 0, (const char *)r->header,
                                 (Py_ssize_t)CHUNK_HEADER_SIZE,
                                 (unsigned long long)r->computed);
        else
            item = Py_BuildValue("(niOK)", i, atomic_load(&r->error), Py_None, 0ULL);
        if (item == NULL || PyList_Append(details, item) != 0) Py_CLEAR(details);
        Py_XDECREF(item);
    }
    if (statuses && details) result = Py_BuildValue("(OO)", statuses, details);
    Py_XDECREF(statuses);
    Py_XDECREF(details);
    batch_free(b);
    return result;
}

PyObject *batch_list_results(batch *done) {
    PyObject *out = PyList_New(0);
    while (done) {
        batch *b = done;
        done = b->next;
        PyObject *token = Py_NewRef(((py_batch *)b)->token);
        PyObject *results = batch_results(b);
        PyObject *item = results ? Py_BuildValue("(NN)", token, results) : NULL;
        if (results == NULL) Py_DECREF(token);
        if (item == NULL || out == NULL || PyList_Append(out, item) != 0)
            Py_CLEAR(out); /* the remaining batches are still freed */
        Py_XDECREF(item);
    }
    return out;
}
