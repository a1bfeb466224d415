"""Listing remote files at once: many files in parallel, each file's blocks in parallel.

Listing a jsonl or text source reads every file whole, because its units are line
ranges (line_listing.py). From local disk that runs at the page cache's speed. From an
object store, read as local files are (one file after another, each file one
``CHUNK_BYTES`` block after another), every block would cost a request's latency and
its transfer on one connection, before the first batch (benchmarks/remote.py --format
jsonl measures the listing; figures in benchmarks/RESULTS.md ``remote-jsonl``).

Here a remote source's files are listed ``LIST_THREADS`` at a time (`each_file`, which
parquet's footers use too). A remote file that is not compressed is read by positional
reads of ``BLOCK_BYTES``, up to ``BLOCKS_AHEAD`` of them in flight (`blocks_at_once`),
because a store's bandwidth is per connection; a jsonl file's first bytes (is it one JSON
array?) come from the same reads (`first_byte_of`), so a file costs an open and its reads. The scan takes the blocks in file order,
so it sees the same bytes in the same order as a sequential read, and lists the same
units. A compressed file is one stream and is still read in order, but it runs beside
the other files. Local files are read one after another.

The trade-off is memory: a file being listed holds at most ``BLOCKS_AHEAD`` x
``BLOCK_BYTES`` (``8 << 20`` bytes, one sequential ``CHUNK_BYTES`` block's worth) and up to
``LIST_THREADS`` files are listed at once, so a listing holds up to ``LIST_THREADS`` x
``BLOCKS_AHEAD`` x ``BLOCK_BYTES`` (``256 << 20`` bytes), on a remote source of ``LIST_THREADS``
files of ``BLOCKS_AHEAD`` x ``BLOCK_BYTES`` or more; the reads share the process's
``LIST_THREADS`` threads (`read_pool`).

A listing that keeps its files for the first fetches (line_listing.py, jsonl.py) also keeps the
bytes it read of whole files, up to ``KEEP_BYTES`` (``32 << 20``) a source (`KeptBytes`, `in_memory`):
the process that builds the loader then reads its workers' first units from memory rather than
fetch them again, a round trip and the transfer less before the first batch. Those bytes are held
until the workers have forked, as the fetched units would have been.
"""

from __future__ import annotations

import io
import itertools
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Deque, Iterator, Optional, Sequence, Tuple, TypeVar

import pyarrow as pa

from ..process_hooks import at_exit, at_fork
from .files import SourceFile

#: Files of a remote source listed at once (each costs round trips to the store).
LIST_THREADS = 32
#: Bytes of one positional read of a remote file being listed (50 ms at 20 MB/s).
BLOCK_BYTES = 1 << 20
#: Reads of one remote file in flight at once while it is listed.
BLOCKS_AHEAD = 8

BOM = b"\xef\xbb\xbf"

T = TypeVar("T")


def is_remote(files: Sequence[SourceFile]) -> bool:
    """Whether any of ``files`` is on a filesystem other than local disk."""
    return any(f.fs.type_name != "local" for f in files)


def each_file(fn: Callable[[SourceFile], T], files: Sequence[SourceFile], *, name: str = "tokenloom-list"
              ) -> Iterator[Any]:
    """``fn(f)`` for every file, in order: its result, or the exception it raised (the caller raises
    the first one in file order, so the error does not depend on which request finished first).
    Remote files run ``LIST_THREADS`` at a time; local files one by one as they are asked for, from
    the page cache (so a caller that stops at a bad file reads no further)."""

    def one(f: SourceFile) -> Any:
        try:
            return fn(f)
        except Exception as e:  # noqa: BLE001 - raised in file order by the caller
            return e

    if len(files) < 2 or not is_remote(files):
        yield from (one(f) for f in files)
        return
    with ThreadPoolExecutor(min(LIST_THREADS, len(files)), thread_name_prefix=name) as pool:
        yield from pool.map(one, files)


def blocks_at_once(handle: Any, size: int, pool: ThreadPoolExecutor, *, block: int = BLOCK_BYTES,
                   ahead: int = BLOCKS_AHEAD, bom: bool = True, keep: Optional[list] = None
                   ) -> Iterator[Tuple[int, bytes]]:
    """What `line_listing.read_blocks` yields, ``(dropped, block)`` up to an empty block, for a file
    of ``size`` bytes read by positional reads on ``pool``, up to ``ahead`` at once. A UTF-8 byte
    order mark at the start is dropped from the first block (unless ``bom`` is False: compressed bytes),
    and ``dropped`` is its length. A read
    shorter than asked (the file shrank since it was listed) ends the blocks there, as a sequential
    read would. ``keep``, when given, gets every block's bytes as read (the mark included)."""
    starts = iter(range(0, size, block))
    inflight: Deque[Tuple[int, "Future[bytes]"]] = deque()

    def submit() -> None:
        off = next(starts, None)
        if off is not None:
            inflight.append((off, pool.submit(handle.read_at, min(block, size - off), off)))

    for _ in range(ahead):
        submit()
    first = True
    try:
        while inflight:
            off, fut = inflight.popleft()
            data = fut.result()
            submit()
            if keep is not None:
                keep.append(data)
            dropped = 0
            if first:
                first = False
                dropped = len(BOM) if bom and data.startswith(BOM) else 0
            if data:
                yield dropped, data[dropped:] if dropped else data
            if len(data) < min(block, size - off):
                break
    finally:  # left early (an error, or a caller that has seen enough): no read outlives the handle
        for _, fut in inflight:
            fut.cancel()
        wait([fut for _, fut in inflight])
    yield 0, b""


