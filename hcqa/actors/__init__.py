"""Queue actors (trio tasks) and what executes their runs of commands.

* ``actor.py`` -- :class:`QueueActor`: one trio task per device queue; it awaits every
  ``Wait`` on the event loop and hands runs of the other commands to its executor;
* ``executor.py`` -- :class:`Executor`, the seam: how a backend executes runs of commands
  and reports completion (through signals only);
* ``engine.py`` -- :class:`Engine`, the executor the cpu backend uses: one thread per
  queue, dispatching on the command's type through a handler table.

The actors know no device class: they name their device through :class:`QueueOwner`.
"""

from hcqa.actors.actor import Batch, QueueActor, QueueOwner, QueueStatistics
from hcqa.actors.engine import Engine
from hcqa.actors.executor import Executor

__all__ = ["Batch", "Engine", "Executor", "QueueActor", "QueueOwner", "QueueStatistics"]
