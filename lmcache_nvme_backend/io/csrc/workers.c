/* The native engine's queues and threads: batches handed over without waiting, their
 * chunks run by reader and writer threads, and the batches handed back once finished.  No
 * Python here: the binding (module.c) lets go of the GIL around the calls that may wait or
 * make a system call (engine.h). */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WRITER_NICE 10
#define WRITERS_YIELD_S 0.05 /* a write waits at most this long for reads in flight */

static batch sealed_marker;
#define SEALED (&sealed_marker)

/* The CLOCK_REALTIME time `seconds` from now (as pthread's timed waits take it). */
static struct timespec seconds_from_now(double seconds) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)seconds;
    until.tv_nsec += (long)((seconds - (double)(time_t)seconds) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    return until;
}

/* -- the queues ---------------------------------------------------------------------------- */

/* One request of `b` ended.  The thread that ends the last one of a synchronous batch must
 * not read `b` after its decrement: the caller of engine_read may see `left` reach 0, free
 * the batch, and another batch may be allocated in its memory (a write batch taken for this
 * one would come back finished before its writes ran). */
static void batch_request_done(engine *e, batch *b) {
    int reading = b->kind == BATCH_READ, async = b->async;
    if (atomic_fetch_sub(&b->left, 1) != 1) return;
    if (reading) atomic_fetch_sub(&e->reads_in_flight, 1);
    pthread_mutex_lock(&e->mu);
    if (async) {
        b->next = NULL;
        if (e->done_tail) e->done_tail->next = b;
        else e->done_head = b;
        e->done_tail = b;
    }
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

static void run_piece(engine *e, chunk_piece *p) {
    if (chunk_read_run(p)) batch_request_done(e, (batch *)p->req->owner);
}

static void run_write(engine *e, write_job *job) {
    for (size_t v = 0; v < job->nvictims; v++)
        chunk_unlink(e->pool, job->w.root_fd, job->victims[v]);
    job->w.pool = e->pool;
    chunk_write_run(&job->w, e->task_size);
    batch_request_done(e, job->b);
}

/* Pushes a batch without waiting (see engine.h): the workers to wake for it, or -1 when
 * closed.  Nothing of it is read once pushed: it may be finished and freed already. */
static int push_batch(engine *e, batch *b) {
    int reading = b->kind == BATCH_READ;
    size_t work = reading ? b->npieces : b->n;
    int threads = e->nthreads[b->kind];
    if (reading) atomic_fetch_add(&e->reads_in_flight, 1);
    batch *top = atomic_load(&e->incoming);
    do {
        if (top == SEALED) {
            if (reading) atomic_fetch_sub(&e->reads_in_flight, 1);
            return -1;
        }
        b->incoming = top;
    } while (!atomic_compare_exchange_weak(&e->incoming, &top, b));
    return work < (size_t)threads ? (int)work : threads;
}

/* Moves submitted batches into the FIFO queues, oldest first.  Called with mu held. */
static void drain_incoming(engine *e) {
    batch *stack = atomic_load(&e->incoming), *fifo = NULL;
    while (stack && stack != SEALED &&
           !atomic_compare_exchange_weak(&e->incoming, &stack, NULL)) {}
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
                if (e->tail) e->tail->next = p;
                else e->head = p;
                e->tail = p;
            }
        } else {
            for (size_t i = 0; i < b->n; i++) {
                write_job *j = &b->jobs[i];
                j->next = NULL;
                if (e->wtail) e->wtail->next = j;
                else e->whead = j;
                e->wtail = j;
            }
        }
    }
}

/* The next read piece.  Called with mu held. */
static chunk_piece *pop_piece(engine *e) {
    chunk_piece *p = e->head;
    if (p) {
        e->head = p->next;
        if (e->head == NULL) e->tail = NULL;
    }
    return p;
}

/* The next write job.  Called with mu held. */
static write_job *pop_write(engine *e) {
    write_job *j = e->whead;
    if (j) {
        e->whead = j->next;
        if (e->whead == NULL) e->wtail = NULL;
    }
    return j;
}

/* Whether a stopped worker whose queue is empty may leave: it seals the empty stack (or
 * finds it sealed), after which nothing can be pushed; a wait then may see the engine
 * drained.  Called with mu held, so no batch is between the stack and a queue.  A stopped
 * worker that may not leave (a batch was pushed after its drain) goes round again rather
 * than sleep: the batch's posts may be for the other workers, and engine_stop posts only
 * once. */
static int may_leave(engine *e) {
    if (!atomic_load(&e->stop)) return 0;
    batch *empty = NULL;
    if (!atomic_compare_exchange_strong(&e->incoming, &empty, SEALED) && empty != SEALED)
        return 0;
    pthread_cond_broadcast(&e->done_cv);
    return 1;
}

/* -- the threads --------------------------------------------------------------------------- */

