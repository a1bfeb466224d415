"""The first units of a remote source (or of its token cache), fetched by the process that builds the loader.

A loader worker that starts from nothing opens its files (pyarrow's size lookup, one round
trip per file and process) and fetches its first units (another) after the fork, and it
waits for them. The process that builds the loader has the files open already (listing
read a parquet file's footer, a jsonl file's lines), so it fetches the units its workers
read first, in the background from the moment listing ends, and a fork waits for those
fetches: a worker starts with their bytes in its memory and takes them by key, a row group
``(file, row group)`` (readahead.py's `RowGroupReadAhead`), a line unit ``(file, start)``
(unit_readahead.py's `UnitReadAhead`).

How much: per shard, units until ``FIRST_SHARD_BYTES`` (``1 << 20``; at least one, at most
``DEPTH`` looked at), enough to tokenize while the worker opens its files and its own
fetches come back. Within a file, ranges less than ``FIRST_HOLE`` apart are joined into
requests of up to ``FIRST_PART``: the first MiB of a shard can be dozens of small row
groups, and requests beyond the pool's threads wait a round trip. The bound is in bytes,
not in units, because a few units a shard of a source of small row groups leave a worker
waiting in its first batches (benchmarks/remote.py; see docs/performance.md). The building
process holds at most ``FIRST_BYTES`` a source (and as much again for a restore), and lets
go of them once its workers have forked.

A resume loads its state after the build: the units planned from the start are then mostly
not the ones its workers read first. `fetch_first_from` adds those of the loaded positions
(the recipe's graph finds them in the state, `PackedGraph.fetch_first`) with the handles the
build kept open for it, before the workers fork, so a resumed worker too starts with its first
units in memory instead of opening its files and fetching them (two round trips).
benchmarks/remote.py measures a resume's first batch against a fresh start's, for parquet
and jsonl sources (see docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from ..process_hooks import at_fork
from ..shard import ShardUnits, WorkSlice
from .readahead import DEPTH, Key, split_parts, fetch_pool, read_range, budget_for, chunk_ranges
from . import unit_readahead

log = logging.getLogger(__name__)


# --- the first row groups, fetched by the process that builds the loader ---------------------------------

#: Bytes of its workers' first row groups the process that builds a loader fetches, at most per source.
FIRST_BYTES = 32 << 20
#: Bytes fetched first per source and shard (at least one unit, at most ``DEPTH``): enough for a worker to
#: tokenize while it opens its files and its own first fetches come back (two round trips and a transfer,
#: ~0.25 s behind 100 ms, ~0.5 MB of tokens at the 60/40 mix of benchmarks/remote.py).
FIRST_SHARD_BYTES = 1 << 20
#: First fetches of one file closer than this are one request ...
FIRST_HOLE = 64 << 10
#: ... up to this many bytes: a few short requests at once instead of one per unit (the units of a shard's
#: first MiB can be dozens of small row groups, and requests beyond the pool's threads wait a round trip).
FIRST_PART = 512 << 10
#: Seconds a fork waits for first fetches still in flight (see `FirstFetches` and `wait_before_fork`).
FIRST_WAIT = 30.0

#: First fetches with requests in flight in this process (a fork waits for them).
_FIRST_LIVE: "weakref.WeakSet[FirstFetches]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def first_requests(items: Sequence[Tuple[Key, Any, int, List[Tuple[int, int]]]]) -> List[tuple]:
    """The requests that fetch ``items`` (see `FirstFetches`): ``(handle, offset, length, members)``, where
    ``members`` are the ``(key, offset, length)`` ranges of units inside it. Ranges longer than ``PART_BYTES``
    are split as a reader splits them; then, file by file in offset order, ranges less than ``FIRST_HOLE``
    apart are joined while the request stays within ``FIRST_PART`` bytes (the holes are fetched too)."""
    by_file: Dict[int, List[Tuple[int, int, Key]]] = {}
    handles: Dict[int, Any] = {}
    for key, handle, _, ranges in items:
        handles[key[0]] = handle
        by_file.setdefault(key[0], []).extend((off, n, key) for off, n in split_parts(ranges))
    out: List[tuple] = []
    for i, spans in by_file.items():
        spans.sort()
        cur: Optional[list] = None
        for off, n, key in spans:
            if cur is not None and off - (cur[1] + cur[2]) <= FIRST_HOLE and off + n - cur[1] <= FIRST_PART:
                cur[2] = max(cur[2], off + n - cur[1])
                cur[3].append((key, off, n))
            else:
                cur = [handles[i], off, n, [(key, off, n)]]
                out.append(cur)
    return [tuple(r) for r in out]


class FirstFetches:
    """Units (row groups, line ranges) a loader's workers will read first, fetched in the background by
    the process that builds the loader, from the moment listing ends: a worker then finds its first
    units' bytes in its memory when it starts, instead of opening their files (pyarrow's size lookup,
    one round trip per file and process) and fetching them (another) after the fork.

    ``items`` are ``(key, handle, file size, ranges)``: the handle listing opened the file with, and
    the ranges a worker would fetch (`unit_ranges`); they are fetched in a few requests at once
    (`first_requests`). Bytes are matched by key, so a worker whose position is elsewhere finds
    nothing (the bytes of a key do not depend on who reads it: what comes does not change); a
    restore adds (`add`) the units its workers read first from the loaded positions. ``handles`` (file
    index -> the handle listing opened) stay open for those: they are closed once the bytes are let
    go, or, with no forks to wait for, at the first `take` in this process. A fork waits until the
    requests in flight have ended (at most ``FIRST_WAIT`` s): the bytes are then in the child's copy
    of the memory, and no S3 client of the parent is mid-request (a child's new client would wait
    for those requests forever). A spawned worker gets the bytes fetched so far with the pickled
    units. The building process lets go of the bytes (at most ``FIRST_BYTES`` a source and call)
    once it has forked ``forks`` times (its loader's workers): so they are not held for the run, nor
    handed to workers started again later (a second pass without persistent workers fetches its
    own, as the files are then).
    """

    def __init__(self, items: Sequence[Tuple[Key, Any, int, List[Tuple[int, int]]]] = (),
                 handles: Optional[Mapping[int, Any]] = None, forks: Optional[int] = None,
                 names: Optional[Mapping[int, str]] = None):
        self._cond = threading.Condition(threading.Lock())
        self.names: Dict[int, str] = dict(names or {})  # file index -> URI, for messages
        self._flying: Dict[int, int] = {}  # file index -> requests in flight
        self._chunks: Dict[Key, Tuple[int, List[Tuple[int, bytes]]]] = {}
        self._sizes: Dict[Key, int] = {}
        self._left = 0
        self.forks_left = forks
        self.errors = 0
        self.handles: Optional[Dict[int, Any]] = dict(handles) if handles else None
        #: Whether a fork must wait for these requests (`blocks_fork`): True unless every handle is one
        #: that leaves a forked child nothing to wait for.
        self.blocks_fork = False
        self._close_when_idle = False
        self._owner = os.getpid()
        at_fork("first_fetches", before=_before_fork, after_in_parent=_after_fork_in_parent,
                after_in_child=_after_fork_in_child)
        with _LIVE_LOCK:
            _FIRST_LIVE.add(self)
        self.add(items)

    def add(self, items: Sequence[Tuple[Key, Any, int, List[Tuple[int, int]]]]) -> int:
        """Fetch ``items`` too (see the class), but for the keys fetched here already; how many are new."""
        with self._cond:
            items = [it for it in items if it[0] not in self._sizes]
            self.blocks_fork = self.blocks_fork or any(blocks_fork(handle) for _, handle, _, _ in items)
            for key, _, _, ranges in items:
                self._sizes[key] = sum(n for _, n in ranges)
            requests = first_requests(items)
            self._left += len(requests)
            for _, _, _, members in requests:
                self._flying[members[0][0][0]] = self._flying.get(members[0][0][0], 0) + 1
        if not requests:
            return 0
        file_size = {key: size for key, _, size, _ in items}
        got: Dict[Key, List[Tuple[int, bytes]]] = {key: [] for key, _, _, _ in items}
        missing = {key: len(split_parts(ranges)) for key, _, _, ranges in items}
        failed: set = set()

        def fetch(handle: Any, off: int, n: int, members: List[Tuple[Key, int, int]]) -> None:
            data = None
            try:
                data = read_range(handle, off, n)
            except BaseException:  # noqa: BLE001 - the worker fetches these units itself
                pass
            with self._cond:
                for key, o, m in members:
                    if data is None:
                        failed.add(key)
                    else:
                        got[key].append((o, data if (o, m) == (off, n) else data[o - off:o - off + m]))
                    missing[key] -= 1
                    if missing[key] == 0 and key not in failed and key in self._sizes:
                        self._chunks[key] = (file_size[key], got.pop(key))
                if data is None:
                    self.errors += 1
                self._left -= 1
                i = members[0][0][0]
                self._flying[i] -= 1
                if not self._flying[i]:
                    del self._flying[i]
                if self._left == 0:
                    self._cond.notify_all()
                    close = self._idle_handles()
                else:
                    close = None
            _close_all(close or ())

        pool = fetch_pool()
        for handle, off, n, members in requests:
            pool.submit(lambda a=(handle, off, n, members): fetch(*a))
        return len(items)

    def _idle_handles(self) -> Optional[List[Any]]:
        """Under the lock: the handles to close now, if they are to be closed and no request uses them."""
        if not self._close_when_idle or self._left or not self.handles:
            return None
        handles, self.handles = list(self.handles.values()), None
        return handles

    def _let_go_of_handles(self) -> None:
        if os.getpid() != self._owner:  # a worker's copies: the building process closes its own
            return
        with self._cond:
            self._close_when_idle = True
            close = self._idle_handles()
        _close_all(close or ())

    def size(self, key: Key) -> Optional[int]:
        """The bytes of unit ``key`` if it was fetched (or is being fetched) here, else None."""
        with self._cond:
            return self._sizes.get(key)

    def take(self, key: Key) -> Optional[Tuple[int, List[Tuple[int, bytes]]]]:
        """``(file size, [(offset, bytes), ...])`` of unit ``key``, fetched and not taken yet, else None."""
        if self.forks_left is None and not self._close_when_idle:
            self._let_go_of_handles()  # the reading has started in this process: no restore to fetch for
        with self._cond:
            out = self._chunks.pop(key, None)
            if out is not None:
                self._sizes.pop(key, None)
        return out

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until no request is in flight; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._left == 0, timeout)

    def in_flight(self) -> List[str]:
        """The files (URIs where known) with a request of these fetches in flight."""
        with self._cond:
            return [self.names.get(i, f"file {i}") for i in sorted(self._flying)]

    def forked(self) -> None:
        """In the building process, after a fork: past ``forks`` of them, let go of the bytes."""
        if self.forks_left is None:
            return
        self.forks_left -= 1
        if self.forks_left <= 0:
            with self._cond:
                self._chunks.clear()
                self._sizes.clear()
            self._let_go_of_handles()

    def __getstate__(self) -> Dict[str, Any]:
        with self._cond:
            chunks = dict(self._chunks)
        return {"chunks": chunks}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._chunks = state["chunks"]
        self._sizes = {key: sum(len(d) for _, d in chunks) for key, (_, chunks) in self._chunks.items()}
        self._left, self.errors, self.forks_left = 0, 0, None
        self.names, self._flying = {}, {}
        self.handles, self._close_when_idle, self._owner = None, True, os.getpid()


def start_first_fetches(units: Any, column: Optional[str], *, shards: Sequence[int], num_shards: int, seed: int,
                        epochs: Optional[int], readahead: Optional[int] = None,
                        forks: Optional[int] = None) -> Optional[FirstFetches]:
    """Start fetching, in this process, the first units ``shards`` will read of a remote source listed
    with its files open (``units.handles``: a parquet source whose footers are shipped, the line files
    of a jsonl source): per shard, units until `FIRST_SHARD_BYTES` (at least one, at most `DEPTH`
    looked at), round-robin over the shards while the source's `FIRST_BYTES` last (`FirstFetches`);
    the handles are kept for a restore's `fetch_first_from`, then closed; the bytes are let go after
    ``forks`` forks of this process (the loader's workers; None: kept). ``units.first`` is set; None
    when nothing is fetched (local files, read-ahead off, footers not shipped, or no handles)."""
    listed = getattr(units, "handles", None)
    if listed is None:
        return None
    units.handles = None
    handles = dict(listed) if isinstance(listed, dict) else dict(enumerate(listed))  # parquet's: a list
    try:
        budget = budget_for({id(f.fs): f.fs for f in units.files}.values(), readahead)
        of = unit_ranges(units, column)
        if not budget or of is None:
            return None
        upcoming = []
        for g in shards:
            node = ShardUnits(units.rows, shard=g, num_shards=num_shards, seed=seed, epochs=epochs)
            node.reset(None)
            upcoming.append(node.ahead())
        names = {i: f.uri or f.path for i, f in enumerate(units.files)}
        units.first = FirstFetches(handles=handles, forks=forks, names=names)
        units.first.add(_first_items(units, of, upcoming, min(FIRST_BYTES, budget), units.first))
        return units.first
    except Exception:  # noqa: BLE001 - only an early start: the workers fetch what is not here
        log.debug("no first fetches", exc_info=True)
        return None
    finally:
        if getattr(units, "first", None) is None:
            _close_all(list(handles.values()))


def fetch_first_from(units: Any, column: Optional[str], upcoming: Sequence[Iterator[WorkSlice]],
                     readahead: Optional[int] = None) -> int:
    """After a restore, before the workers start: fetch too the first units of the shards whose slices
    from their restored positions on are ``upcoming`` (`ShardUnits.ahead`), by `start_first_fetches`'
    rule, with the handles it kept (none left: nothing, the workers fetch their own). How many units
    are new (the rest was fetched already, or is over the budget)."""
    first = getattr(units, "first", None)
    of = unit_ranges(units, column)
    if first is None or first.handles is None or of is None:
        return 0
    budget = budget_for({id(f.fs): f.fs for f in units.files}.values(), readahead)
    if not budget:
        return 0
    return first.add(_first_items(units, of, upcoming, min(FIRST_BYTES, budget), first))


def unit_ranges(units: Any, column: Optional[str]) -> Optional[Callable[[int], Tuple[Key, Callable[[], List[Tuple[int, int]]]]]]:
    """``unit -> (key, ranges())`` for the units a reader fetches ahead and takes from `FirstFetches`
    by key: a parquet row group ``(file, row group)``, its column chunks as the footer shipped with the
    units places them (`chunk_ranges`; ``column`` None: all of them, a token cache's `UnitCache`); a line
    unit ``(file, start)``, its byte range. None: neither."""
    if getattr(units, "row_group", None) is not None:
        footers = getattr(units, "footers", None)
        if footers is None:
            return None
        metas: Dict[int, Any] = {}
        files = units.files
        columns = None if column is None else [column]

        def chunks(i: int, group: int) -> List[Tuple[int, int]]:
            if i not in metas:
                metas[i] = pq.ParquetFile(pa.BufferReader(footers[i])).metadata
            return chunk_ranges(metas[i], group, columns, files[i].size)

        return lambda u: ((int(units.file[u]), int(units.row_group[u])),
                          lambda: chunks(int(units.file[u]), int(units.row_group[u])))
    if getattr(units, "start", None) is not None and getattr(units, "end", None) is not None:
        return lambda u: ((int(units.file[u]), int(units.start[u])), lambda: _line_parts(units, u))
    return None


def _line_parts(units: Any, u: int) -> List[Tuple[int, int]]:
    """Line unit ``u``'s byte range in parts of `unit_readahead.PART_BYTES` (``1 << 20``), fetched at once,
    as a worker fetches a unit it waits for: a store's bandwidth is per connection, so a long unit comes
    sooner in parts than in one request (a worker joins the parts it takes, whatever the split)."""
    start, end, part = int(units.start[u]), int(units.end[u]), unit_readahead.PART_BYTES
    return [(off, min(part, end - off)) for off in range(start, end, part)]


def _first_items(units: Any, of: Callable[[int], Tuple[Key, Callable[[], List[Tuple[int, int]]]]],
                 upcoming: Sequence[Iterator[WorkSlice]], cap: int, first: FirstFetches) -> List[tuple]:
    """The items (`FirstFetches`) of the shards whose slices to come are ``upcoming``: round-robin, each
    shard's next unit in turn, until it has `FIRST_SHARD_BYTES` or has looked at `DEPTH` units; a unit
    ``first`` holds already counts for its shard and is not fetched again; a unit of a file with no
    handle (a compressed file, a JSON array) is left to the worker; new bytes stay within ``cap``. ``of``
    is `unit_ranges`' unit -> (key, ranges())."""
    handles = first.handles or {}
    files = units.files
    taken = [0] * len(upcoming)
    looked = [0] * len(upcoming)
    live = list(range(len(upcoming)))
    items: List[tuple] = []
    seen: set = set()
    total = 0
    while live and total < cap:
        for g in list(live):  # round-robin: each shard's next unit in turn
            s = next(upcoming[g], None)
            looked[g] += 1
            if s is None:
                live.remove(g)
                continue
            key, ranges_of = of(s.unit)
            if key not in seen:  # a small source's next epoch brings units back: fetched once
                seen.add(key)
                held = first.size(key)
                if held is not None:
                    taken[g] += held
                elif key[0] in handles:
                    ranges = ranges_of()
                    n = sum(n for _, n in ranges)
                    if total + n > cap:
                        live = []
                        break
                    total += n
                    taken[g] += n
                    items.append((key, handles[key[0]], files[key[0]].size, ranges))
            if taken[g] >= FIRST_SHARD_BYTES or looked[g] >= DEPTH:
                live.remove(g)
    return items


def close_listing(units: Any) -> None:
    """Close the files listing kept open for first fetches that will not be made (``units.handles``)."""
    listed = getattr(units, "handles", None)
    if listed is not None:
        units.handles = None
        _close_all(list(listed.values()) if isinstance(listed, dict) else list(listed))


def _close_all(handles: Sequence[Any]) -> None:
    for h in handles:
        try:
            h.close()
        except Exception:  # noqa: BLE001
            pass


def blocks_fork(handle: Any) -> bool:
    """Whether a fork must wait for a request in flight on ``handle``. Not for tokenloom's own HTTP
    client (http_store.py: a forked child drops the connections it inherited, and nothing in it waits
    for the parent's requests); for any other (pyarrow's S3 client waits in the child for the
    parent's requests, see `wait_before_fork`; GCS and Azure are assumed alike)."""
    return not getattr(handle, "FORK_SAFE", False)


def _still_in_flight(timeout: float, own: Sequence["FirstFetches"] = ()) -> List[str]:
    """Wait up to ``timeout`` s until no first fetch of this process that `blocks_fork`, nor any of
    ``own``, has a request in flight; the files of those still in flight then (none: all ended). Other
    fetches over tokenloom's HTTP client are not waited for: a loader built after another whose fetches
    are still retrying (a store that fails) forks at once."""
    with _LIVE_LOCK:
        live = [ff for ff in _FIRST_LIVE if ff.blocks_fork]
    live += [ff for ff in own if all(ff is not other for other in live)]
    deadline = time.monotonic() + timeout
    for ff in live:
        ff.wait(max(0.0, deadline - time.monotonic()))
    return sorted({name for ff in live for name in ff.in_flight()})


def wait_before_fork(timeout: Optional[float] = None, own: Sequence["FirstFetches"] = ()) -> None:
    """Called by the loader before it forks its workers: wait until the first fetches of this process
    have no request in flight (at most ``timeout`` s, default ``FIRST_WAIT``), else raise `TimeoutError`
    naming the files; only those that `blocks_fork`, and ``own``: the loader's own (their bytes then
    come with the workers' memory). A fork with a request in flight is not an option: pyarrow's S3 client waits, before
    it makes a request or a new client, for the requests of the process's other clients to end, and in
    the child the parent's requests never end, so each worker would wait for ever."""
    timeout = FIRST_WAIT if timeout is None else timeout
    stuck = _still_in_flight(timeout, own)
    if stuck:
        shown = ", ".join(repr(s) for s in stuck[:3]) + (f" and {len(stuck) - 3} more" if len(stuck) > 3 else "")
        raise TimeoutError(
            f"the first units of the loader's workers, fetched before they start, were still being read after "
            f"{timeout:g} s (from {shown}): the store does not answer. Workers forked now would wait for ever "
            "(a forked process's S3 client waits for its parent's requests, which never end there). Check that "
            "the endpoint answers (the URI's endpoint_override=, scheme=, the network), or set "
            "TOKENLOOM_READAHEAD=0 to start the workers without fetching first.")


def _before_fork() -> None:
    """Any fork waits for the first fetches in flight (see `FirstFetches`); the loader's own forks were
    checked by `wait_before_fork` already, which raises where this can only warn."""
    stuck = _still_in_flight(FIRST_WAIT)
    if stuck:
        log.warning("forking with first fetches still in flight after %g s (%s): the child's S3 requests may "
                    "wait for ever; check that the store answers", FIRST_WAIT, ", ".join(stuck[:3]))


def _after_fork_in_parent() -> None:
    with _LIVE_LOCK:
        live = list(_FIRST_LIVE)
    for ff in live:
        ff.forked()


def _after_fork_in_child() -> None:
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()

