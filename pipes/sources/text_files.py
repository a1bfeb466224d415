"""Plain-text sources, and the line-based work units that jsonl shares.

A text file becomes work units the way a parquet file becomes row groups, so the
same sharder (`ShardUnits`) balances them: a unit is a byte range of one file
holding a known number of *rows* (documents), recorded at listing as
``(file, start byte, end byte, first line number, rows)``. A reader seeks to a
unit, reads that range only, and splits it again; memory is bounded by one unit
(``rows_per_unit`` rows, cut earlier when a unit would pass ``max_unit_bytes``).

Listing (line_listing.py) reads each file once and records its units.

Lines end at ``\\n`` (so ``\\r\\n`` works, the ``\\r`` being whitespace); a lone
``\\r`` is an ordinary character. A UTF-8 byte order mark at the start of a file
is dropped. "Whitespace" is ASCII whitespace (space, ``\\t``, ``\\r``, ``\\v``,
``\\f``), decided on bytes, so listing never decodes.

Row kinds:

- ``"lines"`` (jsonl): every non-blank line is a row; blank lines are skipped
  and counted in the table (``blank_lines``), never handed to the reader.
- ``"paragraphs"``: a row is a maximal run of non-blank lines, so documents are
  separated by one or more blank (empty or whitespace-only) lines. The document
  is the run with surrounding whitespace stripped and ``\\r\\n`` turned into
  ``\\n``: the same documents as the seed tutorial's
  ``[t.strip() for t in text.split('\\n\\n') if t.strip()]`` (read in text mode),
  except that here a whitespace-only line also separates documents (the
  tutorial keeps it inside one) and only ASCII whitespace is stripped.
- ``"file"``: one document per file, its whole text (``\\r\\n`` -> ``\\n``, BOM
  dropped, otherwise verbatim). Listing reads no file; empty (0-byte) files
  yield no document.

Decoding is strict UTF-8 by default; an error names the file, the byte offset
and the line, and ``errors="replace"`` substitutes U+FFFD instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..base import Node
from ..items import Doc
from ..roles import READER
from ..shard import ShardUnits, WorkSlice, unread_after
from .files import FileUnits, OpenFiles, SourceFile
from .row_windows import ordered_rows

ASCII_WS = " \t\n\r\x0b\x0c"
# One or more blank lines after a line end: the separator between paragraphs.
_PARAGRAPH_SEP = re.compile(r"\n(?:[ \t\r\x0b\x0c]*\n)+")

KINDS = ("lines", "paragraphs", "file")
TEXT_MODES = ("file", "paragraphs")
DECODE_ERRORS = ("strict", "replace")


@dataclass
class LineUnitTable(FileUnits):
    """The work units of line-based files: unit ``i`` is bytes ``[start[i], end[i])`` of
    ``files[file[i]]``, starting at line ``first_line[i]`` (1-based) and holding ``rows[i]``
    rows of kind ``kind`` (see the module docstring). Same ``files``/``rows``/``where()``
    interface as the parquet `UnitTable` (`FileUnits`), so `ShardUnits` takes ``table.rows``."""

    files: List[SourceFile]
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    first_line: np.ndarray
    rows: np.ndarray
    kind: str
    blank_lines: int = 0
    #: Remote files listing opened and kept open, by file index (jsonl's line files), until the first
    #: fetches (first_fetches.py) have used them; never pickled.
    handles: Optional[Dict[int, Any]] = field(default=None, init=False, compare=False, repr=False)
    #: The units the loader's workers read first, fetched by the process that built it (first_fetches.py).
    first: Optional[Any] = field(default=None, init=False, compare=False, repr=False)

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "handles": None}

    def where(self, unit: int, row: Optional[int] = None) -> str:
        """A human-readable location for error messages."""
        if self.kind == "file":
            return self.path(unit)
        loc = f"{self.path(unit)}, unit {unit} (from line {int(self.first_line[unit])})"
        return loc if row is None else f"{loc}, document {row} of the unit"


# --- reading -------------------------------------------------------------------------

class UnitBytes:
    """Reads a unit's byte range, keeping a few files open per worker."""

    OPEN_FILES = 8

    def __init__(self, units: LineUnitTable):
        self.units = units
        self._open = OpenFiles(self.OPEN_FILES)
        self.ahead: Any = None  # UnitReadAhead once planned; False: reading synchronously

    def read(self, u: int) -> bytes:
        if self.ahead and self.fetchable(u):
            return self._checked(u, lambda i, start, end: self.ahead.read(u, lambda: self._range(i, start, end)))
        return self._checked(u, self._range)

    def fetchable(self, u: int) -> bool:
        """Can unit ``u`` be read ahead as one byte range of its file?"""
        return True

    def plan_from(self, parent: Any) -> None:
        """At a reader's reset: on remote storage, read the units ``parent`` (a `ShardUnits`) emits
        next ahead, from its position (unit_readahead.py)."""
        if self.ahead is None:
            from .readahead import budget_for
            from .unit_readahead import UnitReadAhead

            t = self.units
            budget = budget_for({id(f.fs): f.fs for f in t.files}.values()) if hasattr(parent, "ahead") else 0
            self.ahead = UnitReadAhead(
                lambda i: t.files[i].open_unchanged(), lambda u: (int(t.file[u]), int(t.start[u]), int(t.end[u])),
                lambda: (s.unit if self.fetchable(s.unit) else None for s in parent.ahead()),
                budget=budget, first=getattr(t, "first", None)) if budget else False
        if self.ahead:
            self.ahead.restart()

    def readahead_stats(self) -> Optional[Dict[str, Any]]:
        """What the read-ahead fetched (None: reading synchronously)."""
        return self.ahead.stats() if self.ahead else None

    def _range(self, i: int, start: int, end: int) -> bytes:
        h = self._open.get(i, lambda i: self.units.files[i].open_unchanged())
        h.seek(start)
        return h.read(end - start)

    def _checked(self, u: int, read: Callable[[int, int, int], bytes], what: str = "bytes") -> bytes:
        """Unit ``u``'s bytes, ``read(file, start, end)``; a failed or short read names the unit."""
        t = self.units
        start, end = int(t.start[u]), int(t.end[u])
        try:
            data = read(int(t.file[u]), start, end)
        except OSError as e:
            raise RuntimeError(f"cannot read {t.where(u)}: {e}") from e
        if len(data) != end - start:
            raise RuntimeError(f"{t.where(u)}: read {len(data)} {what} of {end - start}; "
                               "the file changed after the loader was built: rebuild the loader")
        return data

    def check_rows(self, u: int, n: int) -> None:
        want = int(self.units.rows[u])
        if n != want:
            raise RuntimeError(f"{self.units.where(u)} has {n} documents now, listing found {want}; "
                               "the file changed after the loader was built: rebuild the loader")


