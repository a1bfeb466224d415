"""Parquet sources: list work units from file footers, and read one slice at a time.

Listing opens each file's footer once (in the process that builds the loader)
and records ``(file, row group, rows)`` for every non-empty row group; the
resulting `UnitTable` is a few small integer arrays (rows and the column's uncompressed
bytes per row group), so it crosses into loader workers cheaply. Reading loads one row
group's text column at a time, or, for a row group larger than the reader's window
(``windows``, sized by the recipes from ``read_budget`` shared by the sources), its rows in
windows (row_windows.py, parquet_windows.py): the windows of a slice decoded in one pass and
held lz4-compressed until read (held_rows.py, up to ``hold_bytes``: twice a source's share),
or one window decoded at a time where they cannot be held; texts become Python strings a chunk
at a time (``chunk_bytes``: the recipes give a quarter of a source's share of ``read_budget``).
So what one worker holds is about ``read_budget`` of rows and a quarter of it in texts,
whatever the corpus and its row groups; with ``read_budget=None`` it is a row group per source.

Inside a unit, rows are visited in a seeded permutation per (epoch, unit); a
shard reads positions ``[lo, hi)`` of that permutation, so shards that split a
unit stay disjoint. The reader's state is the sharder's state at the start of
the current slice plus how many rows of the slice were emitted: restoring reads
that row group again and skips, never storing text.

Bad files fail with the file (and row group, and row) named: an unreadable footer
(a truncated copy) and a missing or non-text column fail at listing, before any
worker starts; a corrupt row group fails when a worker reads it. Pages are read
with checksum verification, so a file written with page checksums
(``write_page_checksum=True`` in pyarrow) turns any corrupt byte into an error
instead of wrong text; verifying adds to the parquet read time, far below the
tokenizer's cost for the same text (see docs/performance.md).
Files with no rows contribute nothing and are not checked. A file whose size
changed since listing is refused when a worker opens it.

Listing reads each footer itself (the file's last ``TAIL_BYTES``, one read as in pyarrow;
parquet_footer.py) and hashes its bytes: the file's content key in resume fingerprints
(fingerprint.py), so a same-size rewrite is told apart at resume. Reading and hashing it
costs little beyond pyarrow's own footer read (see docs/performance.md). On S3 a footer is a
round trip either way (two with the size lookup pyarrow makes when it opens a file), so
remote footers are read ``LIST_THREADS`` (32, listing_at_once.py) at a time, the first bad file in order
still being the one named (benchmarks/remote.py's proxy in front of moto's S3 measures it).
Their bytes, up to ``SHIP_FOOTERS`` (``8 << 20``) a source,
go to the loader workers with the units, so a worker reads no footer before its first
row groups (readahead.py). The files listing opened for them (each open is pyarrow's size lookup,
a round trip) stay open until the recipe has fetched, in the process that builds the loader, the
first row groups of its workers' shards (`start_first_fetches`, first_fetches.py): a worker
starts with them in its memory instead of opening its files and fetching them, two round trips
after it starts.
A file that does not end with ``PAR1`` is called truncated only if it starts with it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..base import Node
from .fingerprint import content_key
from ..items import Doc
from ..shard import ShardUnits, WorkSlice
from .files import FileChangedError, FileUnits, OpenFiles, SourceFile, sft_advice
from .listing_at_once import each_file
from .host_cache import shared
from .first_fetches import FirstFetches
from .parquet_footer import MAGIC, TAIL_BYTES, footer_bytes  # noqa: F401 (MAGIC, TAIL_BYTES re-exported)
from .held_rows import BadRow, HeldWindow, rows_within
from .parquet_windows import RowsChanged, UnitWindows
from .readahead import RowGroupReadAhead, budget_for
from .row_windows import windowed
from .text_files import CursorReader, SkipCount, UnitCursor

log = logging.getLogger(__name__)


@dataclass
class UnitTable(FileUnits):
    """The work units of one source: unit ``i`` is row group ``row_group[i]`` of
    ``files[file[i]]`` with ``rows[i]`` rows."""

    files: List[SourceFile]
    file: np.ndarray
    row_group: np.ndarray
    rows: np.ndarray
    #: Each file's footer bytes as listing read them, for remote files when they are few (`SHIP_FOOTERS`):
    #: a loader worker then reads no footer before its first row groups (readahead.py).
    footers: Optional[List[bytes]] = None
    #: The files as listing opened them (remote files whose footers are shipped), until the first fetches
    #: (first_fetches.py's `start_first_fetches`) have used them; never pickled.
    handles: Optional[List[Any]] = field(default=None, compare=False, repr=False)
    #: The row groups the loader's workers read first, fetched by the process that built it (readahead.py).
    first: Optional[FirstFetches] = field(default=None, compare=False, repr=False)
    #: Each unit's uncompressed bytes of the listed column (footers), which size its read windows
    #: (row_windows.py); None when a footer did not say (an index written before it recorded them).
    col_bytes: Optional[np.ndarray] = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "handles": None}

    def where(self, unit: int, row: Optional[int] = None) -> str:
        """A human-readable location for error messages."""
        loc = f"{self.path(unit)}, row group {int(self.row_group[unit])}"
        return loc if row is None else f"{loc}, row {row}"


#: Column kinds a reader can ask for: documents are text, conversations are lists.
TEXT, LIST, OTHER = "text", "list", "other"
REQUIRES = (TEXT, LIST, None)


def column_kind(t: pa.DataType) -> str:
    """TEXT for (large, view, dictionary-encoded) strings, LIST for list columns, else OTHER."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return TEXT
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) \
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return LIST
    return OTHER


