/* The CUDA device's host functions (enqueued with cuLaunchHostFunc).
 *
 * They run on a CUDA driver thread, never take the GIL and never call CUDA. The slot layout is
 * the OpenCL callback's (hcqa/devices/opencl/callback.c), 20 uint64 words owned by the device:
 *
 *   [0] fired  [1] status  [2] fd  [3] n stores  [4 + 3i] store i: value address, value, eventfd
 *   [10..12] a C timeline completion (fn, timeline, seq)  [13] host_ns  [14] wake
 *   [15..17] another device's C timeline step (fn, timeline, seq)  [18] host copies to make
 *   first (see below)  [19] done (last touch)
 *
 * A host function runs only once the stream reached it, so there is no failure status: a kernel
 * that faults leaves the context broken and the host functions behind it never run (the device's
 * pump finds that by asking the driver, see device.py).
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#define HCQA_SLOT_WORDS 20

void hcqa_cu_complete(void *user) {
    uint64_t *slot = (uint64_t *)user;
    /* [18]: host copies to make first (a small copy-out's pinned block to its host array):
     * {count, then dest, src, nbytes per copy}; 0: none */
    const uint64_t *pre = (const uint64_t *)(uintptr_t)slot[18];
    if (pre != 0) {
        for (uint64_t i = 0; i < pre[0]; i++) {
            memcpy((void *)(uintptr_t)pre[1 + 3 * i], (const void *)(uintptr_t)pre[2 + 3 * i],
                   (size_t)pre[3 + 3 * i]);
        }
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    slot[13] = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    uint64_t n = slot[3] > 2 ? 2 : slot[3];
    for (uint64_t i = 0; i < n; i++) {  /* eventfds only where a waiter needs the value */
        uint64_t *store = &slot[4 + 3 * i];
        hcqa_signal_complete((uint64_t *)(uintptr_t)store[0], store[1], (int)(int64_t)store[2]);
    }
    typedef int (*complete_fn)(void *, uint64_t, int);
    if (slot[10] != 0) ((complete_fn)(uintptr_t)slot[10])((void *)(uintptr_t)slot[11], slot[12], 0);
    if (slot[15] != 0) ((complete_fn)(uintptr_t)slot[15])((void *)(uintptr_t)slot[16], slot[17], 1);
    __atomic_store_n(&slot[1], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[0], 1, __ATOMIC_RELEASE);
    /* ``wake`` may be set by the loop after ``fired`` was stored (a stop): order the two */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&slot[14], __ATOMIC_RELAXED)) hcqa_eventfd_add((int)(int64_t)slot[2]);
    __atomic_store_n(&slot[HCQA_SLOT_WORDS - 1], 1, __ATOMIC_RELEASE);
}

/* A host-side copy in stream order: words {dest, src, nbytes} (staging for pageable memory). */
void hcqa_cu_memcpy(void *user) {
    uint64_t *w = (uint64_t *)user;
    memcpy((void *)(uintptr_t)w[0], (const void *)(uintptr_t)w[1], (size_t)w[2]);
}

/* The entry hcqa's compiler resolves (it needs one plain function): the slot size, for a check. */
void hcqa_cu_abi(int64_t *out) { out[0] = HCQA_SLOT_WORDS; }
