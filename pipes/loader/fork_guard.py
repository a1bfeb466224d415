"""Workers are never forked from a training process that runs a native thread pool a fork cannot copy.

A fork copies the whole memory of the process but only the thread that forks. A native library's
thread pool (Rust or C++ threads, invisible to Python) is copied as data: its queues, counters and
locks, some perhaps held at that instant by a thread that does not exist in the child. A library
that knows this guards itself (`tokenizers` turns its parallelism off in a forked child, Arrow
re-creates its pools); one that does not can leave the child waiting for ever on a lock or a
worker that will never come. fastokens' encode pool (threads named ``fastokens-N``) is one: the
training process starts it when it encodes with fastokens itself (an evaluation set, prompts), and
tokenloom never starts it there on the loader's account (fastokens_engine.py).

`unsafe_pools` lists the live threads of such pools in this process (by the names their libraries
give them; Linux's /proc). Where there are any, the loader starts this iterator's workers with
``forkserver`` instead of ``fork`` (bridge.py): a fork server is a fresh interpreter started for
the purpose, and the workers forked from it inherit nothing of the training process. The batches
are the same; the first one waits for the fork server to start and import the loader once, and
batches cross through the pipe instead of the workers' shared-memory rings; the fork server keeps
the environment of its start, so a variable the training process sets later does not reach its
workers. A start method the user chose is kept as it is.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from typing import Any, List

#: Thread-name prefixes of native pools that do not survive a fork, and whose they are.
UNSAFE_POOLS = {"fastokens-": "fastokens' encode pool"}


def unsafe_pools() -> List[str]:
    """``"<thread name> (<whose>)"`` for each live thread of `UNSAFE_POOLS` in this process."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # not Linux: no way to see native threads by name
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        for prefix, whose in UNSAFE_POOLS.items():
            if name.startswith(prefix):
                found.append(f"{name} ({whose})")
    return sorted(found)


def picklable(obj: Any) -> bool:
    """Whether ``obj`` (a graph factory) can be sent to a worker that does not inherit it."""
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - a closure, a lambda, a lock: whatever pickle refuses
        return False
    return True


def safe_context(chosen: Any, factory: Any) -> Any:
    """The multiprocessing context to start a child that builds ``factory``'s graphs with: ``chosen``
    (a DataLoader's ``multiprocessing_context``: None, a start method's name or a context; None is the
    default method), except ``forkserver`` where that would fork a process running `unsafe_pools` and
    the factory can be sent to a clean one, as the loader starts its workers (bridge.py)."""
    if chosen is None:
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    else:
        method = chosen if isinstance(chosen, str) else chosen.get_start_method()
    if method == "fork" and unsafe_pools() and picklable(factory):
        method = "forkserver"
    return multiprocessing.get_context(method)