@dataclass(frozen=True)
class Footer:
    """What listing needs from one file's footer: its columns as ``(name, type, kind)``,
    the number of rows of each row group (empty ones included, so indices hold), the footer's
    content key (a hash of its bytes: the file's key in resume fingerprints), and the columns'
    uncompressed sizes per row group."""

    columns: Tuple[Tuple[str, str, str], ...]
    row_groups: Tuple[int, ...]
    digest: str = ""
    #: Per row group, the uncompressed bytes of each column of ``columns`` (its leaves summed); empty
    #: when unknown (an index written before it recorded them): what sizes a unit's read windows.
    sizes: Tuple[Tuple[int, ...], ...] = ()
    raw: bytes = field(default=b"", compare=False, repr=False)  # the footer's bytes, when read from the file
    handle: Any = field(default=None, compare=False, repr=False)  # a remote file as listing opened it


def read_footer(f: SourceFile) -> Footer:
    """Read ``f``'s footer once (one read of its last ``TAIL_BYTES``, as pyarrow does); an unreadable
    one is a `ValueError` naming the file."""
    remote = f.fs.type_name != "local"
    handle = None
    try:
        handle = f.open()
        size = handle.size()
        if f.content:  # bytes that cannot change: read once per host (host_cache.py)
            raw = shared("parquet-footer", f"{f.content}\0{size}", lambda: footer_bytes(handle, size))
        else:
            raw = footer_bytes(handle, size)
        if not remote:
            handle.close()
        meta = pq.ParquetFile(pa.BufferReader(raw)).metadata
        schema = meta.schema.to_arrow_schema()
    except Exception as e:
        if handle is not None:
            handle.close()
        if "not a parquet file" in str(e):
            raise ValueError(f"{f.uri or f.path}: {e}; point the source at parquet files, or remove it") from e
        raise ValueError(f"{f.uri or f.path} is not a readable parquet file ({e}); it may be truncated (an "
                         "interrupted copy or write): copy or write it again, or remove it from the source") from e
    return Footer(tuple((x.name, str(x.type), column_kind(x.type)) for x in schema),
                  tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups)), content_key(raw),
                  column_sizes(meta, schema.names), raw if remote else b"", handle if remote else None)