#: Bytes of a remote line source's files (jsonl, text) its listing keeps in memory, at most: files that fit
#: whole, in listing order of completion. The first fetches then read their workers' first units from memory
#: (first_fetches.py), not from the store: a round trip and the transfer less before the first batch.
KEEP_BYTES = 32 << 20


class KeptBytes:
    """The bytes one listing may still keep in memory (`KEEP_BYTES`), shared by its threads."""

    def __init__(self, limit: Optional[int] = None):
        self.left = KEEP_BYTES if limit is None else limit
        self._lock = threading.Lock()

    def reserve(self, n: int) -> bool:
        """Whether a file of ``n`` bytes may be kept (its bytes are then counted)."""
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True


def in_memory(handle: Any, blocks: list, size: int) -> Any:
    """``handle``'s file as an in-memory file (closing ``handle``) when ``blocks`` hold all its ``size``
    bytes, else ``handle`` itself: what the first fetches read the listed units with."""
    if sum(len(b) for b in blocks) != size:
        return handle
    handle.close()
    return pa.BufferReader(b"".join(blocks))


def first_byte_of(blocks: Iterator[Tuple[int, bytes]]) -> Tuple[bytes, Iterator[Tuple[int, bytes]]]:
    """The first byte of ``blocks`` that is not ASCII whitespace (``b""`` if none: is the file a JSON
    array?), and the blocks again from the first, so one read of the file serves both."""
    seen = []
    for dropped, chunk in blocks:
        seen.append((dropped, chunk))
        stripped = chunk.lstrip()
        if stripped:
            return stripped[:1], itertools.chain(seen, blocks)
        if not chunk:
            break
    return b"", iter(seen)


# --- the threads that read ahead (listing a file, a compressed stream) ----------------------------------

_READS: Optional[ThreadPoolExecutor] = None
_READS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _READS, _READS_LOCK
    _READS, _READS_LOCK = None, threading.Lock()



def read_pool() -> ThreadPoolExecutor:
    """This process's threads for `blocks_at_once` (``LIST_THREADS``; a forked child makes its own)."""
    global _READS
    at_fork("listing_reads", after_in_child=_after_fork_in_child)
    with _READS_LOCK:
        if _READS is None:
            _READS = ThreadPoolExecutor(LIST_THREADS, thread_name_prefix="tokenloom-reads")
        return _READS


def pool_for(files: Sequence[SourceFile]) -> Optional[ThreadPoolExecutor]:
    """`read_pool` when any of ``files`` is remote (its blocks are read at once), else None (in order)."""
    return read_pool() if is_remote(files) else None


class InOrder(io.RawIOBase):
    """A remote file read from its start to its end, ``BLOCKS_AHEAD`` positional reads of ``BLOCK_BYTES``
    in flight (`blocks_at_once`): what a decompressing stream reads from. pyarrow's codecs read their
    input ``64 << 10`` bytes at a time, and on a remote file each such read would be a request, a round
    trip each. Closing it ends the reads in flight, then closes ``handle``."""

    def __init__(self, handle: Any, size: int):
        self.handle = handle
        self._blocks = blocks_at_once(handle, size, read_pool(), bom=False)
        self._buf = memoryview(b"")
        self._end = False
        at_exit("listing_streams", _close_open)
        _OPEN.add(self)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf and not self._end:
            _, data = next(self._blocks)
            self._end = not data
            self._buf = memoryview(data)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if self.closed:  # first thing: pyarrow may call it again while the interpreter tears modules down
            return
        _OPEN.discard(self)
        self._blocks.close()
        self.handle.close()
        super().close()


#: Streams not closed yet: closed at exit, before the interpreter clears the modules they need (a stream
#: left open is closed by pyarrow later, then failing: "Error ignored when destroying file" on stderr).
_OPEN: "weakref.WeakSet[InOrder]" = weakref.WeakSet()


def _close_open() -> None:
    for stream in list(_OPEN):
        stream.close()