def decode(data: bytes, units: LineUnitTable, u: int, errors: str) -> str:
    """UTF-8 text of a unit; a decoding error names the file, byte offset and line."""
    try:
        text = data.decode("utf-8", errors)
    except UnicodeDecodeError as e:
        offset = int(units.start[u]) + e.start
        line = int(units.first_line[u]) + data.count(b"\n", 0, e.start)
        raise ValueError(f"{units.path(u)}: invalid UTF-8 at byte offset {offset} (line {line}): {e.reason} "
                         f"({data[e.start:e.start + 8]!r}). Re-encode the file as UTF-8, or pass "
                         "errors='replace' to read such bytes as U+FFFD") from e
    if units.kind == "file" and text.startswith("\ufeff"):
        text = text[1:]
    return text


def split_paragraphs(text: str) -> List[str]:
    """Documents separated by blank lines, stripped, ``\\r\\n`` -> ``\\n`` (see the module docstring)."""
    out = []
    for piece in _PARAGRAPH_SEP.split(text):
        piece = piece.strip(ASCII_WS)
        if piece:
            out.append(piece.replace("\r\n", "\n"))
    return out


class UnitCursor:
    """The position logic every unit reader shares (composed, not inherited).

    Walks the rows of the slices a `ShardUnits` emits: for each slice it calls
    ``load(slice) -> rows in the unit`` once, then hands out ``(slice, row)`` for the
    slice's share of the unit's seeded row order (row_windows.py: one permutation per unit, or
    per window of ``windows[unit]`` rows for a unit larger than that). Its position is the
    sharder's state at the start of the current slice plus how many rows of the slice were
    handed out; a restore loads that slice again and skips.
    """

    def __init__(self, parent: ShardUnits, load: Callable[[WorkSlice], int], *, seed: int, shuffle_rows: bool,
                 windows: Optional[np.ndarray] = None):
        self.parent, self.load, self.seed, self.shuffle_rows = parent, load, seed, shuffle_rows
        self.windows = windows  # rows per window of each unit (row_windows.py); None: whole units
        self._slice: Optional[WorkSlice] = None
        self._start_state: Optional[Dict[str, Any]] = None
        self._rows = np.empty(0, np.int64)
        self._pos = 0
        self._skip_to = 0

    def reset(self, parent_state: Optional[Dict[str, Any]], row: int) -> None:
        self._slice, self._start_state, self._skip_to = None, parent_state, int(row)
        self.parent.reset(parent_state)

    def next(self) -> Tuple[WorkSlice, int]:
        while True:
            if self._slice is None:
                self._start_state = self.parent.state_dict()
                s = next(self.parent)  # StopIteration ends the stream
                n = self.load(s)
                self._rows = ordered_rows(self.seed, s.epoch, s.unit, n, s.lo, s.hi, window=self.window(s.unit),
                                          shuffle=self.shuffle_rows)
                self._slice = s
                self._pos, self._skip_to = self._skip_to, 0
            if self._pos < len(self._rows):
                row = int(self._rows[self._pos])
                self._pos += 1
                return self._slice, row
            self._slice = None

    def unread(self, upto_epoch: int) -> List[WorkSlice]:
        """Rows not handed out yet, of epochs up to ``upto_epoch`` (see `unread_after`)."""
        if self._slice is None:
            return unread_after(self.parent, None, self._skip_to, upto_epoch)
        return unread_after(self.parent, self._slice, self._pos, upto_epoch)

    def handed_over_through(self) -> int:
        """See `ShardUnits.handed_over_through`."""
        return self.parent.handed_over_through()

    def next_epoch(self) -> int:
        """The epoch of the next row this cursor would hand out."""
        if self._slice is not None and self._pos < len(self._rows):
            return self._slice.epoch
        return self.parent.next_epoch()

    @property
    def rows(self) -> np.ndarray:
        """The current slice's rows of its unit, in the order they are handed out."""
        return self._rows

    def window(self, unit: int) -> Optional[int]:
        """Rows per window of ``unit`` (None: read whole)."""
        return None if self.windows is None else int(self.windows[unit])

    def at_slice_end(self) -> bool:
        """Was the row handed out last the current slice's last (the next `next` loads another slice)?"""
        return self._slice is not None and self._pos >= len(self._rows)

    def last_pos(self) -> int:
        """The position (in the slice's row order) of the row handed out last."""
        return self._slice.lo + self._pos - 1

    def position(self) -> Tuple[Dict[str, Any], int]:
        if self._slice is None:
            # Between slices: the next slice starts where the sharder stands now.
            return self.parent.state_dict(), self._skip_to
        return self._start_state, self._pos


