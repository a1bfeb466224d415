"""Hugging Face datasets as a source: a `datasets.Dataset`, one split of a `DatasetDict`, or
the folder `save_to_disk` wrote, read through its Arrow files with pyarrow alone.

A Dataset on disk is a list of Arrow IPC *stream* files (``data-00000-of-00001.arrow`` ...
in a ``save_to_disk`` folder, named in its ``state.json``; ``Dataset.cache_files`` for a
loaded or mapped one), which `datasets` memory-maps. Listing (once, in the process that
builds the loader) finds the files the chosen column lives in and the rows the dataset
shows of each, following the transforms `datasets` records on its memory-mapped tables:
a contiguous ``select``/``shard`` is a row range, ``select_columns``/``remove_columns``/
``rename_column`` change the column's name in the file, a ``cast`` keeps its values;
``concatenate_datasets`` is a list of such pieces. Each file is memory-mapped and its
record batches listed (metadata only, zero-copy). Work units are the record batches cut
to those rows, and batches longer than `UNIT_ROWS` are cut into row ranges, so a unit
holds at most ``UNIT_ROWS`` (10,000) documents. The reader is `ReadParquet` over
another container: a worker maps each file once, slices a unit (zero-copy) and copies
only the rows of its shard, in the same seeded order, with the same state, resume and
null handling. No Python row of the dataset is ever iterated.

Only file paths cross into loader workers, never the Dataset: a `SourcePlan` pickles to
its files and four integer arrays, 24 bytes a unit. Listing a ``save_to_disk`` folder or
the same Dataset object, and reading every document in one shard's order against the same
texts from parquet row groups, are measured in docs/performance.md.

Refused, with what to do instead:

- a Dataset held in memory (``Dataset.from_dict``, ``keep_in_memory=True``): it has no
  files for a worker to map, and pickling the table to every worker is what this design
  avoids; ``save_to_disk`` it and pass the folder;
- a Dataset with an indices mapping (``shuffle``, ``filter``, ``train_test_split``, a
  non-contiguous ``select``): its rows are not file ranges; ``flatten_indices()`` writes
  them out (tokenloom shuffles anyway);
- transforms that rewrite values in place (``flatten``, a table ``filter``, an added
  column from memory), and a DatasetDict without a split (the message lists the splits);
- a streaming `IterableDataset`: out of scope; the hub serves every dataset as parquet
  files (the ``refs/convert/parquet`` revision), which tokenloom reads as a parquet source.

Fingerprint: from the files, not from ``Dataset._fingerprint``: ``load_from_disk(dir)``
gets another fingerprint than the ``state.json`` in ``dir`` (its ``with_format`` is a
transform), and `datasets` draws a random one after a transform it cannot hash, which
would refuse a good resume; the files give the folder and the object the same answer.
Per file: its name relative to the files' common folder, its size, and a content key
hashing the rows read of it, its record batches' row counts and the bytes the chosen
column's values take in each (as a parquet footer's sizes do; a one-byte edit inside the
file's 8-byte padding is caught). An edit that keeps every batch's byte count (same-length
text) keeps the key, as with parquet.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from .files import FileChangedError, FileUnits, SourceFile
from .parquet import LIST, REQUIRES, TEXT, ReadParquet, column_kind

#: The format name plans and fingerprints carry.
HF = "hf"
#: Rows of a work unit at most: longer record batches are cut into row ranges.
UNIT_ROWS = 10_000
#: What `save_to_disk` writes: a Dataset folder holds the first two, a DatasetDict folder the third.
STATE_FILE, INFO_FILE, DICT_FILE = "state.json", "dataset_info.json", "dataset_dict.json"
#: Transforms of a memory-mapped table that leave the chosen column's values and rows alone.
_KEEPS = ("replace_schema_metadata", "combine_chunks")

_PARQUET_HINT = ("the hub serves every dataset as parquet files (its refs/convert/parquet revision: `huggingface-cli "
                 "download REPO --repo-type dataset --revision refs/convert/parquet --local-dir DIR`), and tokenloom "
                 "reads DIR as a parquet source; or load it without streaming=True and pass the Dataset")


def datasets_kind(obj: Any) -> Optional[str]:
    """The `datasets` class ``obj`` is ('Dataset', 'DatasetDict', 'IterableDataset', ...), else None;
    never imports `datasets` (an object of it means it is imported already)."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "datasets":
            return cls.__name__
    return None