def column_sizes(meta: pq.FileMetaData, names: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
    """Per row group, the uncompressed bytes of each top-level column ``names[j]``: the sum over its
    leaf columns (a list of messages has several) of ``total_uncompressed_size``."""
    where = {name: j for j, name in enumerate(names)}
    out = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        sizes = [0] * len(names)
        for c in range(rg.num_columns):
            col = rg.column(c)
            j = where.get(col.path_in_schema.split(".", 1)[0])
            if j is not None:
                sizes[j] += int(col.total_uncompressed_size)
        out.append(tuple(sizes))
    return tuple(out)


#: Footer bytes of a remote source's files kept for the loader workers, at most (beyond: they read them).
SHIP_FOOTERS = 8 << 20


def footers_or_errors(files: Sequence[SourceFile]) -> List[Any]:
    """`read_footer` of every file, in order: its `Footer`, or the exception reading it raised. Remote
    files are read ``LIST_THREADS`` at a time (see the module docstring); local files one by one,
    from the page cache."""
    kept = [0]  # footer bytes kept so far: past SHIP_FOOTERS none are (the workers read their own)
    lock = threading.Lock()

    def one(f: SourceFile) -> Any:
        footer = read_footer(f)
        with lock:
            kept[0] += len(footer.raw)
            over = kept[0] > SHIP_FOOTERS
        if over and footer.raw:
            if footer.handle is not None:
                footer.handle.close()
            return replace(footer, raw=b"", handle=None)
        return footer

    return list(each_file(one, files, name="tokenloom-footers"))


def read_footers(files: Sequence[SourceFile]) -> List[Footer]:
    """`read_footer` of every file (remote ones at once, see `footers_or_errors`); the first file in
    order that fails raises, as reading them one by one would."""
    out = footers_or_errors(files)
    for x in out:
        if isinstance(x, Exception):
            raise x
    return out


def check_column(f: SourceFile, footer: Footer, column: str, require: Optional[str]) -> None:
    """``column`` must exist in ``f`` and be of kind ``require`` (None: any); files without
    rows are not checked (nothing is read from them)."""
    if sum(footer.row_groups) == 0:
        return
    types = {name: (typ, kind) for name, typ, kind in footer.columns}
    if column not in types:
        # text wanted, and a list column (conversations?) there: the sft recipe reads those
        lists = sorted((n for n, (_, k) in types.items() if k == LIST), key=lambda n: n != "messages")
        sft = (f"; or, as its column {lists[0]!r} holds lists (conversations?), train on it with "
               f"{sft_advice(lists[0])}") if require == TEXT and lists else ""
        raise ValueError(f"column {column!r} not found in {f.uri or f.path}; it has columns {list(types)}. "
                         "Pass text_column= with one of them, or fix or remove this file" + sft)
    typ, kind = types[column]
    if require is not None and kind != require:
        want = "text (string)" if require == TEXT else "a list (of messages)"
        sft = (f"; if it holds conversations (lists of messages), train on them with {sft_advice(column)}"
               if require == TEXT and kind == LIST else "")
        raise ValueError(f"column {column!r} in {f.uri or f.path} has type {typ}, not {want}; pass text_column= "
                         f"naming a {require} column, or fix or remove this file" + sft)


def units_from_footers(files: Sequence[SourceFile], footers: Sequence[Footer], column: str, *,
                       require: Optional[str] = TEXT) -> UnitTable:
    """Check ``column`` in every file and list the non-empty row groups as units; the
    table's files carry their footers' digests as content keys."""
    if require not in REQUIRES:
        raise ValueError(f"{require=} must be one of {REQUIRES}")
    f_idx, rgs, rows, sizes = [], [], [], []
    for i, (f, footer) in enumerate(zip(files, footers)):
        check_column(f, footer, column, require)
        j = next((j for j, c in enumerate(footer.columns) if c[0] == column), None)
        for rg, n in enumerate(footer.row_groups):
            if n > 0:
                f_idx.append(i)
                rgs.append(rg)
                rows.append(n)
                sizes.append(footer.sizes[rg][j] if footer.sizes and j is not None else -1)
    keyed = [replace(f, key=footer.digest) for f, footer in zip(files, footers)]
    raw = [footer.raw for footer in footers]
    ship = (any(f.fs.type_name != "local" for f in files) and all(raw)
            and sum(map(len, raw)) <= SHIP_FOOTERS)
    handles = [footer.handle for footer in footers]
    if not (ship and all(h is not None for h in handles)):
        for h in handles:
            if h is not None:
                h.close()
        handles = None
    col_bytes = np.asarray(sizes, np.int64)
    return UnitTable(keyed, np.asarray(f_idx, np.int32), np.asarray(rgs, np.int32), np.asarray(rows, np.int64),
                     raw if ship else None, handles, col_bytes=None if (col_bytes < 0).any() else col_bytes)


def list_parquet_units(files: Sequence[SourceFile], column: str, *, require: Optional[str] = TEXT) -> UnitTable:
    """Read every footer once and list the units; ``column`` must hold ``require``
    (``"text"``; ``"list"`` for conversations; None: anything)."""
    return units_from_footers(files, read_footers(files), column, require=require)


class OpenParquet:
    """A parquet file a reader keeps open: its handle and its parsed footer. A `pq.ParquetFile` is made
    from them per unit (`parquet`: no read) and dropped with the unit, because pyarrow keeps memory
    of the last row group read in a `pq.ParquetFile` for as long as the object lives (figures in
    docs/performance.md, "Memory per worker"): one per reader and file, that is memory per source
    that no reading needs."""

    def __init__(self, handle: Any, meta: pq.FileMetaData):
        self.handle, self.meta = handle, meta

    def parquet(self) -> pq.ParquetFile:
        # No buffer_size (untried over these handles): an open window stream holds its compressed column chunk
        return pq.ParquetFile(self.handle, metadata=self.meta, page_checksum_verification=True)

    def close(self) -> None:
        self.handle.close()


def _rows_within(column: Any, limit: int) -> int:
    """How many first rows of ``column`` hold at most ``limit`` bytes of values (at least one): by
    the values' lengths for text, else in proportion to the column's bytes."""
    large = pa.types.is_large_string(column.type)
    if pa.types.is_string(column.type) or large:
        # from the offsets buffers: pyarrow.compute (binary_length) costs each worker its import
        dtype = np.int64 if large else np.int32
        lengths = [np.diff(np.frombuffer(c.buffers()[1], dtype)[c.offset:c.offset + len(c) + 1])
                   for c in getattr(column, "chunks", [column]) if len(c)]
        return rows_within(np.concatenate(lengths) if lengths else np.zeros(0, np.int64), limit)
    return max(1, len(column) * limit // column.nbytes)


def _bad_utf8(value: pa.Scalar) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return True
    return False


class ReadParquet(CursorReader, SkipCount, Node[Doc]):
    """Reads the documents of the slices a `ShardUnits` node emits.

    Memory: what a reader holds is its position, the rows it is reading (a whole row group; or,
    for a row group larger than ``windows[unit]`` rows, the windows of its slice compressed, up to
    ``hold_bytes``, or one window decoded: row_windows.py, parquet_windows.py, held_rows.py) and
    the Python texts of a chunk of rows (at most ``chunk_bytes``, and a
    row per kibibyte of it, at least `CHUNK_ROWS`): texts are converted as the cursor reaches
    them, never a whole slice at once, and a chunk is one ``take`` call, so a large chunk costs
    little per row (one source at the recipes' budget converts a row group at once).
    At a slice's end the texts and the rows are let go, unless the next slice reads the same
    unit (an elastic resume's prefix lists documents one by one, sorted by unit).

    Null values are skipped, counted in the state (``skipped``, and per source in a
    recipe's ``loader.stats()``) and reported once per worker with their location,
    so a few bad rows do not stop a run and are never lost silently.

    Row groups on remote storage are fetched ahead in the background (readahead.py).

    Args:
        parent: the `ShardUnits` node whose slices (a unit, an epoch, a range of the unit's row
            order) this reader reads.
        units: the source's `UnitTable` (listing): unit ``i`` is a row group of a file.
        column: the text column read (``Doc.text``).
        source: the source's name (``Doc.source``, and in messages).
        seed: seeds the row permutation per (epoch, unit).
        shuffle_rows: False: rows in file order (what a token cache is built from).
        readahead: the read-ahead byte budget (0: read synchronously; None: by
            ``TOKENLOOM_READAHEAD``, readahead.py's ``DEFAULT_BYTES`` for remote files and
            none for local ones).
        windows: rows per read window of each unit (`row_windows.window_rows`; the recipes size
            them from ``read_budget``); a unit with more rows is read, and its rows shuffled, in
            windows. None: whole row groups.
        chunk_bytes: Arrow bytes of the texts converted to Python at once (and held), at most
            (at least one row); None: `CHUNK_BYTES`. The recipes give a quarter of the source's
            share of ``read_budget``.
        hold_bytes: compressed bytes of a row group's rows read ahead in one pass and held, at most
            (parquet_windows.py; None: twice the text of a window). The recipes give twice the
            source's share of ``read_budget``.

    State keys: ``PARENT`` (the sharder's state at the start of the current slice), ``ROW`` (rows
    of that slice handed out, null ones included; a restore reads the row group again and skips
    them) and ``SKIPPED`` (null rows skipped so far). A position: no text is stored.
    """

    PARENT = "parent"
    ROW = "row"
    SKIPPED = "skipped"
    STATE_KEYS = (PARENT, ROW, SKIPPED)

    #: Open parquet files kept per worker; reopening costs a footer read.
    OPEN_FILES = 8
    #: Rows whose texts are converted to Python at once (and held), at most, for a chunk of `CHUNK_BYTES`.
    CHUNK_ROWS = 32
    #: Arrow bytes of the rows converted at once, at most (at least one row is), by default.
    CHUNK_BYTES = 32 << 10

    def __init__(self, parent: ShardUnits, units: UnitTable, *, column: str = "text", source: str = "",
                 seed: int = 0, shuffle_rows: bool = True, readahead: Optional[int] = None,
                 windows: Optional[np.ndarray] = None, chunk_bytes: Optional[int] = None,
                 hold_bytes: Optional[int] = None):
        super().__init__(parent)
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"{chunk_bytes=} must be >= 1 (None: {self.CHUNK_BYTES})")
        self.chunk_bytes = self.CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
        self.chunk_rows = max(self.CHUNK_ROWS, self.chunk_bytes >> 10)
        if hold_bytes is not None and hold_bytes < 1:
            raise ValueError(f"{hold_bytes=} must be >= 1 (None: twice a window's text)")
        self.hold_bytes = hold_bytes
        self.parent, self.units, self.column = parent, units, column
        self.source, self.seed, self.shuffle_rows = source, seed, shuffle_rows
        self.readahead = readahead
        if windows is not None and len(windows) != len(units.rows):
            raise ValueError(f"windows has {len(windows)} entries for {len(units.rows)} units: give one per unit "
                             "(row_windows.window_rows), or None to read whole row groups")
        self._ahead: Any = None  # RowGroupReadAhead, made at the first reset (in the process that reads); False: off
        self._open = OpenFiles(self.OPEN_FILES)
        self._cursor = UnitCursor(parent, self._load, seed=seed, shuffle_rows=shuffle_rows, windows=windows)
        self._skipped = 0
        self._warned = False
        self._drop_unit()

    def _drop_unit(self) -> None:
        """Let go of the loaded unit's rows and texts."""
        self._unit = -1  # the unit whose rows are loaded (whole, or in windows)
        self._column: Any = None  # its rows in file order: the whole unit, or window `_window`
        self._first = 0  # the row (in file order) `_column` starts at
        self._window = -1  # which window `_column` is (-1: the whole unit)
        self._windows: Optional[UnitWindows] = None  # the unit's windows, for a unit read in windows
        self._texts: list = []  # Python texts of the slice's rows [_chunk, _chunk + len(_texts)) (cursor order)
        self._chunk = 0

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._drop_unit()
        self._restore_position(initial_state)
        ahead = self._read_ahead()
        if ahead is not None:
            ahead.restart()  # plans the fetches from the restored position; they start with the first read

    def _read_ahead(self) -> Optional[RowGroupReadAhead]:
        """This reader's read-ahead, or None: off, or a reader of another container (its own `_read_unit`)."""
        if self._ahead is None:
            own = type(self)._read_unit is ReadParquet._read_unit and hasattr(self.parent, "ahead")
            budget = budget_for({id(f.fs): f.fs for f in self.units.files}.values(), self.readahead) if own else 0
            self._ahead = RowGroupReadAhead(
                lambda i: self.units.files[i].open_unchanged(), self._upcoming, budget=budget, columns=[self.column],
                name=self.source, footers=getattr(self.units, "footers", None),
                first=getattr(self.units, "first", None)) if budget else False
        return self._ahead or None

    def _upcoming(self) -> Iterator[Tuple[int, int]]:
        """``(file, row group)`` of the units this reader loads next, in order, from the sharder's position."""
        file, group = self.units.file, self.units.row_group
        return ((int(file[s.unit]), int(group[s.unit])) for s in self.parent.ahead())

    def readahead_stats(self) -> Optional[Dict[str, Any]]:
        """What the read-ahead fetched and how long the reader waited for it (None: reading synchronously)."""
        ahead = self._ahead or None
        return None if ahead is None else ahead.stats()

    def _opened(self, i: int) -> "OpenParquet":
        handle = self.units.files[i].open_unchanged()
        try:
            return OpenParquet(handle, pq.ParquetFile(handle).metadata)
        except BaseException:
            handle.close()
            raise

    def _parquet(self, i: int) -> pq.ParquetFile:
        """File ``i`` as a new `pq.ParquetFile` over its kept handle and footer (see `OpenParquet`)."""
        return self._open.get(i, self._opened).parquet()

    def _read_unit(self, u: int) -> pa.Table:
        """Unit ``u``'s column as a one-column table (a reader of another container overrides it)."""
        ahead = self._ahead or None
        if ahead is not None:
            return ahead.read((int(self.units.file[u]), int(self.units.row_group[u])))
        # use_threads=False: one column decodes the same on the calling thread, and buffers of a Python
        # file freed on pyarrow's threads at the interpreter's exit abort it (readahead.py's `_decode`)
        return self._parquet(int(self.units.file[u])).read_row_group(int(self.units.row_group[u]),
                                                                     columns=[self.column], use_threads=False)

    def _unit_file(self, u: int) -> Callable[[], pq.ParquetFile]:
        """What makes unit ``u``'s file as a new `pq.ParquetFile`, to read its row group in windows: over
        the bytes fetched ahead, or over the file."""
        ahead = self._ahead or None
        if ahead is not None:
            return ahead.read((int(self.units.file[u]), int(self.units.row_group[u])), whole=False)
        opened = self._open.get(int(self.units.file[u]), self._opened)
        return opened.parquet

    def _read_error(self, u: int, e: Exception) -> Exception:
        """The error for unit ``u`` failing to read with ``e``: where, why, and what to do."""
        hint = ("the file is gone (deleted or moved after the loader was built)" if isinstance(e, FileNotFoundError)
                else "the row group is corrupt, or the file changed after the loader was built")
        why = str(e).rstrip().rstrip(".")  # pyarrow's messages may end with a full stop of their own
        return RuntimeError(f"cannot read {self.units.where(u)}: {why}. {hint}; check it with pyarrow.parquet."
                            "ParquetFile(path).read_row_group(n), rewrite or remove it, and rebuild the loader")

    def _load(self, s: WorkSlice) -> int:
        u = s.unit
        n = int(self.units.rows[u])
        self._texts, self._chunk = [], 0
        if u == self._unit:  # the same unit again (an elastic prefix's next document): kept at the slice's end
            return n
        self._drop_unit()
        window = self._cursor.window(u)
        try:
            if windowed(n, window):
                group = int(self.units.row_group[u])
                make = self._unit_file(u)
                found = make().metadata.row_group(group).num_rows
            else:
                table = self._read_unit(u)
                found = table.num_rows
        except FileChangedError:
            raise
        except Exception as e:
            raise self._read_error(u, e) from e
        if found != n:
            raise RuntimeError(f"{self.units.where(u)} has {found} rows, its footer said {n}; "
                               "the file changed after the loader was built")
        if windowed(n, window):
            self._windows = UnitWindows(make, unit=u, row_group=group, column=self.column, rows=n, window=window,
                                        hold_bytes=self.hold_bytes)
        else:
            self._column = table.column(0)
        self._unit = u
        return n

    def _take(self, s: WorkSlice, i: int) -> None:
        """Convert the texts of the slice's rows from index ``i`` (in the cursor's order) on: at most
        ``chunk_rows`` rows and ``chunk_bytes`` bytes, within one window."""
        rows = self._cursor.rows
        end = min(len(rows), i + self.chunk_rows)
        if self._windows is not None:
            w = self._windows.window
            k = (s.lo + i) // w
            if k != self._window:
                self._column = None  # the old window goes before the next is decoded
                try:
                    self._column = self._windows.get(k, last=(s.hi - 1) // w)
                except RowsChanged as e:
                    raise RuntimeError(f"{self.units.where(s.unit)}: {e}") from e
                except Exception as e:
                    raise self._read_error(s.unit, e) from e
                self._window, self._first = k, k * w
            end = min(end, (k + 1) * w - s.lo)  # positions of window k end there
        # From the buffer: pa.array() on any input imports pandas, 0.15-0.2 s of each worker's first batch.
        idx = np.ascontiguousarray(rows[i:end], dtype=np.int64) - self._first
        if isinstance(self._column, HeldWindow):
            try:
                self._texts = self._column.texts(idx, self.chunk_bytes)
            except BadRow as e:
                raise self._bad_text(s, e.index + self._first, e.error) from e.error
            self._chunk = i
            return
        column = self._column.take(pa.Array.from_buffers(pa.int64(), len(idx), [None, pa.py_buffer(idx)]))
        if len(idx) > 1 and column.nbytes > self.chunk_bytes:
            keep = _rows_within(column, self.chunk_bytes)
            column, idx = column.slice(0, keep), idx[:keep]
        try:
            self._texts = column.to_pylist()
        except UnicodeDecodeError as e:
            row = next(int(r) + self._first for r, v in zip(idx, column) if _bad_utf8(v))
            raise self._bad_text(s, row, e) from e
        self._chunk = i

    def _bad_text(self, s: WorkSlice, row: int, e: UnicodeDecodeError) -> ValueError:
        """The error for row ``row`` (of unit ``s.unit``, file order) not being UTF-8."""
        return ValueError(f"{self.units.where(s.unit, row)}: invalid UTF-8 in column {self.column!r} ({e.reason} "
                          f"at byte {e.start}); the page is corrupt, or the column holds binary data as a string. "
                          "Rewrite or remove the file")

    def _slice_done(self, s: WorkSlice) -> None:
        """The slice's last row is out: let go of its texts, and of its unit unless the next slice reads it."""
        self._texts = []
        ahead = getattr(self.parent, "ahead", None)
        nxt = next(iter(ahead()), None) if ahead is not None else None
        if nxt is None or nxt.unit != s.unit:
            if self._windows is not None:
                self._windows.drop()
            self._drop_unit()

    def next(self) -> Doc:
        while True:
            s, row = self._cursor.next()
            pos = self._cursor.last_pos()
            i = pos - s.lo
            if not self._chunk <= i < self._chunk + len(self._texts):
                self._take(s, i)
            text = self._texts[i - self._chunk]
            if self._cursor.at_slice_end():
                self._slice_done(s)
            if text is not None:
                return Doc(text, self.source, s.unit, row, s.epoch, pos, s.used)
            self._skipped += 1
            if not self._warned:
                self._warned = True
                log.warning("skipping null text at %s (further nulls are counted, not logged)",
                            self.units.where(s.unit, row))

    def get_state(self) -> Dict[str, Any]:
        return self._position_state()