class CursorReader:
    """What a reader whose position is a `UnitCursor` (``self._cursor``) hands on to it: the rows
    an elastic resume carries over (`unread`), the epoch of the next row (`next_epoch`) and its
    position (`position`). A reader of a shard's units: role ``READER`` (pipes/graph.py)."""

    ROLE = READER

    @property
    def sharder(self) -> ShardUnits:
        """The `ShardUnits` whose slices this reader reads (its state is under the reader's ``PARENT`` key)."""
        return self._cursor.parent

    def unread(self, upto_epoch: int) -> List[WorkSlice]:
        return self._cursor.unread(upto_epoch)

    def next_epoch(self) -> int:
        return self._cursor.next_epoch()

    def handed_over_through(self) -> int:
        return self._cursor.handed_over_through()

    def position(self) -> Tuple[Dict[str, Any], int]:
        """The sharder's state at the current slice's start and the rows of it handed out: the
        position a reader's state saves (a packer's save point records it, pack/savepoint.py)."""
        return self._cursor.position()


class SkipCount:
    """What a reader that skips rows (null text, a bad line) shows of them: ``self._skipped``, the
    count its state carries, which a `CursorReader` saves and restores with its position."""

    @property
    def skipped(self) -> int:
        """Rows skipped so far (restored with the state); recipes show it in ``loader.stats()``."""
        return self._skipped

    def carry_skipped(self, skipped: int) -> None:
        """Continue the skipped count of an elastic resume (elastic.py)."""
        self._skipped = int(skipped)

    def _restore_position(self, initial_state: Optional[Dict[str, Any]]) -> None:
        """Put the cursor and the skipped count where ``initial_state`` (``PARENT``, ``ROW``,
        ``SKIPPED``) says, or at the start (None): a reset's part common to the readers."""
        if initial_state is None:
            self._cursor.reset(None, 0)
            self._skipped = 0
        else:
            self._cursor.reset(initial_state[self.PARENT], initial_state[self.ROW])
            self._skipped = int(initial_state[self.SKIPPED])

    def _position_state(self) -> Dict[str, Any]:
        """The state `_restore_position` restores: the cursor's position and the skipped count."""
        parent, row = self._cursor.position()
        return {self.PARENT: parent, self.ROW: row, self.SKIPPED: self._skipped}


