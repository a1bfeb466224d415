"""Parquet sources: list work units from file footers, and read one slice at a time.

Listing opens each file's footer once (in the process that builds the loader)
and records ``(file, row group, rows)`` for every non-empty row group; the
resulting `UnitTable` is three small integer arrays, so it crosses into loader
workers cheaply. Reading loads one row group's text column at a time, so memory
is bounded by the largest row group (a 128 MB row group of text is ~128 MB in
Arrow), whatever the corpus size.

Inside a unit, rows are visited in a seeded permutation per (epoch, unit); a
shard reads positions ``[lo, hi)`` of that permutation, so shards that split a
unit stay disjoint. The reader's state is the sharder's state at the start of
the current slice plus how many rows of the slice were emitted: restoring reads
that row group again and skips, never storing text.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .base import Node
from .items import Doc
from .shard import ROW_ORDER_TAG, ShardUnits, WorkSlice, rng_for
from .sources import SourceFile

log = logging.getLogger(__name__)


@dataclass
class UnitTable:
    """The work units of one source: unit ``i`` is row group ``row_group[i]`` of
    ``files[file[i]]`` with ``rows[i]`` rows."""

    files: List[SourceFile]
    file: np.ndarray
    row_group: np.ndarray
    rows: np.ndarray

    @property
    def total_rows(self) -> int:
        return int(self.rows.sum())

    def where(self, unit: int, row: Optional[int] = None) -> str:
        """A human-readable location for error messages."""
        f = self.files[int(self.file[unit])]
        loc = f"{f.uri or f.path}, row group {int(self.row_group[unit])}"
        return loc if row is None else f"{loc}, row {row}"


def _text_like(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def list_parquet_units(files: Sequence[SourceFile], column: str, *, require_text: bool = True) -> UnitTable:
    """Read every footer once; check that ``column`` exists (and holds text, unless
    ``require_text=False``, as for a list of chat messages)."""
    f_idx, rgs, rows = [], [], []
    for i, f in enumerate(files):
        try:
            with f.open() as handle:
                meta = pq.ParquetFile(handle).metadata
                schema = meta.schema.to_arrow_schema()
        except Exception as e:
            raise ValueError(f"cannot read parquet footer of {f.uri or f.path}: {e}. "
                             "Is it a complete parquet file?") from e
        if column not in schema.names:
            raise ValueError(
                f"column {column!r} not found in {f.uri or f.path}; it has columns {schema.names}. "
                "Pass text_column= with one of them."
            )
        typ = schema.field(column).type
        if require_text and not _text_like(typ):
            raise ValueError(
                f"column {column!r} in {f.uri or f.path} has type {typ}, not text; "
                "pass text_column= naming a string column"
            )
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if n > 0:
                f_idx.append(i)
                rgs.append(rg)
                rows.append(n)
    return UnitTable(list(files), np.asarray(f_idx, np.int32), np.asarray(rgs, np.int32), np.asarray(rows, np.int64))


class ReadParquet(Node[Doc]):
    """Reads the documents of the slices a `ShardUnits` node emits.

    Null values are skipped, counted in the state (``skipped``) and reported once
    per worker with their location, so a few bad rows do not stop a run and
    are never lost silently.
    """

    PARENT = "parent"
    ROW = "row"
    SKIPPED = "skipped"
    STATE_KEYS = (PARENT, ROW, SKIPPED)

    #: Open parquet files kept per worker; reopening costs a footer read.
    OPEN_FILES = 8

    def __init__(self, parent: ShardUnits, units: UnitTable, *, column: str = "text", source: str = "",
                 seed: int = 0, shuffle_rows: bool = True):
        super().__init__()
        self.parent, self.units, self.column = parent, units, column
        self.source, self.seed, self.shuffle_rows = source, seed, shuffle_rows
        self._open: "OrderedDict[int, pq.ParquetFile]" = OrderedDict()
        self._slice_start_state: Optional[Dict[str, Any]] = None
        self._texts: list = []
        self._rows: np.ndarray = np.empty(0, np.int64)
        self._slice: Optional[WorkSlice] = None
        self._pos = 0
        self._skip_to = 0
        self._skipped = 0
        self._warned = False

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._slice, self._texts = None, []
        if initial_state is None:
            self.parent.reset(None)
            self._slice_start_state = None
            self._skip_to, self._skipped = 0, 0
        else:
            self._slice_start_state = initial_state[self.PARENT]
            self.parent.reset(self._slice_start_state)
            self._skip_to = int(initial_state[self.ROW])
            self._skipped = int(initial_state[self.SKIPPED])

    def _file(self, i: int) -> pq.ParquetFile:
        pf = self._open.get(i)
        if pf is None:
            f = self.units.files[i]
            pf = pq.ParquetFile(f.open())
            self._open[i] = pf
            if len(self._open) > self.OPEN_FILES:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(i)
        return pf

    def _load(self, s: WorkSlice) -> None:
        u = s.unit
        try:
            table = self._file(int(self.units.file[u])).read_row_group(int(self.units.row_group[u]),
                                                                         columns=[self.column])
        except Exception as e:
            raise RuntimeError(f"cannot read {self.units.where(u)}: {e}") from e
        n = int(self.units.rows[u])
        if table.num_rows != n:
            raise RuntimeError(f"{self.units.where(u)} has {table.num_rows} rows, its footer said {n}; "
                               "the file changed after the loader was built")
        order = rng_for(self.seed, ROW_ORDER_TAG, s.epoch, u).permutation(n) if self.shuffle_rows else np.arange(n)
        self._rows = order[s.lo:s.hi]
        self._texts = table.column(0).take(pa.array(self._rows)).to_pylist()
        self._slice = s

    def next(self) -> Doc:
        while True:
            if self._slice is None:
                self._slice_start_state = self.parent.state_dict()
                self._load(next(self.parent))  # StopIteration ends the stream
                self._pos, self._skip_to = self._skip_to, 0
            if self._pos < len(self._texts):
                i = self._pos
                self._pos += 1
                text = self._texts[i]
                if text is None:
                    self._skipped += 1
                    if not self._warned:
                        self._warned = True
                        log.warning("skipping null text at %s (further nulls are counted, not logged)",
                                    self.units.where(self._slice.unit, int(self._rows[i])))
                    continue
                return Doc(text, self.source, self._slice.unit, int(self._rows[i]), self._slice.epoch)
            self._slice = None

    def get_state(self) -> Dict[str, Any]:
        if self._slice is None:
            # Between slices: the next slice starts where the sharder stands now.
            return {self.PARENT: self.parent.state_dict(), self.ROW: self._skip_to, self.SKIPPED: self._skipped}
        return {self.PARENT: self._slice_start_state, self.ROW: self._pos, self.SKIPPED: self._skipped}
