/* lmcache_nvme_backend.io._native: batches of chunk reads and writes, run without the GIL.
 *
 * Python decides per batch (which files, which buffers, what to expect); this module runs
 * the per-chunk loop (chunkio.c) on its own threads (workers.c) and gives each batch back
 * whole (batches.c makes a batch of shares and its outcome; this file is the binding).  A
 * batch costs the interpreter at most one release and re-acquire of the GIL: `read_shares`
 * releases it once for the whole batch; `submit_read_shares` and `submit_shares` release
 * it only to wake sleeping workers, and one `wait` (which releases it only when nothing has
 * finished yet, or to signal the eventfds the previous batches' callbacks left to it) hands
 * back every batch finished by then.
 *
 * Engine(threads, write_threads, task_size, recycle_bytes=0, recycle_suffix=None):
 *   recycle_bytes: up to this many bytes of removed chunk files (unlink, a write's victims)
 *   are kept, renamed <name><recycle_suffix> in their directory, and overwritten in place
 *   by later writes of their size (pool.h); close() removes the rest.  The methods'
 *   docstrings say what each takes and gives.
 *
 * A batch is a sequence of shares, the two shapes of io/engine.py (ReadShare, WriteShare;
 * their fields are listed in batches.c): the chunks of one root in one namespace and
 * layout, what is common said once, then columns; each chunk's file names are made from
 * its digest and the share's naming; its chunks are numbered share by share, in order.
 * Its outcome is (statuses, details): statuses bytes, one chunk_status per chunk; details,
 * for every chunk not CHUNK_OK, reads (index, errno, header or None, computed checksum),
 * writes (index, status, errno).
 */
#include "batches.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "chunkio.h"
#include "engine.h"
#include "xxh3.h"

static _Atomic uint64_t gil_releases;
static _Atomic uint64_t wake_releases; /* of which: to wake sleeping workers */

#define RELEASE_GIL_BEGIN               \
    atomic_fetch_add(&gil_releases, 1); \
    Py_BEGIN_ALLOW_THREADS
#define RELEASE_GIL_END Py_END_ALLOW_THREADS

typedef struct {
    PyObject_HEAD
    engine e;
} Engine;

static PyObject *closed_error(void) {
    PyErr_SetString(PyExc_RuntimeError, "the native I/O engine is closed");
    return NULL;
}

/* -- Engine methods ----------------------------------------------------------------------- */

