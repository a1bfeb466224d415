"""The token cache on disk: where its files go, its manifest, and a unit's documents in file order.

A cache is a directory (local or any ``pyarrow.fs`` URI) with one folder per source
name, ``<cache>/<source>/``, holding:

- ``tokens/<id>.parquet``: one file per source file, one row group per work unit of
  that file (in the listing's order), one row per row of the unit (file order), with
  two columns: ``ids`` (``binary``: the document's ids as little-endian ``uint16``
  when the vocabulary fits, else ``uint32``, the manifest's ``dtype``; null where the
  reader skips the row: a null text) and ``chars`` (``uint32``, the text's length in
  characters). zstd-compressed. ``<id>`` hashes the source file's name, size and
  content key, so a rewritten file gets a new cache file. `read_ids` decodes a row
  group's ``ids`` into one numpy array and offsets.
- ``manifest-<rank>-of-<world>.json``: what one builder finished: the tokenizer's
  fingerprint, the source's format, column and text mode, and per source file its
  size, content key, the rows of each of its units and its cache file. Each builder
  (a rank of a cluster job) writes only its own, so ranks never race on one file;
  readers merge them all.

Why bytes, not ``list<uint16>``: parquet decodes a list column value by value, through
its repetition and definition levels; a binary column is a length and a copy per row.
So a row group of ``binary`` ids reads faster than one of ``list<uint16>``, and its file
is smaller; ``ids`` carries no min/max statistics, which say nothing of token bytes.
Reading ids is part of a cached batch's CPU in a loader worker (figures in
docs/performance.md).

Ids are raw: no BOS/EOS (the loader adds them, so one cache serves any ``bos=``/``eos=``).
Nothing is half-written: a cache file and a manifest are written under a temporary
name and then moved into place, and a cache file counts only once a manifest lists it.

The documents of a unit are read by the source's own reader (`SourcePlan.reader` with
rows in file order), so the cache holds what tokenizing on the fly reads, nulls and
skipped rows included; the loader's fallback for a unit missing from the cache reads
through the same function.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from ..shard import WorkSlice
from .files import SourceFile, _redact
from .from_uri import filesystem_from_uri
from .listing_at_once import LIST_THREADS
from .memory import FromList
from .readers import SourcePlan

FORMAT, VERSION = "tokenloom.cache", 2  # 2: ids as binary (1: list<uint>)
TOKENS_DIR = "tokens"
IDS, CHARS = "ids", "chars"
_PART = re.compile(r"^manifest-(\d+)-of-(\d+)\.json$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]*$")

# Manifest keys: the header every part of a source shares, then the per-file entries.
K_FORMAT, K_VERSION, K_SOURCE, K_FILES = "format", "version", "source", "files"
K_SOURCE_FORMAT, K_COLUMN, K_TEXT_MODE = "source_format", "column", "text_mode"
K_TOKENIZER, K_DTYPE = "tokenizer", "dtype"
HEADER = (K_SOURCE_FORMAT, K_COLUMN, K_TEXT_MODE, K_TOKENIZER, K_DTYPE)
K_SIZE, K_KEY, K_UNITS, K_CACHE, K_CACHE_BYTES, K_DOCUMENTS, K_TOKENS = (
    "size", "key", "units", "cache", "cache_bytes", "documents", "tokens")


def open_root(spec: str) -> Tuple[pafs.FileSystem, str, str]:
    """(filesystem, path on it, how to show it) of a cache directory given as a path or URI."""
    spec = os.fspath(spec)
    if "://" in spec:
        fs, path = filesystem_from_uri(spec)
        return fs, path.rstrip("/"), _redact(spec.split("?", 1)[0], spec)
    path = os.path.abspath(os.path.expanduser(spec))
    return pafs.LocalFileSystem(), path, path


def source_dir(root: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"source name {name!r} cannot name a cache folder; use letters, digits, '_', '.', '-'")
    return f"{root}/{name}"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def schema(meta: Dict[str, str]) -> pa.Schema:
    return pa.schema([(IDS, pa.binary()), (CHARS, pa.uint32())], metadata=meta)


#: Parquet writer settings: no dictionary and no min/max statistics for ``ids`` (token bytes
#: repeat rarely as whole values, and their min/max helps no reader; 7% of the file).
WRITER_OPTIONS = dict(compression="zstd", use_dictionary=[CHARS], write_statistics=[CHARS])


def ids_array(values: np.ndarray, offsets: np.ndarray, valid: Optional[np.ndarray], dtype: str) -> pa.Array:
    """The ``ids`` column of one unit: row ``i`` holds ``values[offsets[i]:offsets[i + 1]]`` as
    little-endian ``dtype`` bytes, null where ``valid`` is False (``valid`` None: no nulls)."""
    item = np.dtype(dtype).newbyteorder("<")
    data = np.ascontiguousarray(values, dtype=item)
    byte_offsets = np.asarray(offsets, np.int64) * item.itemsize
    if byte_offsets[-1] >= 1 << 31:
        raise ValueError(f"{int(offsets[-1]):,} tokens of {dtype} in one unit: more than a cache row group takes "
                         "(2 GiB); write the source with smaller row groups")
    mask = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.BinaryArray.from_buffers(pa.binary(), len(byte_offsets) - 1,
                                       [mask, pa.py_buffer(byte_offsets.astype(np.int32)), pa.py_buffer(data)],
                                       null_count=-1 if valid is not None else 0)


def read_ids(column: Any, dtype: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A row group's ``ids`` column (a pyarrow array or chunked array) as ``(values, offsets,
    valid)``: row ``i``'s ids are ``values[offsets[i]:offsets[i + 1]]``, ``valid`` is None
    when no row is null. ``values`` views the column's memory (no copy)."""
    ids = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    item = np.dtype(dtype).newbyteorder("<")
    if ids.type != pa.binary():
        raise ValueError(f"its {IDS!r} column is {ids.type}, not binary: not a {FORMAT} file of version {VERSION}")
    byte_offsets = np.frombuffer(ids.buffers()[1], np.int32, len(ids) + 1, ids.offset * 4)
    if (byte_offsets % item.itemsize).any():
        raise ValueError(f"a row of its {IDS!r} column is not a whole number of {dtype} ids")
    start = int(byte_offsets[0])
    data = ids.buffers()[2]
    values = np.frombuffer(data, item, (int(byte_offsets[-1]) - start) // item.itemsize, start) if data is not None \
        else np.empty(0, item)
    offsets = (byte_offsets - start) // item.itemsize
    return values, offsets, _valid(ids)


# Arrays are read from their buffers, never with pyarrow's ``Array.to_numpy`` or ``is_valid``: the
# first ``to_numpy`` in a process imports pandas when it is installed (~330 modules, 0.2-0.45 s in a
# freshly forked loader worker, which was most of the first batch read from a cache) and ``is_valid``
# imports ``pyarrow.compute`` (~0.03 s).

def _valid(array: pa.Array) -> Optional[np.ndarray]:
    """Per row, whether it is not null (None: no row is null), from the validity bitmap."""
    if array.null_count == 0:
        return None
    bits = np.frombuffer(array.buffers()[0], np.uint8)
    return np.unpackbits(bits, bitorder="little")[array.offset:array.offset + len(array)].astype(bool)


def read_chars(column: Any) -> np.ndarray:
    """A row group's ``chars`` column (a pyarrow array or chunked array) as a ``uint32`` array
    viewing its memory."""
    chars = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if chars.type != pa.uint32():
        raise ValueError(f"its {CHARS!r} column is {chars.type}, not uint32: not a {FORMAT} file of version {VERSION}")
    if chars.null_count:
        raise ValueError(f"its {CHARS!r} column has {chars.null_count} null rows: not a {FORMAT} file")
    data = chars.buffers()[1]
    return np.frombuffer(data, np.uint32, len(chars), chars.offset * 4) if data is not None else np.empty(0, np.uint32)


def header(plan: SourcePlan, tokenizer: str, dtype: str) -> Dict[str, Any]:
    """What every part of a source's manifest must agree on (only what the format reads)."""
    return {K_SOURCE_FORMAT: plan.fmt, K_COLUMN: plan.column if plan.fmt != "txt" else None,
            K_TEXT_MODE: plan.text_mode if plan.fmt == "txt" else None, K_TOKENIZER: tokenizer, K_DTYPE: dtype}


def cache_name(f: SourceFile) -> str:
    """The cache file of source file ``f``, relative to the source's folder."""
    digest = hashlib.sha256(f"{f.name}\0{f.size}\0{f.key}".encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return f"{TOKENS_DIR}/{digest}.parquet"


def cache_files(fs: pafs.FileSystem, folder: str) -> Dict[str, int]:
    """The files under a source folder's ``tokens/`` (half-written ones too), as ``{"tokens/<name>": size}``."""
    infos = fs.get_file_info(pafs.FileSelector(f"{folder}/{TOKENS_DIR}", allow_not_found=True))
    return {f"{TOKENS_DIR}/{os.path.basename(i.path)}": int(i.size) for i in infos if i.type == pafs.FileType.File}


def file_units(plan: SourcePlan) -> Dict[int, np.ndarray]:
    """Per file index, its units in listing order (the cache's row groups, in that order)."""
    file_of = np.asarray(plan.units.file)
    order = np.argsort(file_of, kind="stable")
    starts = np.flatnonzero(np.r_[True, file_of[order][1:] != file_of[order][:-1]]) if len(order) else []
    out: Dict[int, np.ndarray] = {}
    for a, b in zip(list(starts), list(starts[1:]) + [len(order)]):
        out[int(file_of[order[a]])] = order[a:b]
    return out


def file_entry(plan: SourcePlan, i: int, units: np.ndarray) -> Dict[str, Any]:
    """The manifest's record of file ``i`` before its cache is written (what a match needs)."""
    f = plan.units.files[i]
    return {K_SIZE: int(f.size), K_KEY: f.key, K_UNITS: [int(plan.units.rows[u]) for u in units],
            K_CACHE: cache_name(f)}


def matches(entry: Dict[str, Any], want: Dict[str, Any]) -> bool:
    return all(entry.get(k) == want[k] for k in (K_SIZE, K_KEY, K_UNITS, K_CACHE))


# --- manifests -----------------------------------------------------------------------

def part_name(rank: int, world_size: int) -> str:
    return f"manifest-{rank:05d}-of-{world_size:05d}.json"


def list_folder(fs: pafs.FileSystem, folder: str) -> List[pafs.FileInfo]:
    """What ``folder`` holds (nothing when it does not exist): one listing, a round trip on a remote store."""
    return fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))


