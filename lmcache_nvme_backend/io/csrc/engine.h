/* The native engine's shared types: a batch of chunk reads or writes as the threads see it
 * (no Python object: batches.c keeps those beside it), and the engine's state (its queues,
 * threads and finished batches); the calls of workers.c, which runs batches without Python.
 */
#ifndef NVME_ENGINE_H
#define NVME_ENGINE_H

#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "chunkio.h"

#define MAX_WAIT_SIGNALS 16 /* eventfds one wait() may signal */

enum batch_kind { BATCH_READ, BATCH_WRITE };

struct batch;

/* One chunk to write; the first of a share also removes the files evicted for the share. */
typedef struct write_job {
    chunk_write w;
    const char **victims;
    size_t nvictims;
    struct batch *b;
    struct write_job *next;
} write_job;

typedef struct batch {
    size_t n; /* chunks, numbered share by share */
    int kind;
    chunk_read *reqs; /* reads: a request per chunk, with its header and its pieces */
    uint8_t *headers;
    chunk_piece *pieces;
    size_t npieces;
    write_job *jobs; /* writes: a job per chunk */
    char *names;     /* the chunks' file names, made from their digests */
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
 * Closing seals the stack (`incoming` becomes sealed, which refuses every later push): a
 * submitter that found the engine open can push after close() let the workers go, and a
 * batch pushed then would run on no thread and never come back.  A worker seals only once
 * stopped, with its queue and the stack empty under `mu`, and leaves only once it is sealed,
 * so every batch pushed before runs. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t done_cv; /* a batch finished */
    _Atomic(batch *) incoming;
    chunk_piece *head, *tail;
    write_job *whead, *wtail;
    batch *done_head, *done_tail;
    atomic_long async_pending;
    atomic_long reads_in_flight;
    atomic_int stop;
    /* per kind of worker, indexed by BATCH_READ and BATCH_WRITE */
    sem_t sem[2];
    atomic_int sleepers[2]; /* workers in (or entering) sem_wait */
    atomic_int waking[2];   /* of them, woken and not yet running */
    int nthreads[2];        /* created */
    int started[2];         /* running, their kernel ids recorded */
    pthread_t *threads;
    pid_t *tids; /* kernel thread ids: readers first, then writers */
    size_t task_size;
    chunk_pool *pool; /* removed chunk files kept for writes of their size (or NULL) */
} engine;

/* Starts `threads` readers and `write_threads` writers (nice 10) on a zeroed engine, which
 * takes `pool`: 0, or an errno (the threads started so far run until engine_stop). */
int engine_start(engine *e, int threads, int write_threads, size_t task_size,
                 chunk_pool *pool);
/* Whether it runs and takes batches (a quick refusal; the push has the last word). */
int engine_open(engine *e);
/* The kernel ids of its threads (*count of them), once every one has started. */
const pid_t *engine_thread_ids(engine *e, int *count);

/* Runs a read batch on the readers, the calling thread helping, until it is done; -1 when
 * the engine is closed (the batch is not taken). */
int engine_read(engine *e, batch *b);
/* Takes an asynchronous batch, which comes back from engine_wait_done: the number of
 * workers to wake for it (engine_wake), or -1 when the engine is closed (the batch is not
 * taken).  A batch of no chunk is finished at once.  Nothing of the batch may be read after
 * (it may be finished and taken already). */
int engine_submit(engine *e, batch *b);
/* Whether waking `count` workers of `kind` wakes one that sleeps (a system call): those
 * then count as being woken, so the next submission does not release the GIL for them. */
int engine_wakes_sleeper(engine *e, int kind, int count);
void engine_wake(engine *e, int kind, int count);
/* Queued writes not started yet end as ECANCELED; how many. */
long engine_cancel_writes(engine *e);

/* The finished asynchronous batches (a list through `next`), or NULL; never waits long. */
batch *engine_take_done(engine *e);
/* Waits up to `timeout` seconds for finished batches; sets *closed when the engine is
 * closed and drained (nothing more will come back). */
batch *engine_wait_done(engine *e, double timeout, int *closed);
/* Adds 1 to each eventfd (a full counter, EAGAIN, already signals): a system call that may
 * cost a VM tens of microseconds, so the binding makes it without the GIL. */
void engine_signal_eventfds(const int *fds, size_t n);

/* Lets the threads finish the queued work, joins them, and removes the pool's files; only
 * the first caller does (two would join each thread twice), the others return at once:
 * engine_wait_done tells when all is drained. */
void engine_stop(engine *e);
/* Frees what engine_start made, the pool included (stopped, finished batches taken). */
void engine_destroy(engine *e);

#endif