/* Records the calling thread's kernel id (readers first in `tids`, then writers), and
 * makes it a batch thread: waking it never preempts the thread that woke it (SCHED_BATCH,
 * same share of the CPU otherwise), so a submitter that holds the GIL keeps running. */
static void thread_started(engine *e, int kind) {
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &none);
    pthread_mutex_lock(&e->mu);
    int slot = (kind == BATCH_WRITE ? e->nthreads[BATCH_READ] : 0) + e->started[kind]++;
    e->tids[slot] = (pid_t)syscall(SYS_gettid);
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

/* A reader runs read pieces, a writer write jobs, until the engine is stopped and drained. */
static void worker(engine *e, int kind) {
    int writer = kind == BATCH_WRITE;
    pthread_setname_np(pthread_self(), writer ? "nvme-native-wr" : "nvme-native-rd");
    /* background work: never take a core from the inference engine (a thread's own nice) */
    if (writer) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), WRITER_NICE);
    thread_started(e, kind);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        drain_incoming(e);
        chunk_piece *p = writer ? NULL : pop_piece(e);
        write_job *j = writer ? pop_write(e) : NULL;
        int leave = p == NULL && j == NULL && may_leave(e);
        if (j && atomic_load(&e->reads_in_flight) > 0 && !atomic_load(&e->stop)) {
            struct timespec until = seconds_from_now(WRITERS_YIELD_S); /* reads go first */
            while (atomic_load(&e->reads_in_flight) > 0 && !atomic_load(&e->stop))
                if (pthread_cond_timedwait(&e->done_cv, &e->mu, &until) == ETIMEDOUT) break;
        }
        pthread_mutex_unlock(&e->mu);
        if (p) {
            run_piece(e, p);
        } else if (j) {
            run_write(e, j);
        } else if (leave) {
            break; /* stopped and drained */
        } else if (!atomic_load(&e->stop)) { /* stopped: never sleeps (see may_leave) */
            atomic_fetch_add(&e->sleepers[kind], 1);
            while (sem_wait(&e->sem[kind]) != 0 && errno == EINTR) {}
            atomic_fetch_sub(&e->sleepers[kind], 1);
            int w = atomic_load(&e->waking[kind]); /* no longer being woken */
            while (w > 0 && !atomic_compare_exchange_weak(&e->waking[kind], &w, w - 1)) {}
        }
    }
}

static void *read_worker(void *arg) {
    worker(arg, BATCH_READ);
    return NULL;
}

static void *write_worker(void *arg) {
    worker(arg, BATCH_WRITE);
    return NULL;
}

int engine_start(engine *e, int threads, int write_threads, size_t task_size,
                 chunk_pool *pool) {
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->done_cv, NULL);
    sem_init(&e->sem[BATCH_READ], 0, 0);
    sem_init(&e->sem[BATCH_WRITE], 0, 0);
    e->task_size = task_size;
    e->pool = pool;
    e->threads = calloc((size_t)(threads + write_threads), sizeof(pthread_t));
    e->tids = calloc((size_t)(threads + write_threads), sizeof(pid_t));
    if (e->threads == NULL || e->tids == NULL) {
        free(e->threads);
        free(e->tids);
        e->threads = NULL;
        e->tids = NULL;
        return ENOMEM;
    }
    /* the readers are all created before the first writer, which takes the ids after theirs */
    for (int i = 0; i < threads + write_threads; i++) {
        int err = pthread_create(&e->threads[i], NULL, i < threads ? read_worker : write_worker,
                                 e);
        if (err) return err;
        e->nthreads[i < threads ? BATCH_READ : BATCH_WRITE]++;
    }
    return 0;
}

int engine_open(engine *e) { return e->threads != NULL && !atomic_load(&e->stop); }

const pid_t *engine_thread_ids(engine *e, int *count) {
    *count = e->nthreads[BATCH_READ] + e->nthreads[BATCH_WRITE];
    if (e->threads == NULL) return e->tids;
    pthread_mutex_lock(&e->mu);
    while (e->started[BATCH_READ] + e->started[BATCH_WRITE] < *count)
        pthread_cond_wait(&e->done_cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    return e->tids;
}

void engine_stop(engine *e) {
    if (e->threads == NULL || atomic_exchange(&e->stop, 1)) return;
    pthread_mutex_lock(&e->mu);
    pthread_cond_broadcast(&e->done_cv); /* writers waiting for reads go at once */
    pthread_mutex_unlock(&e->mu);
    engine_wake(e, BATCH_READ, e->nthreads[BATCH_READ]);
    engine_wake(e, BATCH_WRITE, e->nthreads[BATCH_WRITE]);
    for (int i = 0; i < e->nthreads[BATCH_READ] + e->nthreads[BATCH_WRITE]; i++)
        pthread_join(e->threads[i], NULL);
    chunk_pool_drain(e->pool); /* a closed store leaves no retired file behind */
}

void engine_destroy(engine *e) {
    chunk_pool_free(e->pool);
    if (e->threads == NULL) return;
    free(e->threads);
    free(e->tids);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->done_cv);
    sem_destroy(&e->sem[BATCH_READ]);
    sem_destroy(&e->sem[BATCH_WRITE]);
}

