/* Completing a timeline signal from native code, without the GIL.
 *
 * A hcqa Signal is a 32-byte slot in shared memory (uint64 value, uint64 timestamp in ns) and an
 * eventfd; other processes' waiters add their own eventfds (peers). A native producer (a driver's
 * completion callback, an engine thread running no Python) completes a signal by storing the
 * timestamp, then the value (release: a reader that sees the value sees the timestamp), then adding
 * 1 to every eventfd: the value word is the truth, the eventfd only says "look again".
 *
 * Header-only (static inline): include it in the C source that needs it; hcqa compiles that source
 * with its own C compiler and cache (hcqa/_native/compiler.py).
 */
#ifndef HCQA_SIGNAL_STORE_H
#define HCQA_SIGNAL_STORE_H

#include <errno.h>
#include <stdint.h>
#include <unistd.h>

/* Add 1 to an eventfd; retried on EINTR. An eventfd write fails only at a counter of 2**64-2,
 * which a reader drains long before, so the result is not reported. */
static inline void hcqa_eventfd_add(int fd) {
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* Store ``ns`` (unless 0: keep the slot's timestamp) and ``value``, then wake ``fds``. */
static inline void hcqa_signal_store(uint64_t *value_slot, uint64_t value, uint64_t *stamp_slot,
                                     uint64_t ns, const int *fds, int nfds) {
    if (stamp_slot != 0 && ns != 0) __atomic_store_n(stamp_slot, ns, __ATOMIC_RELAXED);
    if (value_slot != 0) __atomic_store_n(value_slot, value, __ATOMIC_RELEASE);
    for (int i = 0; i < nfds; i++) hcqa_eventfd_add(fds[i]);
}

#endif
