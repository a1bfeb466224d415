"""Read a source's token ids from a cache instead of its text: ``pretrain(..., cache=DIR)``.

The cache (cache_format.py, built by cache_build.py or ``tokenloom tokenize``) is a
second copy of every work unit of the source, holding token ids instead of text:
the same units, the same rows per unit in the same order, null where the text is
null. So nothing else in the graph changes: the sharder emits the same slices, and
`ReadCached` walks them with the same position logic as the text readers
(`UnitCursor`, whose state is the one `ReadParquet`, `ReadJsonl` and `ReadText` save:
``parent``, ``row``, and ``skipped`` where they count it), handing `Tokenize` a
`Pretokenized` (ids and the text's length in characters) in place of the text.
`Tokenize` only adds BOS/EOS to it, so the batches are bitwise those of tokenizing
on the fly, and a state saved by either loads into the other. The loader's
configuration (what a resume must match) does not mention the cache.

Checked when the loader is built, in the calling process: the cache must have been
built with this tokenizer (by fingerprint) from these files (per file: size, content
key, and the rows of its units); otherwise it is refused, naming the tokenizer or
the files that changed. A unit the cache lacks (a partial build, a file added since)
is read from its text and tokenized by the same reader the cache was built with:
counted per source in ``loader.stats()["sources"][name]["tokenized"]`` (documents
encoded from text), or refused up front with ``cache_strict=True``.

Cost: a unit is one parquet row group read (zstd-compressed ids) and per document a
slice of one numpy array, to which `Tokenize` adds BOS, instead of decoding and encoding
its text. benchmarks/cache.py measures the CPU of a cached batch against encoding on
tiktoken and on tokenizers (see docs/performance.md). A cache on remote storage
(``cache="s3://..."``) is read ahead as parquet sources are (readahead.py): the row groups
of the units a worker reads next are fetched in the background, within the same byte
budget; the ids are the same. It also starts as one does (cache_remote.py): its folders
are read while the sources are listed, its footers go to the workers, and the build
fetches their first row groups.
"""

from __future__ import annotations

import logging
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..base import Node
from ..items import Doc
from ..shard import ShardUnits, WorkSlice
from ..tokenize import Pretokenized
from ..tokenizer import Encoder
from .cache_build import build_cache  # noqa: F401  (the Python entry of `tokenloom tokenize`)
from .cache_format import (K_CACHE, K_CACHE_BYTES, K_DTYPE, K_KEY, K_SIZE, K_TOKENIZER, K_UNITS, UnitTexts,
                           cache_files, dtype_for, file_entry, file_units, header, header_conflict, matches, merged_files,
                           has_parts, open_root, read_chars, read_ids, read_parts)
from .cache_remote import CacheRead, read_cache, ship_footers
from .files import OpenFiles, SourceFile, process_fs
from .first_fetches import FirstFetches
from .readahead import RowGroupReadAhead, budget_for
from .readers import SourcePlan
from .text_files import CursorReader, SkipCount, UnitCursor

log = logging.getLogger(__name__)

CacheSpec = Union[str, os.PathLike, Mapping[str, Union[str, os.PathLike]]]

#: Changed files named in one message at most.
SHOWN = 6


@dataclass
class UnitCache:
    """Where each unit of one source sits in its cache: unit ``u`` is row group ``group[u]``
    of ``paths[file[u]]`` (on ``fs``), or not cached when ``file[u]`` is -1; ids stored as
    ``dtype``. Picklable: it travels to the loader workers with the source's plan."""

    fs: pafs.FileSystem
    shown: str
    paths: List[str]
    sizes: List[int]
    file: np.ndarray
    group: np.ndarray
    dtype: str
    #: The units' rows (the source's), for the sharders that plan the first fetches (first_fetches.py).
    rows: Optional[np.ndarray] = None
    #: Each cache file's footer as the build read it (a remote cache, cache_remote.py; ``b""``: not kept).
    footers: Optional[List[bytes]] = None
    #: The cache files as the build opened them (by index), until the first fetches used them; never pickled.
    handles: Optional[Dict[int, Any]] = field(default=None, compare=False, repr=False)
    #: The row groups the loader's workers read first, fetched by the process that built it.
    first: Optional[FirstFetches] = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "handles": None}

    @property
    def row_group(self) -> np.ndarray:
        """Unit ``u``'s row group in its cache file (the name first_fetches.py reads units by)."""
        return self.group

    @property
    def files(self) -> List[SourceFile]:
        """The cache files as `SourceFile` s (what first_fetches.py asks of a unit's file)."""
        return [SourceFile(p, n, p, self.fs) for p, n in zip(self.paths, self.sizes)]


