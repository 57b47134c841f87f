/* gilmeter: exact GIL-held time and GIL acquisitions of one CPython process.
 *
 * Loaded with LD_PRELOAD into a CPython 3.11 process (bench/instruments/bench_ceiling.py builds and
 * loads it).  CPython takes and drops the GIL under the GIL's own pthread mutex: take_gil
 * sets gil->locked = 1 and drop_gil sets it to 0, each before unlocking that mutex.  This
 * library wraps pthread_mutex_unlock; once told where the GIL's mutex is
 * (gilmeter_register, called from Python with the address bench_ceiling finds), every
 * unlock of that mutex compares gil->locked with its last value: 0 -> 1 is an acquisition,
 * 1 -> 0 a release, and the time between them is GIL-held time.  The bookkeeping runs
 * while the GIL's mutex is still held, so it is serialised like the GIL itself.
 *
 * Unlike a sampling profiler it misses nothing shorter than a sample and is not biased by
 * when the sampler gets a CPU (on a busy 2-vCPU machine py-spy's --gil samples land
 * mostly where threads just blocked; see docs/benchmarks.md).  It also keeps the holders'
 * CPU time while holding (the thread CPU clock): on a machine with fewer cores than busy
 * threads a holder is often descheduled while holding, which wall time counts.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256

static int (*real_unlock)(pthread_mutex_t *);
static pthread_mutex_t *gil_mutex;
static volatile int *gil_locked;
static int last_locked;
static uint64_t acquired_at_ns, acquired_cpu_ns;
static uint64_t held_ns, held_cpu_ns;
static uint64_t acquisitions;
/* per thread (kernel thread id): GIL-held nanoseconds and acquisitions */
static struct { long tid; uint64_t held_ns, held_cpu_ns, acquisitions; } threads[MAX_THREADS];
static int holder = -1;

static int slot_of(long tid) {
    for (int i = 0; i < MAX_THREADS; i++) {
        if (threads[i].tid == tid) return i;
        if (threads[i].tid == 0) { threads[i].tid = tid; return i; }
    }
    return -1;
}

static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

/* CPU time of the calling thread: the holder's CPU while it holds the GIL is what a
 * machine with a core for every thread would see; wall time also counts the holder being
 * descheduled, which happens when a few cores are shared by many threads. */
static uint64_t cpu_ns(void) { return clock_ns(CLOCK_THREAD_CPUTIME_ID); }

int pthread_mutex_unlock(pthread_mutex_t *mutex) {
    if (!real_unlock)
        real_unlock = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_unlock");
    if (mutex == gil_mutex && gil_mutex) {
        int locked = *gil_locked;
        if (locked && !last_locked) {
            acquired_at_ns = now_ns();
            acquired_cpu_ns = cpu_ns();
            acquisitions++;
            holder = slot_of(syscall(SYS_gettid));
            if (holder >= 0) threads[holder].acquisitions++;
        } else if (!locked && last_locked) {
            uint64_t held = now_ns() - acquired_at_ns;
            held_ns += held;
            uint64_t held_cpu = cpu_ns() - acquired_cpu_ns;
            held_cpu_ns += held_cpu;
            if (holder >= 0) {
                threads[holder].held_ns += held;
                threads[holder].held_cpu_ns += held_cpu;
            }
        }
        last_locked = locked;
    }
    return real_unlock(mutex);
}

/* The GIL's mutex and its locked flag; called with the GIL held (locked == 1). */
void gilmeter_register(void *mutex, void *locked) {
    gil_locked = (volatile int *)locked;
    last_locked = 1;
    acquired_at_ns = now_ns();
    acquired_cpu_ns = cpu_ns();
    holder = slot_of(syscall(SYS_gettid));
    gil_mutex = (pthread_mutex_t *)mutex;
}

/* out[0] = GIL-held nanoseconds, out[1] = acquisitions, out[2] = CPU nanoseconds of the
 * holders while they held it, all since registration.  The caller holds the GIL: its
 * current hold is counted up to now. */
void gilmeter_read(uint64_t out[3]) {
    out[0] = held_ns + (last_locked ? now_ns() - acquired_at_ns : 0);
    out[1] = acquisitions;
    out[2] = held_cpu_ns + (last_locked ? cpu_ns() - acquired_cpu_ns : 0);
}

/* GIL-held nanoseconds, acquisitions and CPU nanoseconds while holding, of one thread
 * (its kernel id); the current hold of the caller is not included. */
void gilmeter_read_thread(long tid, uint64_t out[3]) {
    out[0] = out[1] = out[2] = 0;
    for (int i = 0; i < MAX_THREADS && threads[i].tid; i++) {
        if (threads[i].tid == tid) {
            out[0] = threads[i].held_ns;
            out[1] = threads[i].acquisitions;
            out[2] = threads[i].held_cpu_ns;
        }
    }
}
