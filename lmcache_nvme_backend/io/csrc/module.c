/* lmcache_nvme_backend.io._native: batches of chunk reads and writes, run without the GIL.
 *
 * Python decides per batch (which files, which buffers, what to expect); this module runs
 * the per-chunk loop (chunkio.c) on its own threads and gives each batch back whole.  A
 * batch costs the interpreter one release and re-acquire of the GIL: `read` and `write`
 * release it once for the whole batch; `submit_read` does not release it at all, and one
 * `wait` (which releases it once) can hand back several finished batches.
 *
 * Engine(threads, task_size):
 *   read(items) -> (statuses, details)        blocking; the caller helps the workers
 *   submit_read(items, token)                 asynchronous; the batch comes back from wait
 *   wait(timeout_s) -> [(token, statuses, details)], or None once closed and drained
 *   write(items) -> (statuses, details)       blocking, on the calling thread
 *   close()
 * read item:  (root_fd, rel, dest, payload_len, direct, key, meta)
 * write item: (root_fd, dir_rel, tmp_name, final_name, payload, key, namespace, meta,
 *              gpu_checksum or None, direct, mode, fsync_level)
 * statuses: bytes, one chunk_status per item; details: for every item not CHUNK_OK,
 *   reads (index, errno, header or None, computed checksum), writes (index, status, errno).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chunkio.h"
#include "xxh3.h"

static _Atomic uint64_t gil_releases;

#define RELEASE_GIL_BEGIN                          \
    atomic_fetch_add(&gil_releases, 1);            \
    Py_BEGIN_ALLOW_THREADS
#define RELEASE_GIL_END Py_END_ALLOW_THREADS

typedef struct batch {
    PyObject *items; /* a tuple of tuples: keeps every string the requests point into */
    PyObject *token;
    Py_ssize_t n;
    chunk_read *reqs;
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    uint8_t *headers;
    chunk_piece *pieces;
    size_t npieces;
    atomic_long left;
    int async;
    struct batch *next;
} batch;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    pthread_cond_t done_cv;
    chunk_piece *head, *tail;
    batch *done_head, *done_tail;
    long async_pending;
    int stop;
    int nthreads;
    pthread_t *threads;
    size_t task_size;
} Engine;

/* -- batches ----------------------------------------------------------------------------- */

static void batch_free(batch *b) {
    for (Py_ssize_t i = 0; i < b->nbufs; i++) PyBuffer_Release(&b->bufs[i]);
    if (b->reqs)
        for (Py_ssize_t i = 0; i < b->n; i++) chunk_read_free(&b->reqs[i]);
    free(b->reqs);
    free(b->bufs);
    free(b->headers);
    free(b->pieces);
    Py_XDECREF(b->items);
    Py_XDECREF(b->token);
    free(b);
}

static batch *batch_new(Engine *self, PyObject *items) {
    batch *b = calloc(1, sizeof(batch));
    if (b == NULL) return (batch *)PyErr_NoMemory();
    b->items = PySequence_Tuple(items);
    if (b->items == NULL) goto fail;
    b->n = PyTuple_GET_SIZE(b->items);
    b->reqs = calloc(b->n ? b->n : 1, sizeof(chunk_read));
    b->bufs = calloc(b->n ? b->n : 1, sizeof(Py_buffer));
    if (b->reqs == NULL || b->bufs == NULL ||
        posix_memalign((void **)&b->headers, CHUNK_ALIGNMENT,
                       (size_t)(b->n ? b->n : 1) * CHUNK_HEADER_SIZE) != 0) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        chunk_read *r = &b->reqs[i];
        unsigned long long payload_len;
        Py_ssize_t key_len, meta_len;
        const char *rel, *key, *meta;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(b->items, i), "iyw*Kpy#y#;a read item is "
                              "(root_fd, rel, dest, payload_len, direct, key, meta)",
                              &r->root_fd, &rel, &b->bufs[i], &payload_len, &r->direct, &key,
                              &key_len, &meta, &meta_len))
            goto fail;
        b->nbufs = i + 1;
        r->rel = rel;
        r->dest = b->bufs[i].buf;
        r->dest_len = (size_t)b->bufs[i].len;
        r->payload_len = payload_len;
        r->key = (const uint8_t *)key;
        r->key_len = (size_t)key_len;
        r->meta = (const uint8_t *)meta;
        r->meta_len = (size_t)meta_len;
        r->header = b->headers + (size_t)i * CHUNK_HEADER_SIZE;
        r->owner = b;
        if (r->dest_len < payload_len) {
            PyErr_Format(PyExc_ValueError, "destination %zd holds %zu bytes, need %llu", i,
                         r->dest_len, payload_len);
            goto fail;
        }
        b->npieces += chunk_read_piece_count(r, self->task_size);
    }
    b->pieces = calloc(b->npieces ? b->npieces : 1, sizeof(chunk_piece));
    if (b->pieces == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t at = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        int planned = chunk_read_plan(&b->reqs[i], self->task_size, b->pieces + at);
        if (planned < 0) {
            PyErr_NoMemory();
            goto fail;
        }
        at += (size_t)planned;
    }
    atomic_store(&b->left, (long)b->n);
    return b;