def is_dataset_dict(obj: Any) -> bool:
    """A `DatasetDict` (a dict of splits): one source needs one split."""
    return datasets_kind(obj) in ("DatasetDict", "IterableDatasetDict")


def _is_folder(spec: Any) -> bool:
    if not isinstance(spec, (str, os.PathLike)) or "://" in os.fspath(spec):
        return False
    path = os.path.expanduser(os.fspath(spec))
    return os.path.isfile(os.path.join(path, DICT_FILE)) or (
        os.path.isfile(os.path.join(path, STATE_FILE)) and os.path.isfile(os.path.join(path, INFO_FILE)))


def is_hf_source(spec: Any) -> bool:
    """A `datasets` object, a save_to_disk folder, or a list holding one (refused when listed)."""
    if isinstance(spec, (list, tuple)):
        return any(is_hf_source(s) for s in spec)
    return datasets_kind(spec) is not None or _is_folder(spec)


@dataclass
class ArrowUnits(FileUnits):
    """The work units of a dataset: unit ``i`` is rows ``[start[i], start[i] + rows[i])`` of
    ``files[file[i]]``, whose column ``names[column[i]]`` holds the documents."""

    files: List[SourceFile]
    names: List[str]
    file: np.ndarray
    column: np.ndarray
    start: np.ndarray
    rows: np.ndarray

    def where(self, unit: int, row: Optional[int] = None) -> str:
        """A human-readable location for error messages (rows counted in the file)."""
        a = int(self.start[unit])
        loc = f"{self.path(unit)}, rows {a}-{a + int(self.rows[unit]) - 1}"
        return loc if row is None else f"{self.path(unit)}, row {a + row}"


def _map_table(path: str) -> pa.Table:
    """The whole file as a table over a memory map: no data is read until it is touched."""
    return pa.ipc.open_stream(pa.memory_map(path)).read_all()


class _Files:
    """The files of one listing, each mapped once."""

    def __init__(self, source: str):
        self.source, self.tables = source, {}

    def table(self, path: str) -> pa.Table:
        if path not in self.tables:
            try:
                self.tables[path] = _map_table(path)
            except (OSError, pa.ArrowInvalid) as e:
                raise ValueError(f"source {self.source!r}: {path} is not a readable Arrow stream file ({e}); it may "
                                 "be truncated or not written by datasets: save the dataset again "
                                 "(save_to_disk)") from e
        return self.tables[path]


# --- where the rows are ---------------------------------------------------------------

#: One piece of the dataset, in order: rows [lo, hi) of column ``column`` of file ``path``.
Segment = Tuple[str, str, int, int]


def _splits_error(name: str, what: str, splits: Sequence[str], how: str) -> ValueError:
    return ValueError(f"source {name!r} is {what} with splits {list(splits)}; a source is one split: {how}")


def _folder_segments(name: str, spec: Any, column: str, files: _Files) -> List[Segment]:
    folder = os.path.abspath(os.path.expanduser(os.fspath(spec)))
    if os.path.isfile(os.path.join(folder, DICT_FILE)):
        with open(os.path.join(folder, DICT_FILE)) as fh:
            splits = json.load(fh).get("splits", [])
        first = splits[0] if splits else "train"
        raise _splits_error(name, f"a DatasetDict folder ({folder})", splits, f"pass its folder "
                            f"({os.path.join(folder, first)!r}) or load_from_disk({folder!r})[{first!r}]")
    with open(os.path.join(folder, STATE_FILE)) as fh:
        state = json.load(fh)
    if state.get("_indices_data_files"):
        raise ValueError(f"source {name!r}: {folder} holds an indices mapping (saved by an old datasets); load it, "
                         "call flatten_indices() and save_to_disk it again")
    paths = [os.path.join(folder, d["filename"]) for d in state.get("_data_files", [])]
    if not paths:
        raise ValueError(f"source {name!r}: {os.path.join(folder, STATE_FILE)} lists no data files; save the dataset "
                         "again (save_to_disk)")
    return [(p, column, 0, files.table(p).num_rows) for p in paths]


