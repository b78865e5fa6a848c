/* Runs of OpenCL launches enqueued by one native call (compiled with callback.c).
 *
 * The driver's entry points come from the very ICD loader PyOpenCL loaded, as addresses in
 * ``fns`` (``runs.py`` fills it): this file links against nothing.
 *
 *   fns[0] clEnqueueNDRangeKernel   fns[1] clSetKernelArg   fns[2] clReleaseEvent
 *   fns[3] clSetEventCallback       fns[4] clFlush          fns[5] the completion callback
 *   fns[6] clCreateUserEvent        fns[7] clSetUserEventStatus
 *
 * A run's table holds, per launch:
 *
 *   kernel, work_dim, global[3], local[3], nset, then nset x (index, size, value)
 *
 * ``value`` is the argument itself (a cl_mem handle, or an integer of ``size`` bytes in
 * its low bytes): the arguments to set before this launch, those that differ from the
 * kernel's arguments at its previous launch in the run (the first launch's set by the
 * caller). Each launch's event goes to ``events``; the first launch waits for ``wait``.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HCQA_RUN_WAITS 16

typedef int32_t (*enqueue_fn)(void *, void *, uint32_t, const size_t *, const size_t *,
                              const size_t *, uint32_t, void *const *, void **);
typedef int32_t (*set_arg_fn)(void *, uint32_t, size_t, const void *);
typedef int32_t (*release_fn)(void *);
typedef int32_t (*callback_fn)(void *, int32_t, void *, void *);
typedef int32_t (*flush_fn)(void *);
typedef void *(*user_event_fn)(void *, int32_t *);
typedef int32_t (*set_status_fn)(void *, int32_t);

static int32_t hcqa_set_arg(set_arg_fn set_arg, void *kernel, uint64_t index, uint64_t size,
                            uint64_t value) {
    uint8_t u8; uint16_t u16; uint32_t u32; uint64_t u64 = value;
    const void *p = &u64;
    switch (size) {  /* the low bytes of ``value``, whatever the byte order */
        case 1: u8 = (uint8_t)value; p = &u8; break;
        case 2: u16 = (uint16_t)value; p = &u16; break;
        case 4: u32 = (uint32_t)value; p = &u32; break;
        default: break;
    }
    return set_arg(kernel, (uint32_t)index, (size_t)size, p);
}

/* Enqueue the ``n`` launches of ``table`` on ``queue``; how many were enqueued (``n``
 * unless the driver refused one: its status in ``status[0]``). With ``slot`` (non-zero)
 * the completion callback is registered on the last event with it (a refusal: its status
 * in ``status[1]``); the queue is flushed. */
int64_t hcqa_cl_run(const uint64_t *fns, uint64_t queue, const uint64_t *table, int64_t n,
                    uint64_t nwait, const uint64_t *wait, uint64_t *events, int64_t *status,
                    uint64_t slot, uint64_t context) {
    enqueue_fn enqueue = (enqueue_fn)(uintptr_t)fns[0];
    set_arg_fn set_arg = (set_arg_fn)(uintptr_t)fns[1];
    const uint64_t *t = table;
    int64_t i;
    void *gate = NULL;
    uint64_t waits[HCQA_RUN_WAITS + 1];
    status[0] = status[1] = 0;
    if (context != 0 && nwait < HCQA_RUN_WAITS) {
        /* one CPU: hold the driver's worker until the whole run is enqueued (see runs.py) */
        int32_t err = 0;
        gate = ((user_event_fn)(uintptr_t)fns[6])((void *)(uintptr_t)context, &err);
        if (gate != NULL && err == 0) {
            memcpy(waits, wait, nwait * sizeof(uint64_t));
            waits[nwait++] = (uint64_t)(uintptr_t)gate;
            wait = waits;
        } else {
            gate = NULL;
        }
    }
    for (i = 0; i < n; i++) {
        void *kernel = (void *)(uintptr_t)t[0];
        uint32_t dims = (uint32_t)t[1];
        size_t global[3] = {(size_t)t[2], (size_t)t[3], (size_t)t[4]};
        size_t local[3] = {(size_t)t[5], (size_t)t[6], (size_t)t[7]};
        uint64_t nset = t[8];
        const uint64_t *a = t + 9;
        for (uint64_t j = 0; j < nset; j++, a += 3) {
            int32_t err = hcqa_set_arg(set_arg, kernel, a[0], a[1], a[2]);
            if (err != 0) {
                status[0] = err;
                goto out;
            }
        }
        void *event = NULL;
        int32_t err = enqueue((void *)(uintptr_t)queue, kernel, dims, NULL, global, local,
                              i == 0 ? (uint32_t)nwait : 0,
                              i == 0 && nwait ? (void *const *)wait : NULL, &event);
        if (err != 0) {
            status[0] = err;
            goto out;
        }
        events[i] = (uint64_t)(uintptr_t)event;
        t = a;
    }
out:
    if (gate != NULL) {
        /* complete even after a refusal: what was enqueued runs, as without a gate */
        ((set_status_fn)(uintptr_t)fns[7])(gate, 0 /* CL_COMPLETE */);
        ((release_fn)(uintptr_t)fns[2])(gate);
    }
    if (slot != 0 && i == n && n > 0) {
        callback_fn set_cb = (callback_fn)(uintptr_t)fns[3];
        status[1] = set_cb((void *)(uintptr_t)events[n - 1], 0 /* CL_COMPLETE */,
                           (void *)(uintptr_t)fns[5], (void *)(uintptr_t)slot);
    }
    ((flush_fn)(uintptr_t)fns[4])((void *)(uintptr_t)queue);
    return i;
}

/* Release ``n`` events (a completed run's). */
void hcqa_cl_release(const uint64_t *fns, const uint64_t *events, int64_t n) {
    release_fn release = (release_fn)(uintptr_t)fns[2];
    for (int64_t i = 0; i < n; i++) {
        if (events[i] != 0) release((void *)(uintptr_t)events[i]);
    }
}
