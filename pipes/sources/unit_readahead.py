"""Read-ahead of line units (jsonl, json arrays, text) for remote and slow storage.

A line unit is one byte range of one file, known from listing (`LineUnitTable`), and the
sharder's plan says which units a reader loads next (`ShardUnits.ahead`). Read
synchronously, every unit costs the worker a request's latency and transfer between two
stretches of tokenizing, as a row group does without readahead.py (benchmarks/remote.py
--format jsonl measures it; see docs/performance.md). Here the next units
are fetched by the process's read-ahead threads (the pool readahead.py keeps per process),
each with one positional read of its range (``read_at``, safe from several threads on
pyarrow's files), or reads of ``PART_BYTES`` at once for a longer unit the reader is about to
wait for (a start or a restore), so the reader finds its unit's bytes in memory. A unit the plan brings back soon (a small source's next epoch)
keeps its bytes until then.

The same rules as for row groups: the reader asks for the same units in the same order and
gets the listed range of the listed file either way, only earlier; nothing fetched is in the
state, and a restore plans from the restored position; bytes fetched and not yet taken are
bounded by the reader's budget (``TOKENLOOM_READAHEAD_BYTES``, readahead.py's ``DEFAULT_BYTES``
by default, reserved in the reader's order, a unit larger than the budget fetched alone) and at
most ``DEPTH`` units; an error while fetching a unit is raised when the reader reaches it, naming
the unit. Units of compressed files are not read ahead here (their ranges are offsets in the
decompressed stream; compressed.py reads such a file in order).
In a loader worker, fetches start at the reader's reset (a fresh start or a restore), so the
first units of all sources come at once; elsewhere they start with the reader's first read
in its process, so a graph that is only built and reset (the training process before the
workers fork) fetches nothing. The units of a remote jsonl or text source's line files that its workers
read first come fetched already, by the process that built the loader from the handles listing
kept open (first_fetches.py): a worker takes them by ``(file, start)`` instead of opening the
file and fetching, two round trips after it starts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, Optional

from .readahead import DEPTH, OPEN_FILES, in_loader_worker, fetch_pool, read_range, fill_plan

#: A unit longer than this, that the reader will wait for, is fetched as several range reads at once (a
#: store's bandwidth is per connection: a 4 MB unit took 0.2 s on one connection at 20 MB/s, 0.05 s in 1 MiB
#: parts). Units further ahead are one read each: in parts they ran at 0.96x whole units' tokens/s behind
#: 100 ms (4 runs each, the requests' own cost), for no wait to save.
PART_BYTES = 1 << 20


class UnitReadAhead:
    """Fetches the byte ranges of the units a reader reads next (see the module docstring).

    ``opener(file)`` opens file ``file`` (checking it is the listed one); ``ranges[u]`` is unit
    ``u``'s ``(file, start, end)``; ``upcoming()`` gives the units the reader will read after the
    one it reads now, in order (``None`` for one read some other way, a compressed file's).
    """

    def __init__(self, opener: Callable[[int], Any], ranges: Callable[[int], tuple],
                 upcoming: Callable[[], Iterable[Optional[int]]], *, budget: int, depth: int = DEPTH,
                 first: Optional[Any] = None):
        if budget <= 0:
            raise ValueError(f"{budget=} must be > 0 (0 is no read-ahead: read synchronously)")
        self.opener, self.ranges, self.upcoming = opener, ranges, upcoming
        self.first = first  # FirstFetches: units the building process fetched, by (file, start)
        self.budget, self.depth = int(budget), int(depth)
        self._lock = threading.Lock()
        self._files: "OrderedDict[int, Future]" = OrderedDict()  # file -> Future[handle]
        self._ahead: Deque[int] = deque()
        self._keys: Iterator[Optional[int]] = iter(())
        self._key: Optional[int] = None  # the last key the plan took (fill_plan)
        self._pending: Dict[int, tuple] = {}  # unit -> (Future[bytes], size)
        self._held = 0
        self._planned = False
        self._last: tuple = (None, b"")  # the unit read last and its bytes: consecutive slices of one unit
        self.counts = {"ready": 0, "waited": 0, "inline": 0, "peak_bytes": 0, "fetched_bytes": 0, "first": 0}

    def restart(self) -> None:
        """Forget the plan and plan again from the reader's position: in a loader worker its fetches
        start now, so the first units of all sources come at once while the worker sets up (rather than
        each at its source's first read, one source after another); elsewhere with the next read."""
        with self._lock:
            self._drop_all()
            self._planned = False
            self._last = (None, b"")
            if in_loader_worker():
                self._keys, self._key, self._planned = iter(self.upcoming()), None, True
                self._schedule()

    def read(self, u: int, inline: Callable[[], bytes]) -> bytes:
        """Unit ``u``'s bytes: fetched ahead, else ``inline()``. Raises what fetching raised."""
        if self._last[0] == u:  # an elastic resume's one-row slices come sorted by unit
            return self._last[1]
        data = self._read(u, inline)
        self._last = (u, data)
        return data

    def _read(self, u: int, inline: Callable[[], bytes]) -> bytes:
        with self._lock:
            if self._planned and u in self._ahead:
                while True:
                    k = self._ahead.popleft()
                    if k == u:
                        break
                    self._drop(k)  # planned, but the reader went past it
            else:  # not where the plan was (or the first read): plan from the reader's position
                self._drop_all()
                self._keys, self._key, self._planned = iter(self.upcoming()), None, True
            got = self._pending.pop(u, None)
            # a small source's next epoch can bring this unit back within the plan: its bytes serve both reads
            again = got is not None and u in self._ahead
            if again:
                self._pending[u] = got
            self._schedule()
        if got is None:
            self.counts["inline"] += 1
            return inline()
        fut, size = got
        self.counts["ready" if fut.done() else "waited"] += 1
        try:
            return fut.result()
        finally:
            if not again:
                with self._lock:
                    self._held -= size
                    self._schedule()

    def stats(self) -> Dict[str, Any]:
        return {"budget_bytes": self.budget, "held_bytes": self._held, **self.counts}

    # -- under self._lock

    def _drop(self, u: int) -> None:
        got = self._pending.pop(u, None)
        if got is not None:
            self._held -= got[1]  # its bytes, if they still come, are let go with the future

    def _drop_all(self) -> None:
        for u in list(self._pending):
            self._drop(u)
        self._ahead.clear()
        self._keys = iter(())

    def _schedule(self) -> None:
        self._key = fill_plan(self._ahead, self._keys, self.depth, self._key)
        pool = fetch_pool()
        for u in self._ahead:
            if u in self._pending:
                continue
            file, start, end = self.ranges(u)
            size = end - start
            if self._held and self._held + size > self.budget:
                break  # the budget goes to units in order
            # Only a unit the reader will wait for (nothing else held or on its way: a start, a restore, a
            # jump) is fetched in parts: parts are more requests, and further ahead one read has time enough.
            split = not self._held
            self._held += size
            self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self._held)
            fut: Future = Future()
            self._pending[u] = (fut, size)
            got = self.first.take((file, start)) if self.first is not None else None
            if got is not None:  # fetched before this worker started (first_fetches.py): no request
                fut.set_result(b"".join(data for _, data in sorted(got[1], key=lambda c: c[0])))
                self.counts["first"] += 1
                continue
            self.counts["fetched_bytes"] += size
            parts = [(off, min(PART_BYTES, start + size - off)) for off in range(start, start + size, PART_BYTES)]
            if len(parts) <= 1 or not split:
                pool.submit(lambda fut=fut, file=file, start=start, size=size: self._fetch(fut, file, start, size))
            else:
                whole = _Parts(fut, size, len(parts))
                for off, n in parts:
                    pool.submit(lambda whole=whole, file=file, at=off - start, off=off, n=n:
                                self._fetch_part(whole, file, at, off, n))

    # -- in a pool thread

    def _handle(self, i: int) -> Any:
        with self._lock:
            fut = self._files.get(i)
            mine = fut is None
            if mine:
                fut = self._files[i] = Future()
                while len(self._files) > OPEN_FILES:
                    old = next(iter(self._files))
                    if old == i:
                        break
                    del self._files[old]
            else:
                self._files.move_to_end(i)
        if mine:
            try:
                fut.set_result(self.opener(i))
            except BaseException as e:  # noqa: BLE001 - raised where the reader reads the unit
                fut.set_exception(e)
                with self._lock:
                    if self._files.get(i) is fut:  # a later unit of the file opens it again
                        del self._files[i]
        return fut.result()

    def _fetch_part(self, whole: "_Parts", file: int, at: int, off: int, n: int) -> None:
        try:
            whole.put(at, read_range(self._handle(file), off, n))  # a short part would leave a hole: an error
        except BaseException as e:  # noqa: BLE001 - raised where the reader reads the unit
            whole.fail(e)

    def _fetch(self, fut: Future, file: int, start: int, size: int) -> None:
        try:
            data = self._handle(file).read_at(size, start)
            fut.set_result(data if isinstance(data, bytes) else bytes(data))
        except BaseException as e:  # noqa: BLE001 - raised where the reader reads the unit
            fut.set_exception(e)


class _Parts:
    """A unit fetched as several range reads at once: its future gets the bytes when the last part is in,
    or the first error."""

    def __init__(self, fut: Future, size: int, parts: int):
        self.fut, self.buf, self.left = fut, bytearray(size), parts
        self.lock = threading.Lock()

    def put(self, at: int, data: Any) -> None:
        self.buf[at:at + len(data)] = data
        self._one()

    def fail(self, e: BaseException) -> None:
        with self.lock:
            if not self.fut.done():
                self.fut.set_exception(e)
        self._one()

    def _one(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0 and not self.fut.done():
                self.fut.set_result(bytes(self.buf))
                self.buf = bytearray()
