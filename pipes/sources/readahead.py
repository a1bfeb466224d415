"""Read-ahead of parquet row groups, for remote and slow storage.

A reader reads one row group per work unit, and the sharder's plan says which units
come next (`ShardUnits.ahead`). Read synchronously, every unit costs the worker a
request's latency and transfer on the critical path, between two stretches of
tokenizing. With read-ahead, a few daemon threads per loader worker fetch the byte
ranges of the next units' column chunks while the worker tokenizes, and the reader
decodes the row group from those bytes when it reaches it. The ranges come from the
file's footer: the bytes listing read (parquet.py ships a remote source's footers to
the workers), else read once per file and worker; a file is opened (pyarrow's size
lookup, one request) once per worker.

- **Order and state do not change.** The reader asks for the same row groups in the
  same order and decodes them with pyarrow from the same bytes; read-ahead only
  changes when bytes arrive. Nothing fetched goes into the state: the reader's state
  is still its position, and a restore starts fetching from the restored position.
- **Bounded.** Bytes fetched (or in flight) and not yet taken by the reader are
  counted against a budget (``TOKENLOOM_READAHEAD_BYTES``, default ``DEFAULT_BYTES``,
  ``64 << 20`` per reader, and at most ``DEPTH`` units ahead); ranges are reserved in the
  reader's order, so a later unit never takes the budget from an earlier one, and a unit
  larger than the budget is fetched alone. Footers are kept for ``max(OPEN_FILES, 2 * DEPTH)``
  files. The budget is per reader, not shared by a worker's sources (unlike the decoded rows,
  ``read_budget``, row_windows.py): a shared one must decide which source's fetches wait while
  the mix draws elsewhere, and a source whose next unit is not fetched then reads it on the
  critical path; with many remote sources, lower ``TOKENLOOM_READAHEAD_BYTES`` (a worker holds up
  to sources x budget of compressed bytes ahead). A row group read in windows keeps its fetched
  (compressed) bytes until the reader leaves it (`read` with ``whole=False``).
- **Parallel.** Ranges longer than ``PART_BYTES`` are fetched as several range reads
  at once (an object store's bandwidth is per connection); column chunks closer than
  ``HOLE_BYTES`` are read as one range.
- **Started early.** In a loader worker, a reader's fetches start at ``reset`` (a fresh
  start or a restore), so the first units of all sources arrive in parallel while the
  worker sets up. Elsewhere (the training process, ``num_workers=0``) they start when the
  first reader of the process reads, for every reader reset there at once: a graph
  that is only reset (as the loader does in the training process for an elastic
  resume) fetches nothing.
- **A unit read again soon is fetched once.** A small source's next epoch can bring a unit
  back within the plan; its bytes stay (counted in the budget) until that read.
- **The first units before the workers start.** The process that builds a loader fetches
  the first units of its workers' shards of a remote source, up to ``FIRST_SHARD_BYTES`` a
  shard, in a few joined requests (first_fetches.py's `FirstFetches`, started by the
  recipe as soon as listing has read the footers, with the files listing opened), and a fork
  waits for those fetches: a worker starts with their bytes in its memory and takes them by
  key instead of opening the files and fetching (two round trips after the fork).
- **Errors where a synchronous read has them.** An error while fetching a unit (or its file's footer)
  is kept with that unit and raised when the reader reaches it, so the reader names
  the file and row group as a synchronous read does; a fetch never leaves the reader
  waiting on nothing (every task ends by setting its result or its error).
- **Threads** are daemon threads, started in the process that reads (a loader worker,
  after the fork), at most ``THREADS`` per process whatever the number of readers.
  Remote filesystems are used through the process's own copy (`process_fs`).

Where: ``TOKENLOOM_READAHEAD=auto`` (the default) reads ahead from remote filesystems
(S3, GCS, HDFS, ...) and reads local files synchronously, from the page cache, where
there is no latency to hide; ``all`` reads ahead from local files too, ``0`` nowhere.

The trade-off: a worker holds up to its budget and ``DEPTH`` units fetched ahead per
source, spends a little more CPU per token (the store's own included), and may fetch
units a restore then drops; the building process holds up to ``FIRST_SHARD_BYTES`` per
shard and source until the fork. A first batch from remote storage still waits for four
round trips in a row: listing, pyarrow's size lookup, footer, first units.
benchmarks/remote.py (RESULTS.md ``remote``) measures tokens per second and the first
batch behind a slow store against local disk, with read-ahead on, off, and forced on for
local disk; figures in docs/performance.md.
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from ..process_hooks import at_exit, at_fork
from .parquet_footer import footer_bytes

if TYPE_CHECKING:
    from .first_fetches import FirstFetches

log = logging.getLogger(__name__)

ENV = "TOKENLOOM_READAHEAD"
ENV_BYTES = "TOKENLOOM_READAHEAD_BYTES"
#: Where read-ahead runs, by the value of ``TOKENLOOM_READAHEAD``.
MODES = {"": "auto", "auto": "auto", "1": "auto", "on": "auto", "true": "auto", "yes": "auto",
         "all": "all", "0": "off", "off": "off", "false": "off", "no": "off"}
#: Bytes one reader may hold fetched ahead (or in flight), by default.
DEFAULT_BYTES = 64 << 20
#: Units one reader fetches ahead at most.
DEPTH = 16
#: Fetch threads per process, shared by its readers.
THREADS = 16
#: A range longer than this is fetched as several range reads at once.
PART_BYTES = 8 << 20
#: Column chunks closer than this are fetched as one range (pyarrow's own hole size for S3).
HOLE_BYTES = 8 << 10
#: pyarrow reads up to 100 bytes past a column chunk for files of parquet-mr before 1.2.9 (PARQUET-816).
PAD_BYTES = 100
#: Footers (and handles) one reader keeps, at least.
OPEN_FILES = 8

Key = Tuple[int, int]  # (file index, row group)


def _parse_bytes(text: str) -> int:
    t = text.strip().lower().rstrip("b").rstrip("i")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:] if t else "", 1)
    try:
        value = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise ValueError(f"{ENV_BYTES}={text!r} is not a size; write bytes, or e.g. 64M or 1G") from None
    if value < 0:
        raise ValueError(f"{ENV_BYTES}={text!r} must be >= 0")
    return int(value * scale)


def configured() -> Tuple[str, int]:
    """``(mode, bytes)`` from ``TOKENLOOM_READAHEAD`` and ``TOKENLOOM_READAHEAD_BYTES``."""
    raw = os.environ.get(ENV, "auto")
    mode = MODES.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"{ENV}={raw!r} must be auto (remote files only, the default), all (local files too) or 0")
    size = os.environ.get(ENV_BYTES)
    return mode, DEFAULT_BYTES if size is None or not size.strip() else _parse_bytes(size)


def budget_for(filesystems: Iterable[Any], explicit: Optional[int] = None) -> int:
    """The read-ahead budget in bytes of a reader of files on ``filesystems`` (0: read synchronously):
    ``explicit`` when given, else by ``TOKENLOOM_READAHEAD`` (module docstring)."""
    if explicit is not None:
        if explicit < 0:
            raise ValueError(f"readahead={explicit} must be >= 0 bytes (0: read synchronously)")
        return int(explicit)
    mode, size = configured()
    if mode == "off":
        return 0
    if mode == "all":
        return size
    return size if any(fs.type_name != "local" for fs in filesystems) else 0


# --- the per-process pool of daemon threads --------------------------------------------------

class _Pool:
    """Daemon threads running submitted callables in order; made in (and for) one process."""

    def __init__(self, threads: int):
        self.pid = os.getpid()
        self.queue: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._run, name=f"tokenloom-readahead-{i}", daemon=True)
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while True:
            task = self.queue.get()
            if task is None:  # the interpreter is exiting (_shutdown)
                return
            try:
                task()
            except BaseException:  # tasks keep their own errors; this is a bug, never a reason to stop
                log.exception("read-ahead task failed")

    def submit(self, task: Callable[[], None]) -> None:
        self.queue.put(task)


_POOL: Optional[_Pool] = None
_POOL_LOCK = threading.Lock()
#: Read-aheads reset in this process whose fetches start with the process's first read.
_WAITING: "weakref.WeakSet[RowGroupReadAhead]" = weakref.WeakSet()


def _hooks() -> None:
    at_exit("readahead", _shutdown)
    at_fork("readahead", after_in_child=_after_fork)


def fetch_pool() -> _Pool:
    global _POOL
    _hooks()
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = _Pool(THREADS)
        return _POOL


def _shutdown() -> None:
    """At exit, let this process's fetch threads end before the interpreter does: a daemon thread
    still inside pyarrow while the interpreter finalizes aborts the process ("terminate called
    without an active exception", 1 exit in ~12 of a reader in the training process)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is None or pool.pid != os.getpid():
        return
    for _ in pool.threads:
        pool.queue.put(None)
    deadline = time.monotonic() + 5  # a fetch hung on the network is left behind after that
    for t in pool.threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _after_fork() -> None:
    global _POOL, _POOL_LOCK, _WAITING
    _POOL, _POOL_LOCK, _WAITING = None, threading.Lock(), weakref.WeakSet()


def in_loader_worker() -> bool:
    """Whether this is a DataLoader worker process (where a reset is followed by reading)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def _start_waiting() -> None:
    with _POOL_LOCK:
        waiting = list(_WAITING)
        _WAITING.clear()
    for ra in waiting:
        ra._start()


#: Keys `fill_plan` looks at per call, at most, per unit of depth: an endless plan of one unit (a small
#: file, every epoch) yields that unit forever, and skipping its repeats must end somewhere.
LOOK_PER_DEPTH = 4


def fill_plan(ahead: Deque[Any], keys: Iterator[Any], depth: int, last: Any) -> Any:
    """Append the next keys to ``ahead`` until it holds ``depth``: ``None`` (a unit read some other way)
    is skipped and a unit read again at once is not fetched twice. At most ``LOOK_PER_DEPTH * depth``
    keys are looked at (the next call goes on from there). Returns the last key taken."""
    for _ in range(LOOK_PER_DEPTH * depth):
        if len(ahead) >= depth:
            break
        try:
            k = next(keys)
        except StopIteration:
            break
        if k is not None and k != last:
            ahead.append(k)
        last = k
    return last


# --- byte ranges of a row group -----------------------------------------------------------------

def chunk_ranges(meta: pq.FileMetaData, row_group: int, columns: Optional[Sequence[str]],
                 size: int) -> List[Tuple[int, int]]:
    """``(offset, length)`` of the column chunks pyarrow reads for ``columns`` (top-level names; None:
    all) of ``row_group``, as pyarrow computes them, padded, merged across holes under ``HOLE_BYTES``."""
    rg = meta.row_group(row_group)
    spans = []
    for j in range(rg.num_columns):
        c = rg.column(j)
        if columns is not None:
            path = c.path_in_schema
            if not any(path == name or path.startswith(name + ".") for name in columns):
                continue
        start = c.data_page_offset
        if c.has_dictionary_page and 0 < c.dictionary_page_offset < start:
            start = c.dictionary_page_offset
        end = min(size, start + c.total_compressed_size + PAD_BYTES)
        spans.append((start, end))
    spans.sort()
    merged: List[List[int]] = []
    for a, b in spans:
        if merged and a - merged[-1][1] <= HOLE_BYTES:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b - a) for a, b in merged]


def split_parts(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out = []
    for off, n in ranges:
        for k in range(0, n, PART_BYTES):
            out.append((off + k, min(PART_BYTES, n - k)))
    return out


def read_range(handle: Any, off: int, n: int) -> bytes:
    data = handle.read_at(n, off)
    if len(data) != n:
        raise OSError(f"read {len(data)} bytes of {n} at offset {off}: the file is shorter than its footer says")
    return data


class _At:
    """``seek``/``read`` over ``read_at``, so footers are read the way listing reads them (parquet.py),
    on a handle other threads read from at once."""

    def __init__(self, handle: Any):
        self.handle, self.pos = handle, 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        data = self.handle.read_at(n, self.pos)
        self.pos += len(data)
        return data


def _file_meta(handle: Any, raw: Optional[bytes] = None) -> Tuple[pq.FileMetaData, int]:
    """The file's metadata (from ``raw``, its footer as listing read it, else read now) and size."""
    size = handle.size()
    if not raw:
        raw = footer_bytes(_At(handle), size)
    return pq.ParquetFile(pa.BufferReader(raw)).metadata, size


class RangeFile:
    """A read-only file over some fetched byte ranges of a file: what pyarrow decodes a row group
    from. A read outside them (a layout pyarrow reads differently) goes to the file itself and is
    counted in ``misses``."""

    def __init__(self, handle: Any, size: int, chunks: Sequence[Tuple[int, bytes]]):
        chunks = sorted(chunks, key=lambda c: c[0])
        self.handle, self.size_ = handle, size
        self.starts = [off for off, _ in chunks]
        self.views = [memoryview(data) for _, data in chunks]
        self.pos, self.closed, self.misses = 0, False, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size_ + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> Any:
        n = self.size_ - self.pos if n is None or n < 0 else min(n, self.size_ - self.pos)
        i = bisect.bisect_right(self.starts, self.pos) - 1
        if i >= 0 and self.pos + n <= self.starts[i] + len(self.views[i]):
            a = self.pos - self.starts[i]
            data: Any = self.views[i][a:a + n]
        else:
            self.misses += 1
            data = self.handle.read_at(n, self.pos)
        self.pos += len(data)
        return data

    def close(self) -> None:
        self.closed = True


class _LaterHandle:
    """A file's handle opened only if read (a read outside the first fetches' ranges): its opening is a
    round trip that a unit fetched first does not need."""

    def __init__(self, opened: Callable[[], Any]):
        self.opened = opened

    def read_at(self, n: int, off: int) -> Any:
        return self.opened().read_at(n, off)


# --- one reader's read-ahead -------------------------------------------------------------------------

class _Fetch:
    """One unit's ranges, fetched (or failed) in parts."""

    __slots__ = ("key", "size", "handle", "meta", "file_size", "offsets", "parts", "left", "error", "done", "dropped",
                 "future")

    def __init__(self, key: Key, size: int = 0):
        self.key, self.size = key, size
        self.handle: Any = None
        self.meta: Any = None
        self.file_size = 0
        self.offsets: List[int] = []
        self.parts: Optional[List[Any]] = None
        self.left, self.error, self.done, self.dropped = 0, None, False, False
        self.future: "Future[None]" = Future()


class RowGroupReadAhead:
    """Fetches the row groups a reader will read next, in the background (see the module docstring).

    ``opener(file)`` opens file ``file`` (checking it is the listed one); ``upcoming()`` gives the
    keys ``(file, row group)`` the reader will ask `read` for, in order, from its current position
    (``None`` for a unit read some other way). ``columns`` are the top-level columns decoded (None:
    all); ``checksums`` is passed to pyarrow as the synchronous reader does.
    ``footers[file]``, when given, is the file's footer as listing read it (not read again here).
    """

    def __init__(self, opener: Callable[[int], Any], upcoming: Callable[[], Iterable[Optional[Key]]], *,
                 budget: int, columns: Optional[Sequence[str]], checksums: bool = True,
                 depth: int = DEPTH, name: str = "", footers: Optional[Sequence[bytes]] = None,
                 first: Optional[FirstFetches] = None):
        if budget <= 0:
            raise ValueError(f"{budget=} must be > 0 (0 is no read-ahead: read synchronously)")
        self.opener, self.upcoming, self.budget = opener, upcoming, int(budget)
        self.columns = None if columns is None else list(columns)
        self.checksums, self.depth, self.name = checksums, int(depth), name
        self.footers, self.first = footers, first
        self._metas: Dict[int, Any] = {}  # metadata parsed from the shipped footers, for units fetched first
        self.max_files = max(OPEN_FILES, 2 * self.depth)
        self._lock = threading.Lock()
        self._files: "OrderedDict[int, Future]" = OrderedDict()  # file -> Future[(handle, metadata, size)]
        self._ahead: Deque[Key] = deque()
        self._keys: Iterator[Optional[Key]] = iter(())
        self._last: Optional[Key] = None
        self._pending: Dict[Key, _Fetch] = {}
        self._held = 0
        self._started = False
        self.counts = {"ready": 0, "waited": 0, "inline": 0, "wait_s": 0.0, "misses": 0, "peak_bytes": 0,
                       "fetched_bytes": 0, "first": 0}

    # -- what the reader calls

    def restart(self) -> None:
        """Forget what was fetched for the old position and plan from the reader's position now (its
        fetches start with the process's first read)."""
        with self._lock:
            for f in list(self._pending.values()):
                self._drop(f)
            self._pending.clear()
            self._ahead.clear()
            self._keys, self._last, self._started = iter(self.upcoming()), None, False
            for i, fut in list(self._files.items()):  # a failed footer is tried again, as a reopen would
                if fut.done() and fut.exception() is not None:
                    del self._files[i]
        if in_loader_worker():
            self._start()
        else:
            _hooks()
            with _POOL_LOCK:
                _WAITING.add(self)

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._schedule()

    def read(self, key: Key, whole: bool = True) -> Any:
        """Row group ``key[1]`` of file ``key[0]``, decoded: from the bytes fetched ahead, else read now.
        ``whole=False``: what makes the file as a new `pq.ParquetFile` over those bytes instead, for a
        reader that decodes the row group in windows (parquet_windows.py); it holds the fetched
        (compressed) bytes.
        Raises what fetching or decoding raised (the reader names the unit)."""
        _start_waiting()
        with self._lock:
            self._started = True
            if key in self._ahead:
                while True:
                    k = self._ahead.popleft()
                    if k == key:
                        break
                    f = self._pending.pop(k, None)  # a unit the reader did not read again (it had it)
                    if f is not None:
                        self._drop(f)
            else:  # not where the plan was: plan again from the reader's position (after this unit)
                for f in list(self._pending.values()):
                    self._drop(f)
                self._pending.clear()
                self._ahead.clear()
                self._keys, self._last = iter(self.upcoming()), None
            fetch = self._pending.pop(key, None)
            # a small source's next epoch can bring this unit back within the plan: its bytes serve both reads
            again = fetch is not None and key in self._ahead
            if again:
                self._pending[key] = fetch
            self._schedule()
        t0 = time.perf_counter()
        if fetch is None:
            self.counts["inline"] += 1
            return self._read_inline(key, whole)
        if not fetch.done:
            self.counts["waited"] += 1
        else:
            self.counts["ready"] += 1
        try:
            fetch.future.result()
        finally:
            self.counts["wait_s"] += time.perf_counter() - t0
            if not again:
                with self._lock:
                    self._held -= fetch.size
                    self._schedule()
        if fetch.error is not None:
            raise fetch.error
        chunks = [(off, data) for off, data in zip(fetch.offsets, fetch.parts)]
        if not again:
            fetch.parts = None
        return self._decode(fetch.handle, fetch.meta, fetch.file_size, key[1], chunks, whole)

    @property
    def held(self) -> int:
        """Bytes fetched or in flight and not yet read (the budget bounds it)."""
        return self._held

    def stats(self) -> Dict[str, Any]:
        return {"budget_bytes": self.budget, "held_bytes": self._held, **self.counts}

    # -- inside (under self._lock unless said otherwise)

    def _drop(self, f: _Fetch) -> None:
        f.dropped = True
        if f.done:
            self._held -= f.size
            f.parts = None

    def _file(self, i: int) -> Future:
        fut = self._files.get(i)
        if fut is not None:
            self._files.move_to_end(i)
            return fut
        fut = self._files[i] = Future()
        fetch_pool().submit(lambda: self._open_file(i, fut))
        if len(self._files) > self.max_files:
            for old, f in list(self._files.items())[:-1]:
                if f.done():
                    del self._files[old]
                    break
        return fut

    def _open_file(self, i: int, fut: Future) -> None:  # in a pool thread
        try:
            handle = self.opener(i)
            meta, size = _file_meta(handle, self.footers[i] if self.footers else None)
            fut.set_result((handle, meta, size))
        except BaseException as e:  # noqa: BLE001 - raised where the reader reads the unit
            fut.set_exception(e)
        with self._lock:
            self._schedule()

    def _fill(self) -> None:
        self._last = fill_plan(self._ahead, self._keys, self.depth, self._last)

    def _schedule(self) -> None:
        if not self._started:
            return
        self._fill()
        for key in self._ahead:  # footers first, all at once
            self._file(key[0])
        for key in self._ahead:
            if key in self._pending:
                continue
            size = self.first.size(key) if self.first is not None and self.footers else None
            if size is not None:
                if self._held and self._held + size > self.budget:
                    break
                got = self.first.take(key)
                if got is not None:
                    self._take_first(key, *got)
                    continue
            fut = self._file(key[0])
            if not fut.done():
                break  # the budget goes to units in order: wait for this one's footer
            f = _Fetch(key)
            try:
                error = fut.exception()  # not fut.result(): raising it here would grow its traceback each time
                if error is None:
                    f.handle, f.meta, f.file_size = fut.result()
                    ranges = chunk_ranges(f.meta, key[1], self.columns, f.file_size)
            except BaseException as e:  # noqa: BLE001 - kept for the reader, raised when it gets there
                error = e
            if error is not None:
                f.error, f.done = error, True
                f.future.set_result(None)
                self._pending[key] = f
                continue
            f.size = sum(n for _, n in ranges)
            if self._held and self._held + f.size > self.budget:
                break
            self._held += f.size
            self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self._held)
            self.counts["fetched_bytes"] += f.size
            parts = split_parts(ranges)
            f.offsets = [off for off, _ in parts]
            f.parts, f.left = [None] * len(parts), len(parts)
            self._pending[key] = f
            pool = fetch_pool()
            for j, (off, n) in enumerate(parts):
                pool.submit(lambda f=f, j=j, off=off, n=n: self._fetch_part(f, j, off, n))

    def _take_first(self, key: Key, file_size: int, chunks: List[Tuple[int, bytes]]) -> None:
        """Unit ``key`` as the building process fetched it (`FirstFetches`): no request."""
        i = key[0]
        f = _Fetch(key)
        meta = self._metas.get(i)
        if meta is None:
            meta = self._metas[i] = pq.ParquetFile(pa.BufferReader(self.footers[i])).metadata
        if len(self._metas) > self.max_files:
            self._metas.pop(next(iter(self._metas)))
        f.meta, f.file_size = meta, file_size
        f.handle = _LaterHandle(lambda: self._file_now(i))
        f.offsets, f.parts = [off for off, _ in chunks], [data for _, data in chunks]
        f.size = sum(len(data) for data in f.parts)
        f.done = True
        f.future.set_result(None)
        self._held += f.size
        self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self._held)
        self.counts["first"] += 1
        self._pending[key] = f

    def _file_now(self, i: int) -> Any:
        """File ``i``'s handle, opened if need be (outside the lock)."""
        with self._lock:
            fut = self._file(i)
        return fut.result()[0]

    def _fetch_part(self, f: _Fetch, j: int, off: int, n: int) -> None:  # in a pool thread
        data, error = None, None
        try:
            data = read_range(f.handle, off, n)
        except BaseException as e:  # noqa: BLE001
            error = e
        with self._lock:
            if f.parts is not None:
                f.parts[j] = data
            if error is not None and f.error is None:
                f.error = error
            f.left -= 1
            done = f.left == 0
            if done:
                f.done = True
                if f.dropped:  # planned for a position the reader left: give its bytes back
                    self._held -= f.size
                    f.parts = None
                    self._schedule()
        if done:
            f.future.set_result(None)

    def _read_inline(self, key: Key, whole: bool = True) -> Any:
        """A unit that was not fetched ahead (its footer was on its way, or the plan moved): its
        file's footer as read ahead, its ranges read here."""
        with self._lock:
            fut = self._file(key[0])
        handle, meta, size = fut.result()
        chunks = [(off, read_range(handle, off, n)) for off, n in chunk_ranges(meta, key[1], self.columns, size)]
        with self._lock:
            self.counts["fetched_bytes"] += sum(len(data) for _, data in chunks)
        return self._decode(handle, meta, size, key[1], chunks, whole)

    def _decode(self, handle: Any, meta: Any, size: int, row_group: int, chunks: List[Tuple[int, Any]],
                whole: bool = True) -> Any:
        src = RangeFile(handle, size, chunks)
        if not whole:
            return lambda: pq.ParquetFile(src, metadata=meta, page_checksum_verification=self.checksums)
        pf = pq.ParquetFile(src, metadata=meta, page_checksum_verification=self.checksums)
        # use_threads=False: pyarrow wraps what a Python file returns in buffers that need the GIL to be freed;
        # freed on one of pyarrow's own threads while the interpreter exits, they abort the process ("terminate
        # called without an active exception", ~1 exit in 30 of a process reading in its training loop). One
        # column decodes the same on the calling thread.
        table = pf.read_row_group(row_group, columns=self.columns, use_threads=False)
        self.counts["misses"] += src.misses
        return table
