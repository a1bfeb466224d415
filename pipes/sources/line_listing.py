"""Listing line files (jsonl, paragraphs of text): one pass per file finds its units.

Listing reads each file once, in ``CHUNK_BYTES`` blocks, with numpy: newlines
are found with one vectorised compare, and only lines that are empty or start
with ASCII whitespace can be *blank* (whitespace-only); those are resolved all
together, one byte of indentation per numpy step, so no Python code runs per
line. Its throughput, on jsonl and on heavily indented paragraphs, is in
docs/performance.md.

A unit is recorded as ``(start byte, end byte, first line number, rows)`` in a
`LineUnitTable` (text_files.py, which also says what the row kinds are). Remote files
are listed at once, each in positional reads at once (listing_at_once.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .files import SourceFile
from .listing_at_once import KeptBytes, blocks_at_once, each_file, in_memory, pool_for
from .text_files import ASCII_WS, TEXT_MODES, LineUnitTable

#: Bytes read per step while listing; a line longer than this is joined across steps.
CHUNK_BYTES = 8 << 20
#: Bytes of leading whitespace examined for all lines at once before checking lines one by one.
_VECTOR_STEPS = 32
#: Default cap on a unit's bytes: what one reader holds in memory at a time.
MAX_UNIT_BYTES = 64 << 20

BOM = b"\xef\xbb\xbf"
_WS = np.zeros(256, dtype=bool)
_WS[list(ASCII_WS.encode())] = True


def _blank_lines(buf: bytes, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which lines ``buf[starts[i]:ends[i]]`` hold only ASCII whitespace (or nothing).

    Only lines that start with whitespace can be blank; those advance one byte per step,
    all together, until a non-whitespace byte (not blank) or the line end (blank): an
    indented line resolves in as many steps as its indentation. The few lines still
    open after ``_VECTOR_STEPS`` steps are checked one by one.
    """
    blank = ends == starts
    cand = np.flatnonzero(~blank & _WS[a[np.minimum(starts, len(a) - 1)]])
    pos = starts[cand] + 1
    for _ in range(_VECTOR_STEPS):
        if not len(cand):
            break
        done = pos >= ends[cand]
        blank[cand[done]] = True
        cand, pos = cand[~done], pos[~done]
        ws = _WS[a[pos]]
        cand, pos = cand[ws], pos[ws] + 1
    for i in cand.tolist():
        blank[i] = buf[starts[i]:ends[i]].isspace()  # ASCII whitespace, the same set as _WS
    return blank


class _UnitBuilder:
    """Groups row starts (in file order) into units of at most ``rows_per_unit`` rows and,
    past the first row, at most ``max_unit_bytes`` bytes from the unit's start."""

    def __init__(self, rows_per_unit: int, max_unit_bytes: int):
        self.rows_per_unit, self.max_unit_bytes = rows_per_unit, max_unit_bytes
        self.units: List[List[int]] = []  # [start, first_line, rows]
        self.cur: Optional[List[int]] = None

    def add(self, row_off: np.ndarray, row_line: np.ndarray) -> None:
        i, n = 0, len(row_off)
        while i < n:  # one or two turns per unit, not per row
            if self.cur is None:
                self.cur = [int(row_off[i]), int(row_line[i]), 0]
            cur = self.cur
            byte_lim = int(np.searchsorted(row_off, cur[0] + self.max_unit_bytes, "left"))
            # a new unit always takes its first row: row_off[i] == cur[0] < byte limit
            j = min(n, i + self.rows_per_unit - cur[2], byte_lim)
            if j == i:
                self.units.append(cur)
                self.cur = None
                continue
            cur[2] += j - i
            i = j

    def finish(self, file_end: int) -> List[Tuple[int, int, int, int]]:
        if self.cur is not None:
            self.units.append(self.cur)
        ends = [u[0] for u in self.units[1:]] + [file_end]
        return [(s, e, line, rows) for (s, line, rows), e in zip(self.units, ends)]


def read_blocks(handle: Any, size: int) -> Iterator[Tuple[int, bytes]]:
    """``(dropped, block)`` for ``handle`` read ``size`` bytes at a time, up to an empty block (the
    end): a UTF-8 byte order mark at the start is dropped from the first block, ``dropped`` its length."""
    chunk = handle.read(size)
    dropped = len(BOM) if chunk.startswith(BOM) else 0
    yield dropped, chunk[dropped:]
    while chunk:
        chunk = handle.read(size)
        yield 0, chunk


