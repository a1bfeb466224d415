"""Let a helper thread be woken without preempting the thread that woke it.

Linux's fair scheduler lets a task that wakes up preempt the task running on the
CPU it is placed on. When every core is busy (loader workers on all of them),
the training thread that frees a prefetch slot wakes the prefetch thread, which
is often placed on the training thread's own CPU and preempts it. The prefetch
thread then blocks at once on the GIL the training thread holds, but the training
thread has lost its CPU: it waits behind a worker for the rest of a time slice,
with its batch already in hand (an involuntary context switch in ``next()``; measured
through `DevicePrefetcher` by benchmarks/stall.py, see docs/performance.md).

A thread whose policy is ``SCHED_BATCH`` never preempts on wake-up (the kernel
checks wake-up preemption for ``SCHED_NORMAL`` tasks only); it runs at the next
scheduling point on its CPU, within a tick. So `quiet_wakeup` switches the
calling thread to ``SCHED_BATCH`` for the wait and back when it is woken.
Only for the wait: the prefetch thread is woken several times per batch while it
receives one through a pipe, and with ``SCHED_BATCH`` throughout each of those
would wait for a tick too, and it would fall behind the loop.

Cost: two ``sched_setscheduler`` calls per wait. Elsewhere than Linux,
for a thread that is not ``SCHED_OTHER`` (a real-time or already-batch training
setup), or if the kernel refuses, it does nothing. The nice value is kept.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

_SUPPORTED = all(hasattr(os, name) for name in ("sched_setscheduler", "sched_getscheduler", "SCHED_BATCH",
                                                "SCHED_OTHER"))
_local = threading.local()


@contextlib.contextmanager
def quiet_wakeup() -> Iterator[None]:
    """Within the block, the calling thread, once woken, waits for a CPU instead of taking one."""
    if not _SUPPORTED or getattr(_local, "off", False):
        yield
        return
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            _local.off = True  # a policy the user chose: leave it alone
            yield
            return
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        _local.off = True
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