@dataclass
class CachedPlan(SourcePlan):
    """A `SourcePlan` whose reader takes ids from a cache (rows in file order still read text:
    that is what the cache is built from, and the fallback for a unit it lacks)."""

    cache: Optional[UnitCache] = None

    def fetched(self) -> Tuple[Any, Optional[str]]:
        """The cache's files, every column (`SourcePlan.fetched`); a unit the cache lacks is read as text,
        and not fetched first."""
        return (self.cache, None) if self.cache is not None else super().fetched()

    def reader(self, shard: ShardUnits, *, seed: int, shuffle_rows: bool = True) -> Node[Doc]:
        if not shuffle_rows or self.cache is None:
            return super().reader(shard, seed=seed, shuffle_rows=shuffle_rows)
        cls = ReadCachedText if self.fmt == "txt" else ReadCached
        return cls(shard, self, self.cache, seed=seed)


class ReadCached(CursorReader, SkipCount, Node[Doc]):
    """Reads the documents of the slices a `ShardUnits` node emits from a token cache, as
    `Pretokenized` ids; a unit the cache lacks is read as text (see the module docstring).
    Null rows are skipped and counted, as the text readers do.

    Args:
        parent: the `ShardUnits` node whose slices (a unit, an epoch, a range of the unit's row
            order) this reader reads.
        plan: the source's `SourcePlan`: its units, its name (``Doc.source``) and the reader a unit
            the cache lacks is read through (its text, which `Tokenize` then encodes).
        cache: the `UnitCache` `attach_cache` matched: where each unit sits in the cache files
            (cache file and row group, or not cached), and the ids' dtype.
        seed: seeds the row permutation per (epoch, unit), as the text readers' ``seed`` does, so
            the rows come in the order tokenizing on the fly reads them.

    State keys: ``PARENT`` (the sharder's state at the start of the current slice), ``ROW`` (rows
    of that slice handed out, skipped ones included; a restore reloads the slice and skips them)
    and ``SKIPPED`` (null rows skipped so far). The state of `ReadParquet` and `ReadJsonl`, so a
    state saved reading the text loads reading the cache, and back.
    """

    PARENT = "parent"
    ROW = "row"
    SKIPPED = "skipped"
    STATE_KEYS = (PARENT, ROW, SKIPPED)

    #: Open cache files kept per worker; reopening costs a footer read.
    OPEN_FILES = 8

    def __init__(self, parent: ShardUnits, plan: SourcePlan, cache: UnitCache, *, seed: int = 0):
        super().__init__(parent)
        self.plan, self.units, self.cache, self.source = plan, plan.units, cache, plan.name
        # the plan's read windows (row_windows.py): the rows come in the order the text reader reads them
        self._cursor = UnitCursor(parent, self._load, seed=seed, shuffle_rows=True, windows=plan.windows)
        self._open = OpenFiles(self.OPEN_FILES)
        self._texts: Optional[UnitTexts] = None  # made for the first unit the cache lacks
        self._unit = -1  # the unit loaded: the same unit again (a restore, an elastic prefix) is not re-read
        self._values = np.empty(0, np.uint16)
        self._offsets: List[int] = []
        self._chars: List[int] = []
        self._valid: Optional[np.ndarray] = None
        self._docs: Optional[List[Optional[str]]] = None  # the unit's texts when it is not cached
        self._skipped = 0
        self._warned = False
        self._ahead: Any = None  # RowGroupReadAhead, made at the first reset; False: off

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is None:
            self._cursor.reset(None, 0)
            self._skipped = 0
        else:
            self._cursor.reset(initial_state[self.PARENT], initial_state[self.ROW])
            self._skipped = int(initial_state.get(self.SKIPPED, 0))
        ahead = self._read_ahead()
        if ahead is not None:
            ahead.restart()

    def _handle(self, k: int) -> Any:
        c = self.cache
        handle = process_fs(c.fs).open_input_file(c.paths[k])
        if handle.size() != c.sizes[k]:
            handle.close()
            raise RuntimeError(f"cache file {c.paths[k]} is {handle.size()} bytes, its manifest says {c.sizes[k]}: "
                               "it changed after the loader was built; rebuild the loader")
        return handle

    def _parquet(self, k: int) -> pq.ParquetFile:
        return pq.ParquetFile(self._handle(k))

    def _read_ahead(self) -> Optional[RowGroupReadAhead]:
        """The cache files' read-ahead (readahead.py: on for a cache on remote storage), or None."""
        if self._ahead is None:
            budget = budget_for([self.cache.fs]) if hasattr(self._cursor.parent, "ahead") else 0
            self._ahead = RowGroupReadAhead(self._handle, self._upcoming, budget=budget, columns=None,
                                            checksums=False, name=self.source, footers=self.cache.footers,
                                            first=self.cache.first) if budget else False
        return self._ahead or None

    def _upcoming(self) -> Iterator[Optional[Tuple[int, int]]]:
        """``(cache file, row group)`` of the units loaded next (None: a unit the cache lacks)."""
        file, group = self.cache.file, self.cache.group
        return ((int(file[s.unit]), int(group[s.unit])) if file[s.unit] >= 0 else None
                for s in self._cursor.parent.ahead())

    def readahead_stats(self) -> Optional[Dict[str, Any]]:
        """What the read-ahead fetched and how long the reader waited for it (None: reading synchronously)."""
        ahead = self._ahead or None
        return None if ahead is None else ahead.stats()

    def _load(self, s: WorkSlice) -> int:
        u = s.unit
        n = int(self.units.rows[u])
        if u == self._unit:
            return n
        k = int(self.cache.file[u])
        if k < 0:
            if self._texts is None:
                self._texts = UnitTexts(self.plan)
            self._docs = self._texts(u)
        else:
            self._docs = None
            path, g = self.cache.paths[k], int(self.cache.group[u])
            try:
                ahead = self._ahead or None
                if ahead is not None:
                    table = ahead.read((k, g))
                else:  # use_threads=False: the loader workers are the parallelism
                    table = self._open.get(k, self._parquet).read_row_group(g, use_threads=False)
                self._values, offsets, self._valid = read_ids(table.column(0), self.cache.dtype)
                chars = read_chars(table.column(1))
            except RuntimeError:
                raise
            except Exception as e:
                raise RuntimeError(f"cannot read cache file {path}, row group {g} (unit {u}, {self.units.where(u)}): "
                                   f"{e}; rebuild the cache (tokenloom tokenize) or load without cache=") from e
            if table.num_rows != n:
                raise RuntimeError(f"cache file {path}, row group {g} has {table.num_rows} rows, unit {u} "
                                   f"({self.units.where(u)}) has {n}: the cache is not of these files; rebuild it")
            self._offsets = offsets.tolist()
            self._chars = chars.tolist()
        self._unit = u
        return n

    def _skip(self, u: int, row: int) -> None:
        self._skipped += 1
        if not self._warned:
            self._warned = True
            log.warning("skipping null text at %s (further nulls are counted, not logged)", self.units.where(u, row))

    def next(self) -> Doc:
        while True:
            s, row = self._cursor.next()
            if self._docs is None:
                if self._valid is not None and not self._valid[row]:
                    self._skip(s.unit, row)
                    continue
                text: Any = Pretokenized(self._values[self._offsets[row]:self._offsets[row + 1]], self._chars[row])
            else:
                text = self._docs[row]
                if text is None:
                    self._skip(s.unit, row)
                    continue
            return Doc(text, self.source, s.unit, row, s.epoch, self._cursor.last_pos(), s.used)

    def get_state(self) -> Dict[str, Any]:
        parent, row = self._cursor.position()
        return {self.PARENT: parent, self.ROW: row, self.SKIPPED: self._skipped}