def _follow(name: str, block: Any, column: str, files: _Files) -> Segment:
    """Where ``block`` (a `datasets` memory-mapped table) finds ``column``: replay the transforms
    it recorded on the names and row range of its file, and check the result against it."""
    path = os.path.abspath(block.path)
    table = files.table(path)
    names, origin = list(table.column_names), list(table.column_names)
    lo, n = 0, table.num_rows
    for op, args, kwargs in block.replays or []:
        if op in _KEEPS:
            continue
        params = dict(kwargs)
        if op == "slice":
            params.update(zip(("offset", "length"), args))
            offset = min(int(params.get("offset", 0)), n)
            length = params.get("length")
            n_new = n - offset if length is None else min(int(length), n - offset)
            lo, n = lo + offset, max(n_new, 0)
        elif op in ("select", "drop", "drop_columns", "rename_columns", "cast", "remove_column"):
            arg = args[0] if args else next(iter(params.values()), None)
            if op == "select":
                keep = [names[c] if isinstance(c, int) else c for c in arg]
                origin = [origin[names.index(c)] for c in keep]
                names = keep
            elif op in ("drop", "drop_columns"):
                gone = {arg} if isinstance(arg, str) else set(arg)
                origin = [o for c, o in zip(names, origin) if c not in gone]
                names = [c for c in names if c not in gone]
            elif op == "remove_column":
                del names[int(arg)], origin[int(arg)]
            elif op == "rename_columns":
                names = [arg.get(c, c) for c in names] if isinstance(arg, dict) else list(arg)
            else:  # cast: columns matched by name (datasets.table.table_cast), values kept
                by_name = dict(zip(names, origin))
                names = list(arg.names)
                origin = [by_name.get(c) for c in names]
        else:
            raise ValueError(f"source {name!r}: the dataset's column {column!r} went through {op!r}, which changes "
                             f"its rows or values in memory; tokenloom reads the files ({path}): write the result "
                             "with save_to_disk and pass that folder")
    if names != list(block.column_names) or n != block.num_rows or origin[names.index(column)] is None:
        raise ValueError(f"source {name!r}: cannot tell where column {column!r} of the dataset lives in {path} (the "
                         f"transforms recorded on it give columns {names} and {n} rows, the dataset has "
                         f"{list(block.column_names)} and {block.num_rows}); save_to_disk it and pass that folder")
    file_column = origin[names.index(column)]
    if n:  # the file's rows are the dataset's: compare both ends
        ours = table.column(file_column)
        theirs = block.column(column)
        if ours[lo].as_py() != theirs[0].as_py() or ours[lo + n - 1].as_py() != theirs[n - 1].as_py():
            raise ValueError(f"source {name!r}: column {column!r} of the dataset does not hold what {path} holds "
                             f"(column {file_column!r}, rows {lo}-{lo + n - 1}); save_to_disk it and pass that folder")
    return path, file_column, lo, lo + n


