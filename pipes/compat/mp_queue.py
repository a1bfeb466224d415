"""Loader queues that write a small message in the calling thread, not through a feeder thread.

A `multiprocessing.Queue` never writes in ``put``: it appends the message to a list,
wakes a feeder thread, and that thread pickles the message and writes it into the
pipe. The thread exists so that ``put`` never blocks on a full pipe. Its price is
paid on every message: a thread wake-up, a hand-over of the GIL to the feeder and
back, and the locking around both. torch's DataLoader sends one message per batch
each way (an index to the worker, the batch back; with tokenloom's ring the batch
message is about a kilobyte), so both the training process and every worker pay it per batch.

`DirectQueue.put` pickles the message and, when the pipe has room for it, writes it
at once under the queue's write lock: a write that fits never blocks. A message that
does not fit (room is taken as half the pipe's capacity less what is unread, so a
write cannot wait on pipe pages either) goes through the feeder as before, and so
does every later message until the feeder has written all it was given, so messages
keep their order. Where the room cannot be measured (not Linux, or a queue whose
internals differ from what this module expects) it is a plain `multiprocessing.Queue`.

`DirectQueue.get` with a timeout (how torch's loops read both queues) reads a message that is
already in the pipe without building the selector multiprocessing polls through on each
call; one ioctl tells whether anything is unread. With nothing unread it is multiprocessing's
get, which waits.

What it saves per batch: docs/performance.md ("Design figures, by module"), measured by
benchmarks/cache.py's loader.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context as mpc
import multiprocessing.queues as mpq
import pickle
import queue
import struct
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, Optional

try:
    import fcntl
    import termios

    _F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)  # Linux's number; named in Python >= 3.10 on Linux
    _FIONREAD = termios.FIONREAD
except ImportError:  # not a POSIX system: the feeder thread always
    fcntl = None  # type: ignore[assignment]

#: What `DirectQueue` uses of `multiprocessing.queues.Queue`'s internals (Python 3.9-3.13).
_USES = ("_closed", "_sem", "_wlock", "_writer", "_send_bytes", "_reset", "_rlock", "_reader", "_poll", "_recv_bytes")
_HEADER = 4  # Connection.send_bytes' length prefix (messages under 2 GiB)
_LOCK_WAIT = 0.001  # seconds: a direct write holds the lock for microseconds


class _Pickled:
    """A message pickled already, handed to the feeder thread without pickling it twice
    (torch's reducers move tensors to shared memory as they pickle: that must happen once)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return pickle.loads, (self.data,)


class DirectQueue(mpq.Queue):
    """A `multiprocessing.Queue` whose ``put`` writes a message that fits into the pipe at once
    (see the module docstring). Readers see the same messages in the same order."""

    def _reset(self, after_fork: bool = False) -> None:
        super()._reset(after_fork)
        # Per process: a fork or an unpickled copy has no feeder thread of its own yet.
        self._capacity = _pipe_capacity(self)
        self._handed = self._written = 0  # messages handed to the feeder thread, and written by it
        self._send_bytes = self._send_counted  # what the feeder thread writes with (captured when it starts)
        self._put_lock = threading.Lock()

    def _send_counted(self, data: Any) -> None:
        self._writer.send_bytes(data)
        self._written += 1  # under the write lock, like the write itself

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if self._capacity is None:
            return super().put(obj, block, timeout)
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data = ForkingPickler.dumps(obj)
        if not self._sem.acquire(block, timeout):
            raise queue.Full
        with self._put_lock:
            # Never wait long for the write lock: its holder may be writing a big message into a
            # full pipe, and the process that would empty it may be waiting on this one.
            if self._wlock.acquire(timeout=_LOCK_WAIT):
                try:
                    # Direct only when the feeder has written all it was handed: a direct write must
                    # not overtake a message of this process that is still on its way.
                    if self._handed == self._written and len(data) + _HEADER <= self._room():
                        self._writer.send_bytes(data)
                        return
                finally:
                    self._wlock.release()
            self._handed += 1
        # It does not fit now: the feeder thread writes it once the reader has made room.
        self._sem.release()
        super().put(_Pickled(bytes(data)), block, timeout)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        # torch's loops call get(timeout=...) for every message (the training process for each
        # batch, a worker for each index). multiprocessing then polls the pipe through a selector
        # it builds and registers per call; a message is usually waiting already, and one ioctl
        # says so. Otherwise (nothing unread, or another form of get) it is multiprocessing's get.
        if self._capacity is None or not block or timeout is None or not self._unread():
            return super().get(block, timeout)
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        deadline = time.monotonic() + timeout
        if not self._rlock.acquire(True, timeout):
            raise queue.Empty
        try:
            # Another reader may have taken what was unread while this one waited for the lock.
            if not self._unread() and not self._poll(max(deadline - time.monotonic(), 0)):
                raise queue.Empty
            data = self._recv_bytes()
            self._sem.release()
        finally:
            self._rlock.release()
        return ForkingPickler.loads(data)

    def _unread(self) -> int:
        try:
            return struct.unpack("i", fcntl.ioctl(self._reader.fileno(), _FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # closed here: multiprocessing's get says so
            return 0

    def _room(self) -> int:
        unread = struct.unpack("i", fcntl.ioctl(self._writer.fileno(), _FIONREAD, b"\0\0\0\0"))[0]
        return self._capacity // 2 - unread


def _pipe_capacity(q: mpq.Queue) -> Optional[int]:
    """The capacity of the queue's pipe, or None when a direct write cannot be made safe here."""
    if fcntl is None or not all(hasattr(q, name) for name in _USES) or q._wlock is None:
        return None
    try:
        fd = q._writer.fileno()
        capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
        fcntl.ioctl(fd, _FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):  # not a pipe, or closed
        return None
    return int(capacity)


class _DirectQueues:
    def Queue(self, maxsize: int = 0) -> DirectQueue:  # noqa: N802 - multiprocessing's name
        return DirectQueue(maxsize, ctx=self.get_context())


class DirectSpawnContext(_DirectQueues, mpc.SpawnContext):
    pass


_DIRECT: Dict[type, type] = {mpc.SpawnContext: DirectSpawnContext}

if sys.platform != "win32":  # multiprocessing has no fork contexts there
    class DirectForkContext(_DirectQueues, mpc.ForkContext):
        pass

    class DirectForkServerContext(_DirectQueues, mpc.ForkServerContext):
        pass

    _DIRECT.update({mpc.ForkContext: DirectForkContext, mpc.ForkServerContext: DirectForkServerContext})


def direct_context(context: Any) -> Any:
    """The DataLoader's ``multiprocessing_context`` (None, a start method's name, or a context)
    as the same start method with `DirectQueue` queues; a context of another kind as given.
    None resolves to the default start method without fixing it for the rest of the program."""
    if context is None:
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        context = multiprocessing.get_context(method)
    elif isinstance(context, str):
        context = multiprocessing.get_context(context)
    direct = _DIRECT.get(type(context))
    return direct() if direct is not None else context
