"""The machinery behind :mod:`hcqa.graph` (private; users import ``hcqa.graph``).

* ``build.py`` -- at the end of a capture, the graph is built once: the recorded batches
  become per-queue parts with their cross-queue waits, launches in a row fused where the
  device offers it (the fusion seam, ``hcqa/devices/fusion.py``: no backend is named here);
* ``patch.py`` -- at every replay, the symbolic ints are resolved once each and only the
  commands (and fused runs, through ``FusedRun.bound``) whose values changed are rebuilt.

The capture context itself -- which graph, if any, records in this context -- is read by
every enqueue, so it sits in the device core (``hcqa/devices/capture.py``).
"""
