"""A loader worker exits when its training process dies, even by SIGKILL.

Why: torch's worker loop notices a dead parent only between index requests (every
``MP_STATUS_CHECK_INTERVAL``, torch's status-check timeout) and then leaves the normal
way, which joins its queue's feeder thread. That thread is blocked writing batches into
the queue's pipe, whose read end the worker and its siblings still hold open (inherited
at fork), so the join never returns. When the OOM killer takes a training process (the
process, not its group), its workers stay, holding their memory (issue 14): main thread
in a futex, feeder thread in ``anon_pipe_write`` (tests/test_worker_orphans.py).

Algorithm: each worker calls `exit_with_parent` at startup (`WorkerInit`, before
the user's ``worker_init_fn``). It records its parent pid (``os.getppid()``) and
the training process's pid (``multiprocessing.parent_process()``: the process that
created the worker, under fork, spawn and forkserver alike). A daemon thread then
wakes every ``POLL_S`` and calls ``os._exit`` as soon as the parent pid has changed
(the kernel re-parents a child the moment its parent dies) or, when the two pids
differ (forkserver: the parent is the fork server, which was seen to stay alive with
its workers after the training process died), the training process is gone or a
zombie. ``os._exit`` skips the interpreter's exit, and with it the join that
hangs. The classic race, a parent that dies before the call, is checked before the
thread starts: the recorded parent is then already the reaper, not the training
process, and the training process is gone, so the worker exits at once. The exit is
silent: the only reader of a report is dead, and a write to a full stderr pipe
could block the exit.

Why not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the *thread* that
forked the child exits, not the process. DataLoader workers are forked by whatever
thread calls ``iter(loader)`` (a `DevicePrefetcher` iterated from a thread, a thread
pool), and persistent workers outlive it; with SIGKILL as the signal, healthy workers
of a live training process die with that thread, far worse than the bug (tried: the
test's thread case then fails, both workers gone as their forking thread ended). The child cannot tell
which thread forked it, and SIGKILL cannot be checked before it acts. A catchable
signal whose handler re-checks ``getppid`` would be safe, but Python runs the
handler only when the worker's main thread returns to the interpreter, a user's
``worker_init_fn`` may replace it, and it would gain less than ``POLL_S``.

Trade-off: up to ``POLL_S`` before a worker notices, and one sleeping thread
per worker whose wake-up costs a ``getppid`` call (under forkserver also a look at
the training process's /proc entry). A worker whose training process lives
is never stopped: under fork and spawn the check is the kernel's own parent link.
tests/test_worker_orphans.py checks that every worker is gone soon after the training
process's SIGKILL (fork and forkserver, and persistent workers whose forking thread had
ended long before), and measures how soon.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Optional

#: Seconds between two checks of the parent in a worker's watchdog thread.
POLL_S = 1.0
#: The exit status of a worker that outlived its training process (nobody is left to read it).
EXIT_STATUS = 1

_watching_in: Optional[int] = None  # pid of the process whose watchdog runs (a fork child has none)


def _gone(pid: int) -> bool:
    """True if ``pid`` no longer runs: no such process, or a zombie (dead, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False  # no /proc here (macOS): kill() alone decided
    return state in ("Z", "X")


def _orphaned(parent: int, training: int) -> bool:
    if os.getppid() != parent:
        return True
    # Only when the training process is not our parent (forkserver) is it watched by pid;
    # otherwise the parent link above is exact and a reused pid cannot mislead it.
    return training != parent and _gone(training)


def _watch(parent: int, training: int) -> None:
    while True:
        time.sleep(POLL_S)
        if _orphaned(parent, training):
            os._exit(EXIT_STATUS)


def exit_with_parent() -> bool:
    """From now on, exit this worker process within ``POLL_S`` of its training process's death.

    Call it in a multiprocessing child (a loader worker). Returns False, and does nothing,
    in a process that multiprocessing did not start (its parent is not a training process
    to follow) or when the watchdog already runs in this process; exits at once if the
    training process is already gone.
    """
    global _watching_in
    creator = multiprocessing.parent_process()
    if creator is None or creator.pid is None or _watching_in == os.getpid():
        return False
    parent, training = os.getppid(), int(creator.pid)
    if parent != training and _gone(training):
        os._exit(EXIT_STATUS)  # died before we looked: ``parent`` is already the reaper
    threading.Thread(target=_watch, args=(parent, training), name="tokenloom-parent-watch", daemon=True).start()
    _watching_in = os.getpid()
    return True