def has_parts(fs: pafs.FileSystem, folder: str, infos: Optional[List[pafs.FileInfo]] = None) -> bool:
    """Whether ``folder`` (listed as ``infos``, else listed now) holds a finished manifest part (without
    reading it)."""
    infos = list_folder(fs, folder) if infos is None else infos
    return any(i.type == pafs.FileType.File and _PART.match(os.path.basename(i.path)) for i in infos)


def read_parts(fs: pafs.FileSystem, folder: str, shown: str,
               infos: Optional[List[pafs.FileInfo]] = None) -> List[Dict[str, Any]]:
    """Every manifest part in ``folder`` (listed as ``infos``, else listed now; none: nothing was
    finished there)."""
    infos = list_folder(fs, folder) if infos is None else infos
    named = [i for i in sorted(infos, key=lambda i: i.path)
             if i.type == pafs.FileType.File and _PART.match(os.path.basename(i.path))]
    parts = []
    for info, raw in zip(named, _read_all(fs, [i.path for i in named])):
        if isinstance(raw, Exception):
            raise raw
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{shown}/{os.path.basename(info.path)} is not valid JSON ({e}); delete it and build the "
                             "cache again (the files it listed are rebuilt)") from e
        if not isinstance(doc, dict) or doc.get(K_FORMAT) != FORMAT or doc.get(K_VERSION) != VERSION:
            found = (doc.get(K_FORMAT), doc.get(K_VERSION)) if isinstance(doc, dict) else None
            raise ValueError(f"{shown}/{os.path.basename(info.path)} is not a {FORMAT} manifest of version {VERSION} "
                             f"(format and version {found!r}); build the cache again with this tokenloom into an "
                             "empty directory")
        parts.append(doc)
    return parts


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.read()