class ReadCachedText(ReadCached):
    """`ReadCached` for text-file sources: `ReadText`'s state (it never skips a row).

    Args:
        parent, plan, cache, seed: as `ReadCached`.

    State keys: ``PARENT`` (``"parent"``: the sharder's state at the start of the current slice)
    and ``ROW`` (``"row"``: rows of that slice handed out), as `ReadCached`, without ``SKIPPED``:
    the state of `ReadText`, so a state saved reading the text loads reading the cache, and back.
    """

    STATE_KEYS = (ReadCached.PARENT, ReadCached.ROW)

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        ReadCached.reset.__wrapped__(self, initial_state)  # the keys were checked against this class's

    def get_state(self) -> Dict[str, Any]:
        parent, row = self._cursor.position()
        return {self.PARENT: parent, self.ROW: row}


# --- attaching a cache to a loader's sources -----------------------------------------------

def _roots(cache: CacheSpec, names: List[str]) -> Dict[str, str]:
    if isinstance(cache, Mapping):
        unknown = sorted(set(cache) - set(names))
        if unknown:
            raise ValueError(f"cache= names unknown sources {unknown}; the sources are {names}")
        return {n: os.fspath(d) for n, d in cache.items()}
    if not isinstance(cache, (str, os.PathLike)):
        raise ValueError(f"cache={cache!r:.80} must be the directory `tokenloom tokenize --out` wrote (a path or URI), "
                         "or {source name: directory}")
    return {n: os.fspath(cache) for n in names}


