"""Process-wide hooks (fork, exit), installed by the code that needs them when it first needs them.

A module that keeps per-process state (a thread pool, a lock, files open for the first fetches)
must reset it in a forked child, or wait before a fork, or stop its threads at exit. Registered
when the module is imported, the hooks would run in every process that merely imports tokenloom;
registered with `at_fork` / `at_exit` when the state is first made, they run only where there is
state, once per process whatever the number of calls.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Callable, Optional, Set

_DONE: Set[str] = set()
_LOCK = threading.Lock()


def _once(key: str, register: Callable[[], None]) -> None:
    if key in _DONE:
        return
    with _LOCK:
        if key not in _DONE:
            register()
            _DONE.add(key)


def at_fork(key: str, *, before: Optional[Callable[[], None]] = None,
            after_in_parent: Optional[Callable[[], None]] = None,
            after_in_child: Optional[Callable[[], None]] = None) -> None:
    """``os.register_at_fork`` with these hooks, the first time ``key`` asks (a fork inherits the set:
    hooks registered before it stay registered in the child)."""
    hooks = {k: v for k, v in (("before", before), ("after_in_parent", after_in_parent),
                               ("after_in_child", after_in_child)) if v is not None}
    _once(f"fork:{key}", lambda: os.register_at_fork(**hooks))


def at_exit(key: str, fn: Callable[[], None]) -> None:
    """``atexit.register(fn)`` the first time ``key`` asks."""
    _once(f"exit:{key}", lambda: atexit.register(fn))


def registered() -> Set[str]:
    """The hooks registered so far (for tests)."""
    return set(_DONE)
