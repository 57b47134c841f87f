/* Batches from and back to Python: a list of shares (io/engine.py) parsed into one batch of
 * the engine's requests, each chunk's file names made from its digest, and a finished
 * batch's outcome built as Python objects.  Every call holds the GIL. */
#ifndef NVME_BATCHES_H
#define NVME_BATCHES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "engine.h"

/* A read batch of `shares` (a sequence of read shares), its requests split into pieces of
 * at most `task_size` bytes; NULL with an exception (nothing held) when one is malformed. */
batch *read_batch_new(PyObject *shares, size_t task_size);
/* A write batch of `shares` (a sequence of write shares); NULL with an exception (nothing
 * held) when one is malformed. */
batch *write_batch_new(PyObject *shares);
/* The token an asynchronous batch is handed back with (a new reference is kept). */
void batch_set_token(batch *b, PyObject *token);
/* (statuses, details) of a finished batch, or NULL with an exception; frees it. */
PyObject *batch_results(batch *b);
/* [(token, (statuses, details))] of a list of finished batches (through `next`), or NULL
 * with an exception; frees them all. */
PyObject *batch_list_results(batch *done);
/* Lets go of everything the batch holds (buffers, objects, memory). */
void batch_free(batch *b);

#endif