def _change(name: str, old: Dict[str, Any], new: Dict[str, Any]) -> str:
    if old.get(K_SIZE) != new[K_SIZE]:
        return f"{name} resized ({old.get(K_SIZE):,} -> {new[K_SIZE]:,} bytes)"
    if old.get(K_KEY) != new[K_KEY]:
        return f"{name} rewritten (same size, another parquet footer)"
    return f"{name} listed as other units now ({len(old.get(K_UNITS, []))} units then, {len(new[K_UNITS])} now)"


def _attach_one(plan: SourcePlan, read: CacheRead, encoder: Encoder, strict: bool) -> SourcePlan:
    fs, folder, shown = read.fs, read.folder, read.shown
    where = f"{shown}/{plan.name}"
    build = f"tokenloom tokenize {plan.name}=<its files> --tokenizer <tokenizer> --out {shown}"
    parts = read_parts(fs, folder, where, read.infos) if read.parts is None else _raised(read.parts)
    if not parts:
        if strict:
            raise ValueError(f"cache_strict=True, but {where} holds no token cache of source {plan.name!r} (no "
                             f"manifest-*.json): build it with `{build}` (the same source names as the loader's)")
        warnings.warn(f"source {plan.name!r}: {where} holds no token cache (no manifest-*.json), so every document is "
                      f"tokenized on the fly; build it with `{build}`", stacklevel=4)
        return plan
    want = header(plan, encoder.fingerprint, dtype_for(encoder.vocab_size))
    conflict = header_conflict(parts, want)
    if conflict is not None:
        key, value = conflict
        if key == K_TOKENIZER:
            raise ValueError(f"the token cache {where} was built with another tokenizer (fingerprint {value}); this "
                             f"loader's tokenizer is {want[key]} ({encoder.origin or 'as given'}): pass the tokenizer "
                             f"the cache was built with, or build a cache for this one (`{build}`, another --out)")
        raise ValueError(f"the token cache {where} was built with {key} {value!r}, this loader reads {want[key]!r}: "
                         f"build one for these settings (`{build}`, another --out), or leave cache= out")
    entries = merged_files(parts)
    present = cache_files(fs, folder) if read.present is None else _raised(read.present)
    n_units = len(plan.units.rows)
    file_of, group_of = np.full(n_units, -1, np.int32), np.zeros(n_units, np.int32)
    names: List[str] = []  # the cache files, relative to the folder
    paths: List[str] = []
    sizes: List[int] = []
    changed: List[str] = []
    missing: List[str] = []
    for i, units in sorted(file_units(plan).items()):
        f = plan.units.files[i]
        wanted = file_entry(plan, i, units)
        found = entries.get(f.name, [])
        entry = next((e for e in found if matches(e, wanted)), None)
        if entry is None:
            (changed.append(_change(f.name, found[-1], wanted)) if found else missing.append(f.name))
            continue
        if present.get(entry[K_CACHE]) != entry.get(K_CACHE_BYTES):
            missing.append(f"{f.name} (its cache file {entry[K_CACHE]} is gone or of another size)")
            continue
        file_of[units] = len(paths)
        group_of[units] = np.arange(len(units))
        names.append(entry[K_CACHE])
        paths.append(f"{folder}/{entry[K_CACHE]}")
        sizes.append(int(entry[K_CACHE_BYTES]))
    if changed:
        more = f"; and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
        raise ValueError(f"source {plan.name!r}: the token cache {where} was built from other contents of "
                         f"{'; '.join(changed[:SHOWN])}{more}. Build it again (`{build}`: only the changed files are "
                         "redone), or leave cache= out")
    if missing:
        rows = int(plan.units.rows[file_of < 0].sum())
        what = (f"{len(missing)} of {len(plan.units.files)} files ({rows:,} of {plan.total_rows:,} rows) are not in "
                f"the token cache {where}: {'; '.join(missing[:SHOWN])}{' ...' if len(missing) > SHOWN else ''}")
        if strict:
            raise ValueError(f"source {plan.name!r}: cache_strict=True, but {what}. Finish the cache (`{build}` "
                             "resumes where it stopped), or pass cache_strict=False to tokenize them on the fly")
        warnings.warn(f"source {plan.name!r}: {what}; they are tokenized on the fly (counted in "
                      f"loader.stats()['sources'][{plan.name!r}]['tokenized'])", stacklevel=4)
    values = {f.name: getattr(plan, f.name) for f in fields(SourcePlan)}
    footers, handles = ship_footers(read, names)
    return CachedPlan(**values, cache=UnitCache(fs, where, paths, sizes, file_of, group_of, want[K_DTYPE],
                                                rows=plan.units.rows, footers=footers, handles=handles))


