/* Completing a timeline signal from native code, without the GIL.
 *
 * A hcqa Signal is a 32-byte slot in shared memory (uint64 value, uint64 timestamp in ns) and an
 * eventfd; other processes' waiters add their own eventfds (peers). A native producer (a driver's
 * completion callback, an engine thread running no Python) completes a signal by storing the
 * timestamp, then the value (release: a reader that sees the value sees the timestamp), then adding
 * 1 to every eventfd: the value word is the truth, the eventfd only says "look again".
 *
 * ``hcqa_signal_complete`` is the store for a signal of this process (one whose slot keeps the
 * wake word: ``Signal._wake_at``): it writes the eventfd only when a waiter of this process is
 * listed with a target the value reaches, or once the process has forked -- a completion nobody
 * waits for costs no syscall. The loader of a source that uses it registers
 * ``hcqa_store_note_fork`` as an at-fork hook (``hcqa/devices/nativestores.py``, ``watch_forks``).
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

/* Set (by an at-fork hook) once the process forked: waiters may then live in a process whose
 * wake words this one can't see, so every ``hcqa_signal_complete`` writes the eventfd. */
static int hcqa_store_forked;

void hcqa_store_note_fork(void) { __atomic_store_n(&hcqa_store_forked, 1, __ATOMIC_RELAXED); }

/* Store ``value`` into a signal of this process, then add 1 to ``fd`` (unless < 0) only when the
 * slot's wake word (``value_slot[2]``: the lowest target a waiter of this process listed, 0 for
 * a thread waiting alone, 2**64-1 for nobody; see ParkingLot._rearm) is at or below it, or the
 * process has forked. No wake-up is lost: a waiter lowers the wake word, then reads the value;
 * this stores the value, then reads the wake word, both sequentially consistent (Dekker's
 * pattern): at least one of the two sees the other's store. */
static inline void hcqa_signal_complete(uint64_t *value_slot, uint64_t value, int fd) {
    __atomic_store_n(value_slot, value, __ATOMIC_SEQ_CST);
    uint64_t wake_at = __atomic_load_n(&value_slot[2], __ATOMIC_SEQ_CST);
    if (fd >= 0 && (value >= wake_at || __atomic_load_n(&hcqa_store_forked, __ATOMIC_RELAXED)))
        hcqa_eventfd_add(fd);
}

#endif
