/* How the kernels run in parallel: specdec_parallel(fn, ctx, nth) runs fn(ctx, me, nth) for me = 0..nth-1,
 * me = 0 on the calling thread, and returns when all are done. Every partition of work is by (me, nth),
 * static, so results never depend on which threads ran it.
 *
 * On the process's main thread it is an OpenMP parallel region, as torch's own ops are: one team of
 * workers, spinning between regions, serves both. On any other thread it is this file's own pool:
 * libgomp spins its idle workers between regions only while it manages no more threads than there are
 * CPUs; once a second thread has run a region it manages more, and its workers spin ~100 iterations and
 * sleep, so each of a decode step's ~120 regions waits for a futex wake (a 2-vCPU Zen 4 VM: a bf16
 * decode step 11.5 ms from the main thread, 15.6 ms from another; an Intel Xeon: 14 vs 23 ms). The pool's
 * workers spin on a generation counter for SPIN_NS after each job, then sleep on a condition variable.
 * The pool on the main thread measured worse than OpenMP (2-vCPU AMD EPYC, AVX2, plain decode, 3
 * interleaved rounds: fp32 25 vs 33 tok/s, bf16 39 vs 57): torch's OpenMP workers, spinning after
 * the step's torch ops, took a core from the pool's worker; on a second thread the pool measured
 * fp32 33 vs 30 tok/s and bf16 54 vs 50 over OpenMP.
 *
 * One job at a time in the pool: a caller that finds it busy (another Python thread inside a kernel:
 * ctypes releases the GIL) runs its job alone on its own thread. After fork() the child starts afresh.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <omp.h>
#include "common.h"
#ifdef __SSE2__
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define MAX_WORKERS 63
#ifndef SPIN_NS
#define SPIN_NS 200000 /* a decode step's kernels follow each other within tens of microseconds */
#endif

static pthread_mutex_t dispatch = PTHREAD_MUTEX_INITIALIZER; /* held by the job's caller */
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t generation; /* one more per job */
static _Atomic int64_t pending;     /* workers yet to finish the current job */
static pool_fn job_fn;
static void *job_ctx;
static int64_t job_nth;
static int64_t num_workers; /* started (written under dispatch) */
/* the generation each worker starts from, written before it is created: a worker that read the counter
 * itself could start after the bump for the job it was created for, miss that job and leave its caller
 * waiting forever (seen on a busy 2-core machine: a test run hung in its first minutes) */
static uint64_t start_generation[MAX_WORKERS + 1];
static int sleepers;        /* under sleep_mu */
static int fork_handler;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *worker(void *arg) {
    const int64_t me = (int64_t)(intptr_t)arg;
    uint64_t seen = start_generation[me];
    for (;;) {
        uint64_t g = atomic_load_explicit(&generation, memory_order_acquire);
        if (g == seen) {
            const uint64_t until = now_ns() + SPIN_NS;
            for (int i = 0; (g = atomic_load_explicit(&generation, memory_order_acquire)) == seen; i++) {
                PAUSE();
                if ((i & 255) == 255 && now_ns() > until) break;
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&sleep_mu);
            sleepers++;
            while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&sleep_cv, &sleep_mu);
            sleepers--;
            pthread_mutex_unlock(&sleep_mu);
        }
        seen = g;
        if (me < job_nth) job_fn(job_ctx, me, job_nth);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    pthread_mutex_init(&dispatch, NULL);
    pthread_mutex_init(&sleep_mu, NULL);
    pthread_cond_init(&sleep_cv, NULL);
    num_workers = 0; /* the parent's workers do not exist here */
    sleepers = 0;
}

/* Start workers 1..n (under dispatch); the number actually running. */
static int64_t ensure_workers(int64_t n) {
    if (!fork_handler) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        fork_handler = 1;
    }
    while (num_workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[num_workers + 1] = atomic_load(&generation);
        const int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)(num_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        num_workers++;
    }
    return num_workers;
}

/* The thread count the kernels use: OpenMP's setting for the calling thread (torch.set_num_threads
 * sets it), at most MAX_WORKERS + 1. */
int64_t specdec_num_threads(void) {
    const int64_t n = omp_get_max_threads();
    return n < 1 ? 1 : n > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : n;
}

static int is_main_thread(void) {
    static _Thread_local int main_thread = -1;
    if (main_thread < 0) main_thread = syscall(SYS_gettid) == getpid();
    return main_thread;
}

void specdec_parallel(pool_fn fn, void *ctx, int64_t nth) {
    if (nth > MAX_WORKERS + 1) nth = MAX_WORKERS + 1;
    if (nth > 1 && is_main_thread()) {
        #pragma omp parallel num_threads(nth)
        fn(ctx, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    if (nth <= 1 || pthread_mutex_trylock(&dispatch) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    const int64_t workers = ensure_workers(nth - 1);
    if (workers < nth - 1) nth = workers + 1;
    job_fn = fn, job_ctx = ctx, job_nth = nth;
    atomic_store_explicit(&pending, workers, memory_order_relaxed);
    pthread_mutex_lock(&sleep_mu); /* the bump and the wake under the sleepers' lock: none misses it */
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (sleepers) pthread_cond_broadcast(&sleep_cv);
    pthread_mutex_unlock(&sleep_mu);
    fn(ctx, 0, nth);
    while (atomic_load_explicit(&pending, memory_order_acquire) != 0) PAUSE();
    pthread_mutex_unlock(&dispatch);
}
