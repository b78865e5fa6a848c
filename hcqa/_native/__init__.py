"""Native code hcqa builds for itself: the C compiler and its on-disk cache.

* ``compiler.py`` -- ``compile_c(source, entry)``: parse the entry's signature, compile
  with the system compiler into a private, content-addressed cache (``$HCQA_CACHE_DIR``,
  else ``~/.cache/hcqa/kernels``), load with ctypes.
* ``lane.py`` (C source in ``lane_c.py``) -- the native engine lane's library: the signal
  store native producers use, the C timeline, and the lane thread itself.
* ``signal_store.h`` -- header-only C for a native producer completing a Signal: store the
  timestamp and the value, then add 1 to each eventfd; or, for a signal of this process
  (``hcqa_signal_complete``), only when a listed waiter needs the value (prepend it to the C
  source that needs it).

It sits at the bottom, beside :mod:`hcqa.errors` (the only hcqa module it imports), so
any layer that needs a piece of C -- the cpu backend's kernels and native runner, the
native engine lane, another backend's completion callback -- can build it.
"""