/* -- batches in and out -------------------------------------------------------------------- */

void engine_wake(engine *e, int kind, int count) {
    for (int i = 0; i < count; i++) sem_post(&e->sem[kind]);
}

/* Waking a sleeping thread is a system call that costs a VM tens of microseconds, so the
 * binding makes it without the GIL (as LMCache's native connectors submit); while every
 * worker is busy, or every sleeper already has a wake on its way (a woken writer, at nice
 * 10, may take a while to run), a post is an atomic add or a futex call that finds no one
 * to wake, and the GIL is kept.  Every post is made either way: `waking` only decides
 * whether to let go of the GIL. */
int engine_wakes_sleeper(engine *e, int kind, int count) {
    int asleep = atomic_load(&e->sleepers[kind]) - atomic_load(&e->waking[kind]);
    if (asleep <= 0) return 0;
    atomic_fetch_add(&e->waking[kind], count < asleep ? count : asleep);
    return 1;
}

int engine_read(engine *e, batch *b) {
    if (b->n == 0) return 0;
    int count = push_batch(e, b);
    if (count < 0) return -1;
    engine_wake(e, BATCH_READ, count);
    pthread_mutex_lock(&e->mu); /* then runs queued pieces, its own or others' */
    while (atomic_load(&b->left) > 0) {
        drain_incoming(e);
        chunk_piece *p = pop_piece(e);
        if (p) {
            pthread_mutex_unlock(&e->mu);
            run_piece(e, p);
            pthread_mutex_lock(&e->mu);
        } else {
            pthread_cond_wait(&e->done_cv, &e->mu);
        }
    }
    pthread_mutex_unlock(&e->mu);
    return 0;
}

/* The batch counts as pending before it can be refused, so a wait that saw the engine
 * sealed with nothing pending never misses it; a refusal wakes a wait that saw it pending. */
int engine_submit(engine *e, batch *b) {
    int count = 0;
    b->async = 1;
    atomic_fetch_add(&e->async_pending, 1);
    if (b->n == 0 && atomic_load(&e->incoming) != SEALED) {
        /* nothing to do: finished at once (this takes mu, rarely) */
        atomic_store(&b->left, 1);
        if (b->kind == BATCH_READ) atomic_fetch_add(&e->reads_in_flight, 1);
        batch_request_done(e, b);
    } else if (b->n == 0 || (count = push_batch(e, b)) < 0) {
        atomic_fetch_sub(&e->async_pending, 1);
        pthread_mutex_lock(&e->mu);
        pthread_cond_broadcast(&e->done_cv);
        pthread_mutex_unlock(&e->mu);
        return -1;
    }
    return count;
}

long engine_cancel_writes(engine *e) {
    if (e->threads == NULL) return 0;
    pthread_mutex_lock(&e->mu);
    drain_incoming(e);
    write_job *j = e->whead;
    e->whead = e->wtail = NULL;
    pthread_mutex_unlock(&e->mu);
    long cancelled = 0;
    while (j) {
        write_job *next = j->next;
        j->w.status = CHUNK_FAILED;
        j->w.error = ECANCELED;
        batch_request_done(e, j->b);
        cancelled++;
        j = next;
    }
    return cancelled;
}

/* Takes the finished asynchronous batches.  Called with mu held. */
static batch *take_done(engine *e) {
    batch *done = e->done_head;
    e->done_head = e->done_tail = NULL;
    for (batch *b = done; b; b = b->next) atomic_fetch_sub(&e->async_pending, 1);
    return done;
}

batch *engine_take_done(engine *e) {
    if (e->threads == NULL) return NULL;
    pthread_mutex_lock(&e->mu); /* the workers hold it only for moments */
    batch *done = take_done(e);
    pthread_mutex_unlock(&e->mu);
    return done;
}

/* Whether the engine is closed and drained: sealed (nothing more can come) and every
 * asynchronous batch taken. */
static int drained(engine *e) {
    return atomic_load(&e->incoming) == SEALED && atomic_load(&e->async_pending) == 0;
}

batch *engine_wait_done(engine *e, double timeout, int *closed) {
    struct timespec until = seconds_from_now(timeout);
    pthread_mutex_lock(&e->mu);
    while (e->done_head == NULL && !drained(e)) {
        if (pthread_cond_timedwait(&e->done_cv, &e->mu, &until) == ETIMEDOUT) break;
    }
    batch *done = take_done(e);
    *closed = done == NULL && drained(e);
    pthread_mutex_unlock(&e->mu);
    return done;
}

void engine_signal_eventfds(const int *fds, size_t n) {
    const uint64_t one = 1;
    for (size_t i = 0; i < n; i++) {
        ssize_t written;
        do written = write(fds[i], &one, sizeof one);
        while (written < 0 && errno == EINTR);
    }
}