def scan_file(f: SourceFile, *, paragraphs: bool, rows_per_unit: int, max_unit_bytes: int = MAX_UNIT_BYTES,
              opener: Optional[Callable[[SourceFile], Any]] = None, pool: Optional[Any] = None
              ) -> Tuple[List[Tuple[int, int, int, int]], int, Optional[bytes]]:
    """`scan_blocks` of a file: ``opener(f)`` gives the stream to scan (default ``f.open()``;
    compressed.py decompresses). With ``pool`` (a remote file, not compressed) the blocks are
    positional reads at once (`listing_at_once.blocks_at_once`): the same bytes in the same order."""
    try:
        with opener(f) if opener is not None else f.open() as handle:
            blocks = read_blocks(handle, CHUNK_BYTES) if pool is None else blocks_at_once(handle, handle.size(), pool)
            try:
                return scan_blocks(blocks, paragraphs=paragraphs, rows_per_unit=rows_per_unit,
                                   max_unit_bytes=max_unit_bytes)
            finally:
                blocks.close()  # reads in flight end before the handle closes
    except OSError as e:
        raise ValueError(f"cannot read {f.uri or f.path}: {e}") from e


def scan_blocks(blocks: Iterator[Tuple[int, bytes]], *, paragraphs: bool, rows_per_unit: int,
                max_unit_bytes: int = MAX_UNIT_BYTES) -> Tuple[List[Tuple[int, int, int, int]], int, Optional[bytes]]:
    """One pass over a file's blocks (as `read_blocks` yields them): its units ``(start, end, first_line,
    rows)``, its number of blank lines, and the bytes of its first row's first line (None if it has no row)."""
    units = _UnitBuilder(rows_per_unit, max_unit_bytes)
    blank_total, first_row = 0, None
    prev_blank = True  # the start of a file counts as after a blank line
    off, line_no = 0, 1  # file offset and line number of the pending bytes' start
    pending: List[bytes] = []
    for dropped, chunk in blocks:
        off += dropped
        final = not chunk
        if not final and b"\n" not in chunk:
            pending.append(chunk)  # a long line: join once, when it ends
            continue
        buf = b"".join(pending + [chunk]) if pending else chunk
        a = np.frombuffer(buf, dtype=np.uint8)
        ends = np.flatnonzero(a == 10)
        consumed = int(ends[-1]) + 1 if len(ends) else 0
        if final and consumed < len(buf):  # a last line without a newline
            ends = np.append(ends, len(buf))
            consumed = len(buf)
        if len(ends):
            starts = np.empty_like(ends)
            starts[0] = 0
            starts[1:] = ends[:-1] + 1
            blank = _blank_lines(buf, a, starts, ends)
            blank_total += int(blank.sum())
            if paragraphs:
                prev = np.empty_like(blank)
                prev[0] = prev_blank
                prev[1:] = blank[:-1]
                is_row = ~blank & prev
                prev_blank = bool(blank[-1])
            else:
                is_row = ~blank
            idx = np.flatnonzero(is_row)
            if len(idx):
                if first_row is None:
                    first_row = buf[int(starts[idx[0]]):int(ends[idx[0]])]
                units.add(off + starts[idx], line_no + idx)
            off += consumed
            line_no += len(ends)
        pending = [buf[consumed:]] if consumed < len(buf) else []
        if final:
            break
    return units.finish(off), blank_total, first_row


