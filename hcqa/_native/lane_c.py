"""The C source of the native lane and the native timeline (a string: nothing to package).

See ``hcqa/_native/lane.py`` for the theory of operation.
"""

# The signal store every native producer uses: value first (seq_cst), then the eventfd
# when a waiter of this process may need it (its target is reached: ``wake_at`` is the
# lowest listed target, 0 = always), or when the process has forked (waiters elsewhere).
SIGNAL_STORE_C = r"""
#include <stdint.h>
#include <stdatomic.h>
#include <unistd.h>

static _Atomic int hcqa_forked;

static void hcqa_signal_store(uint64_t *slot, uint64_t value, int fd) {
    atomic_store_explicit((_Atomic uint64_t *)slot, value, memory_order_seq_cst);
    uint64_t wake_at = atomic_load_explicit((_Atomic uint64_t *)(slot + 2), memory_order_seq_cst);
    if (value >= wake_at || atomic_load_explicit(&hcqa_forked, memory_order_relaxed)) {
        uint64_t one = 1;
        ssize_t r = write(fd, &one, 8);
        (void)r;
    }
}
"""

LANE_C = (
    r"""
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
"""
    + SIGNAL_STORE_C
    + r"""
enum { OP_NOP = 0, OP_CALL = 1, OP_COPY = 2, OP_SIGNAL = 3, OP_STAMP = 4, OP_STEP = 5, OP_PY = 6 };

typedef struct { int64_t op, a, b, c, d; } rec_t;

void hcqa_lane_abi(void) {}
int hcqa_rec_size(void) { return (int)sizeof(rec_t); }
void hcqa_note_fork(void) { atomic_store(&hcqa_forked, 1); }
/* A full barrier: a waiter that listed its target in the wake word must not read the value
   before that store is visible (x86's locked instructions give this already). */
void hcqa_full_fence(void) { atomic_thread_fence(memory_order_seq_cst); }

/* -- the timeline: steps completed in any order, the signal shows the completed prefix -- */

#define WRAP (1ULL << 31)
/* Steps are the Python timeline's modulo 2**64 (it passes 2**64 after a timeline_start near
   it): 2**64 is a multiple of WRAP, so epochs and values keep their parity and numbers. */
static uint64_t tl_epoch(uint64_t s) { return s > 0 ? (s - 1) / WRAP : 0; }
static uint64_t tl_value(uint64_t s) { return s > 0 ? (s - 1) % WRAP + 1 : 0; }

typedef struct {
    pthread_mutex_t mu;
    uint64_t done;
    uint64_t *pend;  /* sorted by distance ahead of done */
    size_t npend, cap;
    uint64_t *slot[2];
    int fd[2];
    uint64_t *fslot;  /* foreign steps done */
    int ffd;
} tl_t;

tl_t *hcqa_tl_new(uint64_t start, void *s0, int f0, void *s1, int f1, void *fs, int ff) {
    tl_t *t = calloc(1, sizeof(tl_t));
    if (!t) return NULL;
    pthread_mutex_init(&t->mu, NULL);
    t->done = start;
    t->slot[0] = s0; t->slot[1] = s1; t->fd[0] = f0; t->fd[1] = f1;
    t->fslot = fs; t->ffd = ff;
    return t;
}

/* Free a timeline nobody will complete a step of any more. Another device's lane may still
   be inside hcqa_tl_complete for its last (foreign) step -- the owner saw that step's count
   and closed -- so wait for the mutex first: once it is ours, that call has left. */
void hcqa_tl_free(tl_t *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_destroy(&t->mu);
    free(t->pend);
    free(t);
}

uint64_t hcqa_tl_done(tl_t *t) {
    pthread_mutex_lock(&t->mu);
    uint64_t d = t->done;
    pthread_mutex_unlock(&t->mu);
    return d;
}

static int tl_pend(tl_t *t, uint64_t seq) {
    if (t->npend == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 16;
        uint64_t *p = realloc(t->pend, cap * sizeof(uint64_t));
        if (!p) return -1;
        t->pend = p; t->cap = cap;
    }
    size_t i = t->npend;
    /* ordered by distance ahead of `done` (wrapping): the same order across 2**64 */
    while (i > 0 && t->pend[i - 1] - t->done > seq - t->done) { t->pend[i] = t->pend[i - 1]; i--; }
    t->pend[i] = seq;
    t->npend++;
    return 0;
}

int hcqa_tl_complete(tl_t *t, uint64_t seq, int foreign) {
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    uint64_t old = t->done;
    if (seq != old + 1) {
        rc = tl_pend(t, seq);
    } else {
        uint64_t nw = seq;
        size_t k = 0;
        while (k < t->npend && t->pend[k] == nw + 1) { nw++; k++; }
        if (k) { memmove(t->pend, t->pend + k, (t->npend - k) * sizeof(uint64_t)); t->npend -= k; }
        t->done = nw;
        if (tl_epoch(old) != tl_epoch(nw) && old > 0) {
            int e = (int)(tl_epoch(old) % 2);
            hcqa_signal_store(t->slot[e], WRAP, t->fd[e]);
        }
        int e = (int)(tl_epoch(nw) % 2);
        hcqa_signal_store(t->slot[e], tl_value(nw), t->fd[e]);
    }
    if (foreign) {  /* last: the owner may release its memory after this */
        uint64_t v = atomic_load_explicit((_Atomic uint64_t *)t->fslot, memory_order_relaxed);
        hcqa_signal_store(t->fslot, v + 1, t->ffd);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* -- the lane: records in a single-producer queue, run by one thread ---------------------
   The producer (the event loop's thread, holding the GIL) appends records to a chain of
   chunks and publishes `tail`; the lane thread runs them in order and publishes `done`.
   Neither takes a lock for that. The lane thread sleeps reading its `bell` eventfd when
   it finds nothing: it marks `sleeping` first and looks again, and a producer that finds
   the mark after publishing rings the bell (both sides sequentially consistent). The
   hand-over to Python (PY records) and the end use the mutex and condition variables. */

#define CHUNK 1024

typedef struct chunk { rec_t recs[CHUNK]; struct chunk *_Atomic next; } chunk_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t turn_cv; /* the Python engine sleeps here for its turn (and the end) */
    pthread_cond_t py_cv;   /* the lane thread sleeps here for the Python engine */
    int bell;               /* the lane thread sleeps reading this eventfd for records */
    chunk_t *pchunk;        /* producer's chunk */
    chunk_t *cchunk;        /* consumer's chunk */
    _Atomic uint64_t tail;  /* records pushed */
    _Atomic uint64_t done;  /* records run (or passed) */
    _Atomic int sleeping, fail, stop;
    _Atomic int64_t py_done;
    int64_t turn, py_last, py_marked;  /* turn: under mu; py_*: producer only */
    int py_waiting, stopped, exited, started;
    uint64_t stopped_at;
    pthread_t th;
} lane_t;

lane_t *hcqa_lane_new(void) {
    lane_t *l = calloc(1, sizeof(lane_t));
    if (!l) return NULL;
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->turn_cv, &ca);
    pthread_cond_init(&l->py_cv, &ca);
    pthread_condattr_destroy(&ca);
    l->pchunk = l->cchunk = calloc(1, sizeof(chunk_t));
    l->bell = eventfd(0, EFD_CLOEXEC);
    if (!l->pchunk || l->bell < 0) {
        free(l->pchunk);
        if (l->bell >= 0) close(l->bell);
        free(l);
        return NULL;
    }
    return l;
}

uint64_t *hcqa_lane_done_addr(lane_t *l) { return (uint64_t *)&l->done; }
uint64_t *hcqa_lane_tail_addr(lane_t *l) { return (uint64_t *)&l->tail; }
/* The producer's own word: the last PY run handed out (it may set it without a call when
   the lane is idle: that run needs no turn, and later native records wait for it). */
int64_t *hcqa_lane_py_last_addr(lane_t *l) { return &l->py_last; }

static void ring_bell(lane_t *l) {
    uint64_t one = 1;
    ssize_t r = write(l->bell, &one, 8);
    (void)r;
}

static void run_one(const rec_t *r) {
    switch (r->op) {
    case OP_CALL:
        ((void (*)(void *, const void *))(intptr_t)r->a)((void *)(intptr_t)r->b,
                                                         (const void *)(intptr_t)r->c);
        break;
    case OP_COPY:
        memmove((void *)(intptr_t)r->a, (const void *)(intptr_t)r->b, (size_t)r->c);
        break;
    case OP_SIGNAL:
        hcqa_signal_store((uint64_t *)(intptr_t)r->a, (uint64_t)r->b, (int)r->c);
        break;
    case OP_STAMP: {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        atomic_store_explicit((_Atomic uint64_t *)((uint64_t *)(intptr_t)r->a + 1), ns,
                              memory_order_release);
        break;
    }
    case OP_STEP:
        hcqa_tl_complete((tl_t *)(intptr_t)r->a, (uint64_t)r->b, (int)r->c);
        break;
    default:
        break;
    }
}

/* The lane thread at a PY record: give the Python engine its turn, sleep until that run is
   done. 0, or -1 when the lane failed meanwhile. */
static int hand_over(lane_t *l, int64_t k) {
    if (atomic_load(&l->py_done) >= k) return 0;
    pthread_mutex_lock(&l->mu);
    if (l->turn < k) { l->turn = k; pthread_cond_broadcast(&l->turn_cv); }
    while (atomic_load(&l->py_done) < k && !atomic_load(&l->fail)) {
        l->py_waiting = 1;
        pthread_cond_wait(&l->py_cv, &l->mu);
        l->py_waiting = 0;
    }
    pthread_mutex_unlock(&l->mu);
    return atomic_load(&l->fail) ? -1 : 0;
}

static void *lane_main(void *arg) {
    lane_t *l = arg;
    uint64_t head = 0;
    if (getenv("HCQA_LANE_BATCH")) {
        struct sched_param sp = {0};
        pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
    }
    for (;;) {
        if (atomic_load(&l->fail)) break;
        if (head == atomic_load(&l->tail)) {
            if (atomic_load(&l->stop)) break;
            atomic_store(&l->sleeping, 1);
            if (head == atomic_load(&l->tail) && !atomic_load(&l->stop) && !atomic_load(&l->fail)) {
                uint64_t got;
                ssize_t r = read(l->bell, &got, 8);
                (void)r;
            }
            atomic_store(&l->sleeping, 0);
            continue;
        }
        uint64_t i = head % CHUNK;
        if (i == 0 && head > 0) {
            chunk_t *next = atomic_load(&l->cchunk->next);
            free(l->cchunk);
            l->cchunk = next;
        }
        const rec_t *r = &l->cchunk->recs[i];
        if (r->op == OP_PY) {
            if (hand_over(l, r->a) != 0) break;
        } else {
            run_one(r);
        }
        head++;
        atomic_store_explicit(&l->done, head, memory_order_release);
    }
    pthread_mutex_lock(&l->mu);
    l->stopped = 1;
    l->stopped_at = head;
    l->exited = 1;
    pthread_cond_broadcast(&l->turn_cv);
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

int hcqa_lane_start(lane_t *l) {
    int rc = pthread_create(&l->th, NULL, lane_main, l);
    if (rc == 0) l->started = 1;
    return rc;
}

static int append(lane_t *l, uint64_t *tail, const rec_t *r) {
    uint64_t i = *tail % CHUNK;
    if (i == 0 && *tail > 0) {
        chunk_t *c = calloc(1, sizeof(chunk_t));
        if (!c) return -1;
        atomic_store(&l->pchunk->next, c);
        l->pchunk = c;
    }
    l->pchunk->recs[i] = *r;
    (*tail)++;
    return 0;
}

/* The producer: append n records (the index of the first native one is returned through
   *first). A PY record pushed while the lane has nothing left to run gets its turn at once
   and is not queued: the Python engine runs it without waking the lane thread (its own
   FIFO keeps the Python runs in order). A native record pushed while a Python run may still
   be going first queues a PY record that waits for it. Returns 0, or -1 (out of memory:
   nothing was pushed), -2 (the lane stopped). */
int hcqa_lane_push(lane_t *l, const rec_t *recs, int64_t n, uint64_t *first) {
    if (atomic_load(&l->fail) || atomic_load(&l->stop)) return -2;
    uint64_t tail = atomic_load_explicit(&l->tail, memory_order_relaxed);
    uint64_t start = tail;
    *first = UINT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        const rec_t *r = &recs[i];
        if (r->op == OP_PY) {
            l->py_last = r->a;
            if (tail == start && atomic_load(&l->done) == start) {
                pthread_mutex_lock(&l->mu);
                l->turn = r->a;
                pthread_cond_broadcast(&l->turn_cv);
                pthread_mutex_unlock(&l->mu);
                continue;
            }
            l->py_marked = r->a;
        } else if (atomic_load(&l->py_done) < l->py_last && l->py_marked != l->py_last) {
            rec_t w = {OP_PY, l->py_last, 0, 0, 0};
            if (append(l, &tail, &w) != 0) return -1;
            l->py_marked = l->py_last;
        }
        if (r->op != OP_PY && *first == UINT64_MAX) *first = tail;
        if (append(l, &tail, r) != 0) return -1;
    }
    if (tail == start) return 0;
    atomic_store(&l->tail, tail);
    if (atomic_load(&l->sleeping)) {
        int expect = 1;
        if (atomic_compare_exchange_strong(&l->sleeping, &expect, 0)) ring_bell(l);
    }
    return 0;
}

/* The Python engine: has PY record k its turn? 1 yes, 0 not yet, -1 the lane stopped. */
int hcqa_lane_try_turn(lane_t *l, int64_t k) {
    pthread_mutex_lock(&l->mu);
    int r = l->turn >= k ? 1 : (l->stopped ? -1 : 0);
    pthread_mutex_unlock(&l->mu);
    return r;
}

/* The same, sleeping until it is (called with the GIL released). */
int hcqa_lane_wait_turn(lane_t *l, int64_t k) {
    pthread_mutex_lock(&l->mu);
    while (l->turn < k && !l->stopped) pthread_cond_wait(&l->turn_cv, &l->mu);
    int r = l->turn >= k ? 1 : -1;
    pthread_mutex_unlock(&l->mu);
    return r;
}

void hcqa_lane_py_done(lane_t *l, int64_t k) {
    pthread_mutex_lock(&l->mu);
    if (atomic_load(&l->py_done) < k) atomic_store(&l->py_done, k);
    if (l->py_waiting) pthread_cond_signal(&l->py_cv);
    pthread_mutex_unlock(&l->mu);
}

/* Stop running records (a fault, or cancellation): the thread exits at the next boundary. */
void hcqa_lane_fail(lane_t *l) {
    pthread_mutex_lock(&l->mu);
    atomic_store(&l->fail, 1);
    pthread_cond_broadcast(&l->py_cv);
    pthread_mutex_unlock(&l->mu);
    ring_bell(l);
}

/* Stop once every record pushed so far has run, and wait (GIL released) until the thread
   exited; the index of the first record it did not run. */
uint64_t hcqa_lane_finish(lane_t *l) {
    atomic_store(&l->stop, 1);
    ring_bell(l);
    pthread_mutex_lock(&l->mu);
    if (!l->started) { l->stopped = l->exited = 1; l->stopped_at = atomic_load(&l->done); }
    while (!l->exited) pthread_cond_wait(&l->turn_cv, &l->mu);
    uint64_t at = l->stopped_at;
    pthread_mutex_unlock(&l->mu);
    return at;
}

uint64_t hcqa_lane_tail(lane_t *l) { return atomic_load(&l->tail); }

/* Join the (exited) thread and free the lane. */
void hcqa_lane_free(lane_t *l) {
    if (!l) return;
    if (l->started) pthread_join(l->th, NULL);
    pthread_cond_destroy(&l->turn_cv);
    pthread_cond_destroy(&l->py_cv);
    pthread_mutex_destroy(&l->mu);
    close(l->bell);
    chunk_t *c = l->cchunk;
    while (c) { chunk_t *next = atomic_load(&c->next); free(c); c = next; }
    free(l);
}
"""
)