def _raised(value: Any) -> Any:
    if isinstance(value, Exception):
        raise value
    return value


def start_cache_reads(cache: Any, names: List[str]) -> Dict[str, "Future[CacheRead]"]:
    """Start reading the folders of a remote ``cache`` (cache_remote.py's `read_cache`), a thread per
    source, for `attach_cache` to match later: called before the sources are listed, so the two run at
    once. Local caches, and a ``cache=`` that is not a directory, are left to `attach_cache`."""
    try:
        roots = _roots(cache, names)
    except ValueError:
        return {}  # attach_cache says what is wrong with it, where it did before
    remote = {n: spec for n, spec in roots.items() if "://" in spec and not spec.startswith("file://")}
    if not remote:
        return {}
    pool = ThreadPoolExecutor(len(remote), thread_name_prefix="tokenloom-cache")
    try:
        return {n: pool.submit(read_cache, spec, n) for n, spec in remote.items()}
    finally:
        pool.shutdown(wait=False)


def close_cache_reads(reads: Mapping[str, "Future[CacheRead]"]) -> None:
    """Close the files `start_cache_reads`' reads opened, once each read ends (a build that failed before
    `attach_cache` matched them)."""
    def close(fut: "Future[CacheRead]") -> None:
        if fut.exception() is None:
            fut.result().close()

    for fut in reads.values():
        fut.add_done_callback(close)


def attach_cache(plans: List[SourcePlan], cache: CacheSpec, encoder: Encoder, *,
                 strict: bool = False, reads: Optional[Mapping[str, "Future[CacheRead]"]] = None) -> List[SourcePlan]:
    """``plans`` with readers that take ids from ``cache`` (a directory holding one folder per
    source name, or ``{name: directory}`` for some sources), checked against the tokenizer and
    the files; see the module docstring. ``reads``: the folders `start_cache_reads` is reading."""
    roots = _roots(cache, [p.name for p in plans])
    reads = reads or {}
    got: Dict[str, CacheRead] = {}
    try:
        for n in roots:
            got[n] = reads[n].result() if n in reads else read_cache(roots[n], n)
        return _attach(plans, cache, roots, got, encoder, strict)
    except BaseException:  # close the files the reads opened (those still reading, once they end)
        for read in got.values():
            read.close()
        close_cache_reads({n: fut for n, fut in reads.items() if n not in got})
        raise


def _attach(plans: List[SourcePlan], cache: CacheSpec, roots: Dict[str, str], got: Dict[str, CacheRead],
            encoder: Encoder, strict: bool) -> List[SourcePlan]:
    if roots and not any(got[n].has_parts() for n in roots):
        # A cache under other source names would only warn per source and then tokenize everything.
        held = sorted({name for spec in set(roots.values()) for name in _held(spec)})
        where = ", ".join(sorted(set(roots.values())))
        raise ValueError(f"cache={cache!r:.120} holds no token cache of any source of this loader {sorted(roots)} "
                         f"(it holds {held if held else 'none at all'}): the cache keeps one folder per source name, "
                         f"so build and train with the same names (`tokenloom tokenize name=<files> ... --out "
                         f"{where}`), or leave cache= out to tokenize on the fly")
    return [_attach_one(p, got[p.name], encoder, strict) if p.name in roots else p for p in plans]


def _held(spec: str) -> List[str]:
    """The source names ``spec`` holds a cache of."""
    fs, root, _ = open_root(spec)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return [os.path.basename(i.path) for i in infos
            if i.type == pafs.FileType.Directory and has_parts(fs, i.path)]