def _read_all(fs: pafs.FileSystem, paths: List[str]) -> List[Any]:
    """Each file's bytes, or the exception reading it raised, in order. On a remote store they are read
    at once: a cache built by 64 ranks has 64 manifest parts, two round trips each (an open, a read)."""
    def one(p: str) -> Any:
        try:
            return _read(fs, p)
        except Exception as e:  # noqa: BLE001 - raised in order by the caller
            return e

    if len(paths) < 2 or fs.type_name == "local":
        return [one(p) for p in paths]
    with ThreadPoolExecutor(min(LIST_THREADS, len(paths)), thread_name_prefix="tokenloom-manifests") as pool:
        return list(pool.map(one, paths))


def merged_files(parts: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Per source file name, every entry the parts hold (a file rebuilt after a change has several)."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for part in parts:
        for name, entry in part[K_FILES].items():
            out.setdefault(name, []).append(entry)
    return out


def header_conflict(parts: List[Dict[str, Any]], want: Dict[str, Any]) -> Optional[Tuple[str, Any]]:
    """The first header key (and its value in the cache) on which a part differs from ``want``."""
    for part in parts:
        for k in HEADER:
            if part.get(k) != want[k]:
                return k, part.get(k)
    return None


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """``data`` to ``path``, written aside then moved, so no reader sees half of it."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    with fs.open_output_stream(tmp) as stream:
        stream.write(data)
    fs.move(tmp, path)


# --- a unit's documents ----------------------------------------------------------------

class UnitTexts:
    """``texts(u)``: the documents of unit ``u`` in file order, None where the source's reader
    skips the row (a null text), read by that very reader with rows in file order."""

    def __init__(self, plan: SourcePlan):
        self.plan = plan
        self._slice: List[Optional[WorkSlice]] = [None]  # the sharder's stand-in emits this one slice
        self._reader = plan.reader(FromList(self._slice), seed=0, shuffle_rows=False)  # type: ignore[arg-type]

    def __call__(self, u: int) -> List[Optional[str]]:
        n = int(self.plan.units.rows[u])
        self._slice[0] = WorkSlice(0, int(u), 0, n)
        self._reader.reset(None)
        out: List[Optional[str]] = [None] * n
        while True:
            try:
                doc = next(self._reader)
            except StopIteration:
                return out
            out[doc.row] = doc.text