fail:
    batch_free(b);
    return NULL;
}

/* (statuses, details) of a finished read batch; frees it. */
static PyObject *batch_results(batch *b) {
    PyObject *statuses = PyBytes_FromStringAndSize(NULL, b->n);
    PyObject *details = PyList_New(0);
    if (statuses == NULL || details == NULL) goto fail;
    char *out = PyBytes_AS_STRING(statuses);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        chunk_read *r = &b->reqs[i];
        out[i] = (char)r->status;
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
            goto fail;
        }
        Py_DECREF(item);
    }
    batch_free(b);
    return Py_BuildValue("(NN)", statuses, details);
fail:
    Py_XDECREF(statuses);
    Py_XDECREF(details);
    batch_free(b);
    return NULL;
}

/* -- the pool ------------------------------------------------------------------------------ */

static void batch_request_done(Engine *self, batch *b) {
    if (atomic_fetch_sub(&b->left, 1) != 1) return;
    pthread_mutex_lock(&self->mu);
    if (b->async) {
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

/* Called with mu held. */
static chunk_piece *pop_piece(Engine *self) {
    chunk_piece *p = self->head;
    if (p) {
        self->head = p->next;
        if (self->head == NULL) self->tail = NULL;
    }
    return p;
}

static void enqueue(Engine *self, batch *b) {
    pthread_mutex_lock(&self->mu);
    for (size_t i = 0; i < b->npieces; i++) {
        chunk_piece *p = &b->pieces[i];
        p->next = NULL;
        if (self->tail) self->tail->next = p;
        else self->head = p;
        self->tail = p;
    }
    if (b->npieces > 1) pthread_cond_broadcast(&self->work_cv);
    else pthread_cond_signal(&self->work_cv);
    pthread_mutex_unlock(&self->mu);
}

static void *worker_main(void *arg) {
    Engine *self = arg;
    pthread_setname_np(pthread_self(), "nvme-native-io");
    pthread_mutex_lock(&self->mu);
    for (;;) {
        while (self->head == NULL && !self->stop) pthread_cond_wait(&self->work_cv, &self->mu);
        chunk_piece *p = pop_piece(self);
        if (p == NULL) break; /* stopped and drained */
        pthread_mutex_unlock(&self->mu);
        run_piece(self, p);
        pthread_mutex_lock(&self->mu);
    }
    pthread_mutex_unlock(&self->mu);
    return NULL;
}

/* The calling thread runs queued pieces (its own or others') until its batch is done. */
static void help_until_done(Engine *self, batch *b) {
    pthread_mutex_lock(&self->mu);
    while (atomic_load(&b->left) > 0) {
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
    static char *names[] = {"threads", "task_size", NULL};
    int threads;
    Py_ssize_t task_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in", names, &threads, &task_size)) return -1;
    if (threads < 1 || task_size < CHUNK_ALIGNMENT || task_size % CHUNK_ALIGNMENT) {
        PyErr_SetString(PyExc_ValueError, "threads must be >= 1 and task_size a positive "
                                          "multiple of 4096");
        return -1;
    }
    if (self->threads) {
        PyErr_SetString(PyExc_RuntimeError, "Engine already initialised");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work_cv, NULL);
    pthread_cond_init(&self->done_cv, NULL);
    self->task_size = (size_t)task_size;
    self->threads = calloc((size_t)threads, sizeof(pthread_t));
    if (self->threads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < threads; i++) {
        int err = pthread_create(&self->threads[i], NULL, worker_main, self);
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->nthreads = i + 1;
    }
    return 0;
}

static int engine_open(Engine *self) {
    if (self->threads == NULL || self->stop) {
        PyErr_SetString(PyExc_RuntimeError, "the native I/O engine is closed");
        return 0;
    }
    return 1;
}

static PyObject *Engine_read(Engine *self, PyObject *items) {
    if (!engine_open(self)) return NULL;
    batch *b = batch_new(self, items);
    if (b == NULL) return NULL;
    if (b->n) {
        RELEASE_GIL_BEGIN
        enqueue(self, b);
        help_until_done(self, b);
        RELEASE_GIL_END
    }
    return batch_results(b);
}

static PyObject *Engine_submit_read(Engine *self, PyObject *args) {
    PyObject *items, *token;
    if (!PyArg_ParseTuple(args, "OO", &items, &token)) return NULL;
    if (!engine_open(self)) return NULL;
    batch *b = batch_new(self, items);
    if (b == NULL) return NULL;
    b->async = 1;
    Py_INCREF(token);
    b->token = token;
    pthread_mutex_lock(&self->mu); /* held briefly by workers only: never waits on the GIL */
    self->async_pending++;
    pthread_mutex_unlock(&self->mu);
    if (b->n == 0) {
        atomic_store(&b->left, 1);
        batch_request_done(self, b);
    } else {
        enqueue(self, b);
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_wait(Engine *self, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    batch *done = NULL;
    int closed = 0;
    if (self->threads == NULL) Py_RETURN_NONE;
    RELEASE_GIL_BEGIN
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)timeout;
    until.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&self->mu);
    while (self->done_head == NULL && !(self->stop && self->async_pending == 0)) {
        if (pthread_cond_timedwait(&self->done_cv, &self->mu, &until) == ETIMEDOUT) break;
    }
    done = self->done_head;
    self->done_head = self->done_tail = NULL;
    for (batch *b = done; b; b = b->next) self->async_pending--;
    closed = done == NULL && self->stop && self->async_pending == 0;
    pthread_mutex_unlock(&self->mu);
    RELEASE_GIL_END
    if (closed) Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    while (done) {
        batch *b = done;
        done = b->next;
        PyObject *token = b->token;
        Py_INCREF(token);
        PyObject *results = batch_results(b);
        PyObject *item = results ? Py_BuildValue("(NN)", token, results) : NULL;
        if (item == NULL || out == NULL || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            Py_XDECREF(out);
            out = NULL;
            continue; /* still free the remaining batches */
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *Engine_write(Engine *self, PyObject *items) {
    if (!engine_open(self)) return NULL;
    PyObject *tuple = PySequence_Tuple(items);
    if (tuple == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tuple), parsed = 0;
    chunk_write *jobs = calloc(n ? (size_t)n : 1, sizeof(chunk_write));
    Py_buffer *bufs = calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    if (jobs == NULL || bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        chunk_write *j = &jobs[i];
        Py_ssize_t key_len, ns_len, meta_len;
        const char *key, *ns, *meta;
        PyObject *gpu;
        int mode;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(tuple, i), "iyyyy*y#y#y#Opii;a write item is "
                              "(root_fd, dir_rel, tmp_name, final_name, payload, key, "
                              "namespace, meta, gpu_checksum, direct, mode, fsync_level)",
                              &j->root_fd, &j->dir_rel, &j->tmp_name, &j->final_name, &bufs[i],
                              &key, &key_len, &ns, &ns_len, &meta, &meta_len, &gpu, &j->direct,
                              &mode, &j->fsync_level))
            goto done;
        parsed = i + 1;
        j->payload = bufs[i].buf;
        j->payload_len = (size_t)bufs[i].len;
        j->key = (const uint8_t *)key;
        j->key_len = (size_t)key_len;
        j->ns = (const uint8_t *)ns;
        j->ns_len = (size_t)ns_len;
        j->meta = (const uint8_t *)meta;
        j->meta_len = (size_t)meta_len;
        j->mode = (mode_t)mode;
        if (gpu != Py_None) {
            unsigned long long a, b;
            if (!PyArg_ParseTuple(gpu, "KK;gpu_checksum is None or (a, b)", &a, &b)) goto done;
            j->has_gpu_checksum = 1;
            j->gpu_checksum[0] = a;
            j->gpu_checksum[1] = b;
        }
    }
    if (n) {
        size_t task_size = self->task_size;
        RELEASE_GIL_BEGIN
        for (Py_ssize_t i = 0; i < n; i++) chunk_write_run(&jobs[i], task_size);
        RELEASE_GIL_END
    }
    PyObject *statuses = PyBytes_FromStringAndSize(NULL, n);
    PyObject *details = PyList_New(0);
    if (statuses == NULL || details == NULL) {
        Py_XDECREF(statuses);
        Py_XDECREF(details);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBytes_AS_STRING(statuses)[i] = (char)jobs[i].status;
        if (jobs[i].status == CHUNK_OK) continue;
        PyObject *item = Py_BuildValue("(nii)", i, jobs[i].status, jobs[i].error);
        if (item == NULL || PyList_Append(details, item) != 0) {
            Py_XDECREF(item);
            Py_DECREF(statuses);
            Py_DECREF(details);
            goto done;
        }
        Py_DECREF(item);
    }
    result = Py_BuildValue("(NN)", statuses, details);
done:
    for (Py_ssize_t i = 0; i < parsed; i++) PyBuffer_Release(&bufs[i]);
    free(jobs);
    free(bufs);
    Py_DECREF(tuple);
    return result;
}

static void engine_stop(Engine *self) {
    if (self->threads == NULL || self->stop) return;
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_broadcast(&self->work_cv);
    pthread_cond_broadcast(&self->done_cv);
    pthread_mutex_unlock(&self->mu);
    for (int i = 0; i < self->nthreads; i++) pthread_join(self->threads[i], NULL);
}

static PyObject *Engine_close(Engine *self, PyObject *Py_UNUSED(ignored)) {
    /* queued pieces finish first; finished asynchronous batches stay for wait() */
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
    if (self->threads) {
        free(self->threads);
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->work_cv);
        pthread_cond_destroy(&self->done_cv);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Engine_methods[] = {
    {"read", (PyCFunction)Engine_read, METH_O,
     "read(items) -> (statuses, details): read and verify a batch, waiting for it."},
    {"submit_read", (PyCFunction)Engine_submit_read, METH_VARARGS,
     "submit_read(items, token): start a batch; wait() returns it with its token."},
    {"wait", (PyCFunction)Engine_wait, METH_VARARGS,
     "wait(timeout_s) -> [(token, statuses, details)], or None once closed and drained."},
    {"write", (PyCFunction)Engine_write, METH_O,
     "write(items) -> (statuses, details): write and publish a batch of chunk files."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "close(): finish queued reads and stop the threads."},
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
    return Py_BuildValue("{sKsKsK}", "gil_releases",
                         (unsigned long long)atomic_load(&gil_releases), "hash_cpu_ns",
                         (unsigned long long)atomic_load(&chunkio_hash_cpu_ns), "hashed_bytes",
                         (unsigned long long)atomic_load(&chunkio_hashed_bytes));
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
    {"encode_header", py_encode_header, METH_VARARGS,
     "encode_header(key, namespace, meta, payload_len, checksum, created_ns, gpu_checksum)"
     " -> bytes: a chunk header as the native writer builds it."},
    {"counters", py_counters, METH_NOARGS,
     "counters() -> dict: GIL releases, hashing CPU nanoseconds and bytes hashed."},
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
        PyModule_AddIntConstant(m, "NEED_DIR", CHUNK_NEED_DIR) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