def _dataset_segments(name: str, ds: Any, column: str, files: _Files) -> List[Segment]:
    if getattr(ds, "_indices", None) is not None:
        raise ValueError(f"source {name!r}: the dataset has an indices mapping (from shuffle, filter, "
                         "train_test_split or a non-contiguous select), so its rows are not ranges of its files; "
                         "call ds.flatten_indices() first (it writes them out; tokenloom shuffles anyway)")
    if column not in ds.column_names:
        raise ValueError(f"column {column!r} not found in source {name!r} (a datasets.Dataset); it has columns "
                         f"{list(ds.column_names)}. Pass text_column= naming one of them")
    table = ds.data
    rows = table.blocks if hasattr(table, "blocks") else [[table]]
    segments = []
    for row in rows:
        block = next(b for b in row if column in b.column_names)
        if getattr(block, "path", None) is None:
            raise ValueError(f"source {name!r}: the dataset (or part of it) is held in memory (Dataset.from_dict, "
                             "keep_in_memory=True, or built from one), so loader workers have no files to read; "
                             "write it with ds.save_to_disk(DIR) and pass DIR (or datasets.load_from_disk(DIR))")
        segments.append(_follow(name, block, column, files))
    return segments


def _segments(name: str, spec: Any, column: str, files: _Files) -> List[Segment]:
    kind = datasets_kind(spec)
    if isinstance(spec, (list, tuple)):
        raise ValueError(f"source {name!r} is a list holding a Hugging Face dataset; give each dataset its own source "
                         "name ({name: dataset, ...}), or datasets.concatenate_datasets them into one")
    if kind in ("IterableDataset", "IterableDatasetDict"):
        raise ValueError(f"source {name!r} is a streaming datasets.{kind}, which tokenloom does not read: "
                         f"{_PARQUET_HINT}")
    if kind == "DatasetDict":
        splits = list(spec)
        first = splits[0] if splits else "train"
        raise _splits_error(name, "a datasets.DatasetDict", splits, f"pass one of them, dataset_dict[{first!r}]")
    if kind == "Dataset":
        return _dataset_segments(name, spec, column, files)
    if kind is not None:
        raise ValueError(f"source {name!r} is a datasets.{kind}; pass a datasets.Dataset, one split of a DatasetDict, "
                         "or a save_to_disk folder")
    return _folder_segments(name, spec, column, files)


# --- units --------------------------------------------------------------------------