static int Engine_init(Engine *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"threads", "write_threads", "task_size", "recycle_bytes",
                            "recycle_suffix", NULL};
    int threads, write_threads;
    Py_ssize_t task_size;
    unsigned long long recycle_bytes = 0;
    const char *recycle_suffix = NULL;
    chunk_pool *pool = NULL;
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
    if (self->e.threads) {
        PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
        return -1;
    }
    if (recycle_bytes && (pool = chunk_pool_new(recycle_suffix, recycle_bytes)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int err = engine_start(&self->e, threads, write_threads, (size_t)task_size, pool);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *Engine_thread_ids(Engine *self, PyObject *Py_UNUSED(ignored)) {
    int total;
    const pid_t *tids = engine_thread_ids(&self->e, &total);
    PyObject *out = PyList_New(total);
    for (int i = 0; out && i < total; i++)
        PyList_SET_ITEM(out, i, PyLong_FromLong((long)tids[i]));
    return out;
}

/* A quick refusal before a batch is built; the push has the last word. */
static int engine_taking(Engine *self) {
    if (engine_open(&self->e)) return 1;
    closed_error();
    return 0;
}

static PyObject *Engine_read_shares(Engine *self, PyObject *shares) {
    if (!engine_taking(self)) return NULL;
    batch *b = read_batch_new(shares, self->e.task_size);
    if (b == NULL) return NULL;
    int run = 0;
    if (b->n) { /* an empty batch costs no release */
        RELEASE_GIL_BEGIN
        run = engine_read(&self->e, b);
        RELEASE_GIL_END
    }
    if (run < 0) {
        batch_free(b);
        return closed_error();
    }
    return batch_results(b);
}

/* Hands an asynchronous batch of `kind` to the threads; it comes back from wait() with its
 * token.  Waking a worker that sleeps is a system call, made without the GIL (engine.h). */
static PyObject *submit(Engine *self, PyObject *args, int kind) {
    PyObject *shares, *token;
    if (!PyArg_ParseTuple(args, "OO", &shares, &token) || !engine_taking(self)) return NULL;
    batch *b = kind == BATCH_READ ? read_batch_new(shares, self->e.task_size)
                                  : write_batch_new(shares);
    if (b == NULL) return NULL;
    batch_set_token(b, token);
    int count = engine_submit(&self->e, b); /* b is not read once submitted */
    if (count < 0) {
        batch_free(b);
        return closed_error();
    }
    if (count > 0 && engine_wakes_sleeper(&self->e, kind, count)) {
        atomic_fetch_add(&wake_releases, 1);
        RELEASE_GIL_BEGIN
        engine_wake(&self->e, kind, count);
        RELEASE_GIL_END
    } else {
        engine_wake(&self->e, kind, count);
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_submit_read_shares(Engine *self, PyObject *args) {
    return submit(self, args, BATCH_READ);
}

static PyObject *Engine_submit_shares(Engine *self, PyObject *args) {
    return submit(self, args, BATCH_WRITE);
}

static PyObject *Engine_cancel_writes(Engine *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(engine_cancel_writes(&self->e));
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
    if (self->e.threads == NULL) {
        engine_signal_eventfds(fds, (size_t)nsignals);
        Py_RETURN_NONE;
    }
    /* batches already finished are taken without letting go of the GIL (the workers hold
     * the engine's mutex only for moments), unless there are eventfds to signal: then one
     * release serves both */
    batch *done = nsignals == 0 ? engine_take_done(&self->e) : NULL;
    if (done == NULL) {
        RELEASE_GIL_BEGIN
        engine_signal_eventfds(fds, (size_t)nsignals);
        done = engine_wait_done(&self->e, timeout, &closed);
        RELEASE_GIL_END
    }
    if (closed) Py_RETURN_NONE;
    return batch_list_results(done);
}

static PyObject *Engine_unlink(Engine *self, PyObject *items) {
    PyObject *tuple = PySequence_Tuple(items);
    if (tuple == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    struct { int fd; const char *rel; int error; } *todo = calloc(n ? (size_t)n : 1, sizeof(*todo));
    PyObject *result = NULL;
    if (todo == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(tuple, i), "is;an unlink item is (root_fd, rel)",
                              &todo[i].fd, &todo[i].rel))
            goto done;
    if (n) {
        RELEASE_GIL_BEGIN
        for (Py_ssize_t i = 0; i < n; i++)
            todo[i].error = chunk_unlink(self->e.pool, todo[i].fd, todo[i].rel);
        RELEASE_GIL_END
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i++)
        PyList_SET_ITEM(result, i, PyLong_FromLong(todo[i].error));
done:
    free(todo);
    Py_DECREF(tuple);
    return result;
}

static PyObject *Engine_close(Engine *self, PyObject *Py_UNUSED(ignored)) {
    /* queued work finishes first; finished asynchronous batches stay for wait() */
    RELEASE_GIL_BEGIN
    engine_stop(&self->e);
    RELEASE_GIL_END
    Py_RETURN_NONE;
}

static void Engine_dealloc(Engine *self) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(&self->e);
    Py_END_ALLOW_THREADS
    for (batch *b = engine_take_done(&self->e), *next; b; b = next) {
        next = b->next;
        batch_free(b);
    }
    engine_destroy(&self->e);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_retired_bytes(Engine *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(chunk_pool_bytes(self->e.pool));
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
     "wait(timeout_s, signals=()) -> [(token, (statuses, details))], or None once closed and "
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

static PyObject *py_xxh3_64(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) return NULL;
    uint64_t h = xxh3_64(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_memory_view(PyObject *Py_UNUSED(mod), PyObject *args) {
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

static PyObject *py_encode_header(PyObject *Py_UNUSED(mod), PyObject *args) {
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

static PyObject *py_counters(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue(
        "{sKsKsKsKsKsKsK}",
        "gil_releases", (unsigned long long)atomic_load(&gil_releases),
        "wake_releases", (unsigned long long)atomic_load(&wake_releases),
        "hashed_bytes", (unsigned long long)atomic_load(&chunkio_hashed_bytes),
        "hash_sampled_ns", (unsigned long long)atomic_load(&chunkio_hash_sampled_ns),
        "hash_sampled_bytes", (unsigned long long)atomic_load(&chunkio_hash_sampled_bytes),
        "overlapped_writes", (unsigned long long)atomic_load(&chunkio_overlapped_writes),
        "recycled_writes", (unsigned long long)atomic_load(&chunkio_recycled_writes));
}

/* The cycle collector stops tracking each object (if it did): for objects that can never be
 * part of a reference cycle and live long in great numbers (the store's index and its
 * entries), which every full collection would otherwise visit while holding the GIL. */
static PyObject *py_gc_untrack(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    for (Py_ssize_t i = 0; i < nargs; i++)
        if (PyObject_IS_GC(args[i])) PyObject_GC_UnTrack(args[i]);
    Py_RETURN_NONE;
}

static const char *SIMD_NAMES[] = {"scalar", "sse2", "avx2"};
static int simd_in_use;

static PyObject *py_simd(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_FromString(SIMD_NAMES[simd_in_use]);
}

static PyObject *py_select_simd(PyObject *Py_UNUSED(mod), PyObject *arg) {
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
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "Chunk reads and writes in batches on native threads, without the GIL.",
    .m_size = -1,
    .m_methods = module_methods,
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