class ReadText(CursorReader, Node[Doc]):
    """Reads the documents of plain-text units (`list_text_units`): ``Doc(text, source, unit,
    row)`` with ``row`` the document's index in its unit, in file order.

    Args:
        parent: the `ShardUnits` node whose slices this reader reads.
        units: the source's units from `list_text_units` (kind ``"paragraphs"`` or ``"file"``).
        source: the source's name (``Doc.source``, and in messages).
        seed: seeds the row permutation per (epoch, unit).
        shuffle_rows: False: documents in file order (what a token cache is built from).
        errors: ``"strict"`` raises on invalid UTF-8 naming the file and byte offset;
            ``"replace"`` reads such bytes as U+FFFD.

    State keys: ``PARENT`` (the sharder's state at the start of the current slice) and ``ROW``
    (documents of that slice handed out; a restore reads the unit again and skips them). No
    skipped count: a text reader skips no document.
    """

    #: A paragraph is text whatever it holds: a text reader skips no row (the reader protocol's count).
    skipped = 0

    def carry_skipped(self, skipped: int) -> None:
        """Nothing to continue: a text reader never skips (the reader protocol, elastic.py)."""

    PARENT = "parent"
    ROW = "row"
    STATE_KEYS = (PARENT, ROW)

    def __init__(self, parent: ShardUnits, units: LineUnitTable, *, source: str = "", seed: int = 0,
                 shuffle_rows: bool = True, errors: str = "strict"):
        super().__init__(parent)
        if units.kind not in TEXT_MODES:
            raise ValueError(f"ReadText reads units listed by list_text_units, got kind {units.kind!r}")
        if errors not in DECODE_ERRORS:
            raise ValueError(f"{errors=} must be one of {DECODE_ERRORS}")
        self.units, self.source, self.errors = units, source, errors
        self._bytes = UnitBytes(units)
        self._docs: List[str] = []
        self._cursor = UnitCursor(parent, self._load, seed=seed, shuffle_rows=shuffle_rows)

    def _load(self, s: WorkSlice) -> int:
        u = s.unit
        text = decode(self._bytes.read(u), self.units, u, self.errors)
        if self.units.kind == "file":
            self._docs = [text.replace("\r\n", "\n")]
        else:
            self._docs = split_paragraphs(text)
        self._bytes.check_rows(u, len(self._docs))
        return len(self._docs)

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._docs = []
        if initial_state is None:
            self._cursor.reset(None, 0)
        else:
            self._cursor.reset(initial_state[self.PARENT], initial_state[self.ROW])
        self._bytes.plan_from(self._cursor.parent)

    def readahead_stats(self) -> Optional[Dict[str, Any]]:
        return self._bytes.readahead_stats()

    def next(self) -> Doc:
        s, row = self._cursor.next()
        return Doc(self._docs[row], self.source, s.unit, row, s.epoch, self._cursor.last_pos(), s.used)

    def get_state(self) -> Dict[str, Any]:
        parent, row = self._cursor.position()
        return {self.PARENT: parent, self.ROW: row}