def _cut(lo: int, hi: int, batch_ends: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Rows [lo, hi) as units: cut at record batch ends, pieces longer than UNIT_ROWS cut evenly."""
    inner = batch_ends[(batch_ends > lo) & (batch_ends < hi)]
    bounds = np.concatenate([[lo], inner, [hi]]).astype(np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    parts = np.maximum(-(-lengths // UNIT_ROWS), 1)
    piece = np.repeat(np.arange(len(starts)), parts)
    k = np.arange(len(piece)) - np.repeat(np.cumsum(parts) - parts, parts)  # part number within its piece
    a = starts[piece] + lengths[piece] * k // parts[piece]
    b = starts[piece] + lengths[piece] * (k + 1) // parts[piece]
    keep = b > a
    return a[keep], (b - a)[keep]


def _content_key(table: pa.Table, uses: Sequence[Tuple[str, int, int]]) -> str:
    """Rows read of the file, its batches' row counts, and the read column's buffer sizes."""
    h = hashlib.sha256(repr(list(uses)).encode())
    h.update(np.asarray([b.num_rows for b in table.to_batches()], np.int64).tobytes())
    for column in sorted({c for c, _, _ in uses}):  # bytes each batch's values take (buffers are padded)
        h.update(np.asarray([chunk.nbytes for chunk in table.column(column).chunks], np.int64).tobytes())
    return h.hexdigest()[:16]


def list_hf_units(name: str, spec: Any, column: str, *, require: Optional[str] = TEXT) -> ArrowUnits:
    """List a dataset's units (see the module docstring); ``column`` must hold ``require``
    (``"text"``; ``"list"`` for conversations; None: anything)."""
    if require not in REQUIRES:
        raise ValueError(f"{require=} must be one of {REQUIRES}")
    files = _Files(name)
    segments = _segments(name, spec, column, files)
    paths = list(OrderedDict.fromkeys(p for p, _, _, _ in segments))
    names = list(OrderedDict.fromkeys(c for _, c, _, _ in segments))
    root = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else ""
    uses: Dict[str, List[Tuple[str, int, int]]] = {p: [] for p in paths}
    f_idx, c_idx, starts, rows = [], [], [], []
    for path, col, lo, hi in segments:
        table = files.table(path)
        if col not in table.column_names:
            raise ValueError(f"column {col!r} not found in {path} (source {name!r}); it has columns "
                             f"{table.column_names}. Pass text_column= naming one of them")
        kind = column_kind(table.schema.field(col).type)
        if require is not None and kind != require and hi > lo:
            want = "text (string)" if require == TEXT else "a list (of messages)" if require == LIST else require
            raise ValueError(f"column {column!r} of source {name!r} ({path}) has type {table.schema.field(col).type}, "
                             f"not {want}; pass text_column= naming a {require} column")
        uses[path].append((col, lo, hi))
        ends = np.cumsum([b.num_rows for b in table.to_batches()], dtype=np.int64)
        a, n = _cut(lo, hi, ends)
        f_idx.append(np.full(len(a), paths.index(path), np.int32))
        c_idx.append(np.full(len(a), names.index(col), np.int32))
        starts.append(a)
        rows.append(n)
    listed = []
    for path in paths:
        st = os.stat(path)
        # mtime_ns=None: the content key stands in for it (no mtime warnings, see fingerprint.py)
        listed.append(SourceFile(path=path, size=int(st.st_size), name=os.path.relpath(path, root),
                                 fs=pafs.LocalFileSystem(), uri=path,
                                 key=_content_key(files.table(path), uses[path])))
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)  # noqa: E731
    return ArrowUnits(listed, names, cat(f_idx, np.int32), cat(c_idx, np.int32), cat(starts, np.int64),
                      cat(rows, np.int64))


# --- reading ------------------------------------------------------------------------

class ReadArrow(ReadParquet):
    """`ReadParquet` over a dataset's Arrow files: the same slices, order, state and resume;
    a unit is a zero-copy slice of a memory-mapped file.

    Args:
        parent: the `ShardUnits` node whose slices this reader reads.
        units: the dataset's `ArrowUnits` (listing): unit ``i`` is a row range of a file's column.
        column: the column's name in the dataset (``Doc.text``); each file's own name for it
            is in ``units``.
        source, seed, shuffle_rows: as `ReadParquet`. There is no ``readahead``: the files are
            memory-mapped, read synchronously.

    State keys: as `ReadParquet`: ``PARENT`` (``"parent"``: the sharder's state at the start of
    the current slice), ``ROW`` (``"row"``: rows of that slice handed out) and ``SKIPPED``
    (``"skipped"``: null rows skipped so far).
    """

    def __init__(self, parent: Any, units: ArrowUnits, *, column: str = "text", source: str = "", seed: int = 0,
                 shuffle_rows: bool = True):
        super().__init__(parent, units, column=column, source=source, seed=seed, shuffle_rows=shuffle_rows)

    def _table(self, i: int) -> pa.Table:
        self.units.files[i].open_unchanged().close()  # FileChangedError naming the file when its size moved
        return _map_table(self.units.files[i].path)

    def _read_unit(self, u: int) -> pa.Table:
        units = self.units
        table = self._open.get(int(units.file[u]), self._table)
        a, n = int(units.start[u]), int(units.rows[u])
        if a + n > table.num_rows:
            raise FileChangedError(f"{units.files[int(units.file[u])].path} has {table.num_rows} rows now, fewer than "
                                   f"the {a + n} it was listed with: the dataset changed after the loader was built; "
                                   "rebuild the loader")
        return pa.table({self.column: table.column(units.names[int(units.column[u])]).slice(a, n)})

    def _read_error(self, u: int, e: Exception) -> Exception:
        hint = ("the file is gone (deleted or moved after the loader was built)" if isinstance(e, FileNotFoundError)
                else "the Arrow file is corrupt, or changed after the loader was built")
        return RuntimeError(f"cannot read {self.units.where(u)}: {e}. {hint}; check it with datasets.load_from_disk "
                            "or pyarrow.ipc.open_stream(pyarrow.memory_map(path)).read_all(), save the dataset again, "
                            "and rebuild the loader")
