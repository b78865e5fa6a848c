/* The OpenCL completion callback (registered with clSetEventCallback for CL_COMPLETE).
 *
 * It runs on a driver thread (or at once in the registering thread when the event is already
 * complete), never takes the GIL and never calls OpenCL. Its user data is one slot of 20 uint64
 * words owned by the device:
 *
 *   [0] fired      set to 1 once the event completed (release: the stores before it are seen)
 *   [1] status     the event's execution status as the driver gave it
 *   [2] fd         the device's completion eventfd, written after ``fired``
 *   [3] n          native signal stores to make first (at most 2)
 *   [4 + 3i ...]   store i: value address, value, eventfd (-1: none), written only when a
 *                  waiter of this process needs it (``hcqa_signal_complete``: the slot's wake
 *                  word); every store's signal is one of this process's own
 *   [10] complete  a timeline's C completion, ``int fn(timeline, seq, foreign)`` (0: none)
 *   [11] timeline  its first argument (the device's C timeline)
 *   [12] seq       the step to complete, after the stores
 *   [13] host_ns   CLOCK_MONOTONIC when the callback ran (the device clock's offset is measured
 *                  from it and the event's profiling END)
 *   [14] wake      1: write ``fd`` (the pump has work); 0: the pump finds the slot later
 *   [15] complete  then another device's C timeline's step (``foreign``: that device may close
 *   [16] timeline  once it is done; the owner frees its C timeline only under that timeline's
 *   [17] seq       mutex, so this call has left it by then) (0: none)
 *   [19] done      set to 1 last: the callback touches nothing of the slot after it, so the
 *                  slot (and the fds it names) may be reused or closed once ``done`` is seen.
 */
#include <stdint.h>
#include <time.h>

#define HCQA_SLOT_WORDS 20

void hcqa_cl_complete(void *event, int32_t status, void *user) {
    (void)event;
    uint64_t *slot = (uint64_t *)user;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    slot[13] = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    uint64_t n = slot[3] > 2 ? 2 : slot[3];
    for (uint64_t i = 0; i < n; i++) {  /* eventfds only where a waiter needs the value */
        uint64_t *store = &slot[4 + 3 * i];
        hcqa_signal_complete((uint64_t *)(uintptr_t)store[0], store[1], (int)(int64_t)store[2]);
    }
    typedef int (*complete_fn)(void *, uint64_t, int);
    if (slot[10] != 0) {  /* the timeline step: its prefix, wrap and wake-ups are the C timeline's */
        ((complete_fn)(uintptr_t)slot[10])((void *)(uintptr_t)slot[11], slot[12], 0);
    }
    if (slot[15] != 0) {  /* a transfer's step on the other device's timeline */
        ((complete_fn)(uintptr_t)slot[15])((void *)(uintptr_t)slot[16], slot[17], 1);
    }
    __atomic_store_n(&slot[1], (uint64_t)(int64_t)status, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[0], 1, __ATOMIC_RELEASE);
    /* ``wake`` may be set by the loop after ``fired`` was stored (a stop): order the two */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&slot[14], __ATOMIC_RELAXED)) hcqa_eventfd_add((int)(int64_t)slot[2]);
    __atomic_store_n(&slot[HCQA_SLOT_WORDS - 1], 1, __ATOMIC_RELEASE);
}

/* The entry hcqa's compiler resolves (it needs one plain function): the slot size, for a check. */
void hcqa_cl_abi(int64_t *out) { out[0] = HCQA_SLOT_WORDS; }
