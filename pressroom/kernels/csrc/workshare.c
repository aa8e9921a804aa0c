/* workshare.h's pool: one job at a time (the callers are one engine thread's kernels). A job's chunks are
 * claimed through one 64-bit ticket, its generation in the high half and the next chunk in the low half, so a
 * helper that read an older job's fields can never claim a chunk of a newer one. Idle helpers spin SPIN_NS for
 * the next job, then sleep on a futex; a helper late to a job costs nothing, the caller claims its chunks. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "workshare.h"

#define MAX_HELPERS 15
#define SPIN_NS 50000  /* a decode step's products come a few to a hundred microseconds apart */
/* Waiting for preempted helpers costing more than a twentieth of a WINDOW_NS means the machine is busy: the
 * caller then works alone for ALONE_NS (a busy machine stays busy). Measured on the shared 2-core machine
 * over 1,300 decode steps: quiet, 74 waits (median 69 us, a few of 1.6 ms: interrupts, page faults, the
 * host), 1% of the time; beside a process spinning on one core, 449 waits (median 3.2 ms, its time
 * slices), 12%. Working alone for a second after any wait past 50 us, as before, kept a quiet machine
 * alone most of the time and its decode steps 1.3x longer. */
#define WINDOW_NS 200000000
#define LOST_NS (WINDOW_NS / 20)
#define ALONE_NS 1000000000
#define FULL 0xFFFFFFFFu  /* a ticket's chunk index that no one can claim */

static struct {
    _Atomic uint64_t ticket;
    _Atomic uint32_t gen;  /* the futex word: bumped for each job */
    _Atomic int64_t done;
    _Atomic int sleepers;
    chunk_fn fn;
    void *ctx;
    int64_t chunks;
    int helpers;  /* started */
    int64_t alone_until;
    int64_t window_start, lost;  /* the current window, and the time its jobs waited for helpers */
} pool;

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time; a second caller runs alone */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claims and runs chunks of generation g while there are any; the fields were read under g. */
static void work(uint32_t g, chunk_fn fn, void *ctx, int64_t chunks) {
    for (;;) {
        uint64_t t = atomic_load(&pool.ticket);
        if ((uint32_t)(t >> 32) != g || (int64_t)(t & FULL) >= chunks) return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + 1)) continue;
        fn(ctx, (int64_t)(t & FULL));
        atomic_fetch_add(&pool.done, 1);
    }
}

static uint32_t wait_for_job(uint32_t seen) {
    const int64_t until = now_ns() + SPIN_NS;
    for (int i = 0;; i++) {
        const uint32_t g = atomic_load(&pool.gen);
        if (g != seen) return g;
        if (i % 256 == 255 && now_ns() > until) break;
        cpu_relax();
    }
    for (;;) {
        atomic_fetch_add(&pool.sleepers, 1);
        syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&pool.sleepers, 1);
        const uint32_t g = atomic_load(&pool.gen);
        if (g != seen) return g;
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        const uint32_t g = wait_for_job(seen);
        seen = g;
        const chunk_fn fn = pool.fn;
        void *ctx = pool.ctx;
        const int64_t chunks = pool.chunks;
        atomic_thread_fence(memory_order_acquire);  /* fields read before the ticket that vouches for them */
        work(g, fn, ctx, chunks);
    }
    return NULL;
}

static void start_helpers(int wanted) {
    pthread_mutex_lock(&start_lock);
    while (pool.helpers < wanted && pool.helpers < MAX_HELPERS) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.helpers++;
    }
    pthread_mutex_unlock(&start_lock);
}

static void count_wait(int64_t start, int64_t end) {
    if (end - pool.window_start > WINDOW_NS) pool.window_start = end, pool.lost = 0;
    pool.lost += end - start;
    if (pool.lost > LOST_NS) pool.alone_until = end + ALONE_NS, pool.lost = 0;
}

static void run_alone(chunk_fn fn, void *ctx, int64_t chunks) {
    for (int64_t c = 0; c < chunks; c++) fn(ctx, c);
}

void workshare_run(chunk_fn fn, void *ctx, int64_t chunks, int threads) {
    if (threads <= 1 || chunks <= 1 || now_ns() < pool.alone_until || pthread_mutex_trylock(&job_lock)) {
        run_alone(fn, ctx, chunks);
        return;
    }
    if (pool.helpers < threads - 1) start_helpers(threads - 1);
    const uint32_t g = atomic_load(&pool.gen) + 1;
    atomic_store(&pool.ticket, (uint64_t)g << 32 | FULL);  /* no claims while the fields change */
    atomic_thread_fence(memory_order_release);
    pool.fn = fn, pool.ctx = ctx, pool.chunks = chunks;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.ticket, (uint64_t)g << 32);
    atomic_store(&pool.gen, g);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(g, fn, ctx, chunks);
    if (atomic_load(&pool.done) < chunks) {  /* a helper's chunk in flight */
        const int64_t start = now_ns();
        while (atomic_load(&pool.done) < chunks) cpu_relax();
        count_wait(start, now_ns());
    }
    pthread_mutex_unlock(&job_lock);
}
