"""One loader at a time starts its worker processes, in a process that runs several loaders.

Forking copies the whole process as it is at that instant, locks held by other threads
included, and those stay held in the child for ever. Two loaders that start their workers
from two threads at once (ranks simulated as threads, a training loader beside an
evaluation loader started from a callback thread) fork while the other is inside its own
fork: libraries that guard their state across forks refuse that (filelock's fork audit, on
Python 3.12 and later, raises ``RuntimeError: os.fork is unsafe while filelock is changing
descriptor ownership``), and others can leave a child waiting on a lock nobody will release.

`WORKER_START` serializes the starts of tokenloom's loaders within one process; a start
takes milliseconds per worker, so a loader waits at most that long for another.
"""

from __future__ import annotations

import threading

#: Held while a loader creates its iterator, which is where StatefulDataLoader forks its workers.
WORKER_START = threading.Lock()