def list_line_units(files: Sequence[SourceFile], *, kind: str, rows_per_unit: int = 1000,
                    max_unit_bytes: int = MAX_UNIT_BYTES,
                    inspect: Optional[Callable[[SourceFile, bytes], None]] = None) -> LineUnitTable:
    """List the units of ``files`` for row kind ``"lines"`` or ``"paragraphs"``.

    ``inspect(file, first_line)`` is called with each file's first row (a jsonl lister
    checks its field there, so a wrong field name fails before any worker starts).
    """
    if kind not in ("lines", "paragraphs"):
        raise ValueError(f"{kind=} must be 'lines' or 'paragraphs'")
    if rows_per_unit < 1:
        raise ValueError(f"{rows_per_unit=} must be >= 1")
    if max_unit_bytes < 1:
        raise ValueError(f"{max_unit_bytes=} must be >= 1")
    per_file, blanks = [], 0
    pool = pool_for(files)  # remote files at once, each file's blocks at once (listing_at_once.py)
    keep: dict = {}
    if pool is not None and len(files) <= KEEP_OPEN:  # remote: kept open for the first fetches (first_fetches.py)
        budget = KeptBytes()
        scanned: Any = list(each_file(lambda f: _scan_kept(f, paragraphs=kind == "paragraphs",
                                                             rows_per_unit=rows_per_unit,
                                                             max_unit_bytes=max_unit_bytes, pool=pool,
                                                             budget=budget), files))
        keep = {i: got[1] for i, got in enumerate(scanned) if not isinstance(got, Exception)}
        scanned = [got if isinstance(got, Exception) else got[0] for got in scanned]
    else:
        scanned = each_file(lambda f: scan_file(f, paragraphs=kind == "paragraphs", rows_per_unit=rows_per_unit,
                                                max_unit_bytes=max_unit_bytes, pool=pool), files)
    try:
        for f, got in zip(files, scanned):
            if isinstance(got, Exception):
                raise got
            found, blank, first_row = got
            blanks += blank
            if inspect is not None and first_row is not None:
                inspect(f, first_row)
            per_file.append(found)
    except BaseException:
        for h in keep.values():
            h.close()
        raise
    table = LineUnitTable(list(files), *unit_columns(per_file), kind, blanks)
    table.handles = keep or None
    return table


#: A remote source of at most this many line files keeps them open after listing, so the process that
#: builds the loader fetches its workers' first units without opening them again (each open is a round
#: trip: pyarrow's size lookup); first_fetches.py closes them once the workers have forked.
KEEP_OPEN = 1024


def _scan_kept(f: SourceFile, *, paragraphs: bool, rows_per_unit: int, max_unit_bytes: int, pool: Any,
               budget: Optional[KeptBytes] = None) -> tuple:
    """`scan_file` of a remote file, read at once on ``pool``: ``(its scan, the handle, left open)``; the
    handle is the file's bytes in memory when ``budget`` can keep them (`KeptBytes`)."""
    try:
        handle = f.open()
    except OSError as e:
        raise ValueError(f"cannot read {f.uri or f.path}: {e}") from e
    try:
        size = handle.size()
        raw: Optional[list] = [] if budget is not None and budget.reserve(size) else None
        blocks = blocks_at_once(handle, size, pool, keep=raw)
        try:
            scan = scan_blocks(blocks, paragraphs=paragraphs, rows_per_unit=rows_per_unit,
                               max_unit_bytes=max_unit_bytes)
        finally:
            blocks.close()  # reads in flight end before the handle closes
        return scan, handle if raw is None else in_memory(handle, raw, size)
    except OSError as e:
        handle.close()
        raise ValueError(f"cannot read {f.uri or f.path}: {e}") from e
    except BaseException:
        handle.close()
        raise


def unit_columns(per_file: Sequence[Sequence[Tuple[int, int, int, int]]]) -> Tuple[np.ndarray, ...]:
    """A `LineUnitTable`'s ``file, start, end, first_line, rows`` from each file's ``(start, end,
    first_line, rows)`` units."""
    cols = np.array([(i, *unit) for i, found in enumerate(per_file) for unit in found], np.int64).reshape(-1, 5).T
    return (cols[0].astype(np.int32),) + tuple(np.ascontiguousarray(c) for c in cols[1:])


def list_text_units(files: Sequence[SourceFile], *, mode: str = "file", rows_per_unit: int = 1000,
                    max_unit_bytes: int = MAX_UNIT_BYTES) -> LineUnitTable:
    """Units for `ReadText`: ``mode="file"`` (one document per non-empty file, no file is
    read) or ``mode="paragraphs"`` (documents separated by blank lines, one pass per file)."""
    if mode == "paragraphs":
        return list_line_units(files, kind="paragraphs", rows_per_unit=rows_per_unit, max_unit_bytes=max_unit_bytes)
    if mode != "file":
        raise ValueError(f"{mode=} must be one of {TEXT_MODES}")
    keep = [i for i, f in enumerate(files) if f.size > 0]
    n = len(keep)
    return LineUnitTable(list(files), np.asarray(keep, np.int32), np.zeros(n, np.int64),
                         np.asarray([files[i].size for i in keep], np.int64), np.ones(n, np.int64),
                         np.ones(n, np.int64), "file")
