"""Build a token cache (`tokenloom tokenize`): every unit of every source file tokenized once.

Algorithm: list the sources exactly as ``pretrain`` does (same units), split their
files over the ranks of the job (largest first, each to the least loaded rank, by
rows; the same split on every rank, whatever each has already done), and on this
rank hand the units of its unfinished files, in order, to a pool of processes that
read each unit through the source's own reader (rows in file order) and encode it
in chunks of ``ENCODE_DOCS`` (256) documents. The parent writes the units of one file as the row
groups of one parquet file, in order, under a temporary name; when the file's last
unit is in, it moves the file into place and then records it in this rank's
manifest part (also written aside and moved). A build killed at any point leaves
whole cache files only (a temporary one is deleted by the next build of that
rank), and the next build skips every file a manifest lists with a cache file of
the recorded size: it resumes at file granularity.

Trade-off: a file is the unit of resumption and of the split over ranks, because one
parquet file has one writer. A corpus of few huge files resumes in big steps and
spreads over few ranks; within one machine its units are still encoded in parallel.

Ids are stored raw, as uint16 when the vocabulary has at most 65,536 ids, else
uint32; BOS/EOS are added by the loader. benchmarks/cache.py measures a build on
tiktoken and on tokenizers against an epoch of ``pretrain`` on the fly (see
docs/performance.md).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..check_args import per_source as setting_per_source
from ..tokenizer_threads import single_thread_tokenizers
from ..tokenizer import Encoder, load_encoder
from .cache_format import (FORMAT, K_CACHE, K_CACHE_BYTES, K_DOCUMENTS, K_FILES, K_FORMAT, K_SOURCE,
                           K_TOKENS, K_VERSION, VERSION, WRITER_OPTIONS, UnitTexts, cache_files, dtype_for, file_entry,
                           file_units, header, header_conflict, ids_array, matches, merged_files, open_root, part_name,
                           read_parts, schema, source_dir, write_atomic)
from .files import SourceSpec
from .readers import SourcePlan, named_sources, plan_source

#: Documents per encode call in a build process (bounds its memory, not its speed).
ENCODE_DOCS = 256

Progress = Callable[[Dict[str, Any]], None]


def rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """As given, else torchrun's ``RANK`` / ``WORLD_SIZE``, else (0, 1)."""
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    rank = int(env_rank) if rank is None and env_rank is not None else (0 if rank is None else int(rank))
    world_size = (int(env_world) if world_size is None and env_world is not None
                  else (1 if world_size is None else int(world_size)))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{rank=} must be in [0, {world_size=}); pass --rank and --world-size (or RANK and "
                         "WORLD_SIZE, as torchrun sets them)")
    return rank, world_size


def assign(rows: Sequence[int], world_size: int) -> List[int]:
    """The rank of each file: largest first to the least loaded rank (ties: lower index)."""
    load = [0] * world_size
    out = [0] * len(rows)
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + rows[i]
    return out


# --- the build processes --------------------------------------------------------------

_WORK: Dict[str, Any] = {}


def _init(plans: List[SourcePlan], encoder: Encoder, dtype: str) -> None:
    single_thread_tokenizers()  # the processes are the parallelism (pipes/tokenizer_threads.py)
    _WORK.update(plans=plans, encoder=encoder, dtype=dtype, texts={})


def _encode_unit(task: Tuple[int, int]) -> Tuple[int, int, np.ndarray, np.ndarray, Optional[np.ndarray], np.ndarray]:
    """(source, unit, ids, offsets, valid or None, chars) of one unit, rows in file order."""
    si, u = task
    texts_of = _WORK["texts"].get(si)
    if texts_of is None:
        texts_of = _WORK["texts"][si] = UnitTexts(_WORK["plans"][si])
    texts = texts_of(u)
    present = [t for t in texts if t is not None]
    encoder: Encoder = _WORK["encoder"]
    ids: List[np.ndarray] = []
    for a in range(0, len(present), ENCODE_DOCS):
        ids += encoder.encode_batch(present[a:a + ENCODE_DOCS])
    valid = np.fromiter((t is not None for t in texts), bool, len(texts))
    lengths = np.zeros(len(texts), np.int64)
    lengths[valid] = [len(x) for x in ids]
    values = np.concatenate(ids) if ids else np.empty(0, np.int32)
    dtype = np.dtype(_WORK["dtype"])
    if values.size and int(values.max()) > np.iinfo(dtype).max:
        raise ValueError(f"token id {int(values.max())} does not fit {dtype} (vocab_size {encoder.vocab_size}); "
                         "the tokenizer reports fewer ids than it produces")
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] * dtype.itemsize >= 1 << 31:
        raise ValueError(f"unit {u} of source {_WORK['plans'][si].name!r} holds {int(offsets[-1]):,} tokens, more "
                         "than one cache row group takes (2 GiB of ids); write the source with smaller row groups")
    chars = np.fromiter((len(t) if t is not None else 0 for t in texts), np.uint32, len(texts))
    return si, u, values.astype(dtype), offsets, None if valid.all() else valid, chars


def _unit_table(values: np.ndarray, offsets: np.ndarray, valid: Optional[np.ndarray], chars: np.ndarray,
                sch: pa.Schema, dtype: str) -> pa.Table:
    return pa.Table.from_arrays([ids_array(values, offsets, valid, dtype), pa.array(chars, pa.uint32())], schema=sch)


# --- the parent: plan, write, record ----------------------------------------------------

class _Source:
    """One source's folder, header and manifest part as this rank builds it."""

    def __init__(self, plan: SourcePlan, fs: pafs.FileSystem, root: str, shown: str, encoder: Encoder, dtype: str,
                 rank: int, world_size: int):
        self.plan, self.fs, self.dtype = plan, fs, dtype
        self.folder = source_dir(root, plan.name)
        self.shown = f"{shown}/{plan.name}"
        self.header = header(plan, encoder.fingerprint, dtype)
        self.part_path = f"{self.folder}/{part_name(rank, world_size)}"
        self.part = {K_FORMAT: FORMAT, K_VERSION: VERSION, K_SOURCE: plan.name, **self.header, K_FILES: {},
                     "rank": rank, "world_size": world_size}
        parts = self.scan()
        for p in parts:  # this rank's own earlier part (same rank and world size) is continued
            if p.get("rank") == rank and p.get("world_size") == world_size:
                self.part[K_FILES].update(p[K_FILES])
        self.tmp_prefix = f".tmp-r{rank}-of-{world_size}-"
        for name in self.present:  # what this rank's killed build left half-written
            if self.tmp_prefix in name:
                fs.delete_file(f"{self.folder}/{name}")
        # Written at once, listing no file yet: a loader then sees a cache that lacks files (not none at all),
        # and another build into this folder with other settings is refused from now on.
        fs.create_dir(self.folder, recursive=True)
        self.write_part()

    def scan(self) -> List[Dict[str, Any]]:
        """Read the manifest parts and the cache files present; returns the parts."""
        parts = read_parts(self.fs, self.folder, self.shown)
        conflict = header_conflict(parts, self.header)
        if conflict is not None:
            key, value = conflict
            raise ValueError(f"{self.shown} holds a cache built with {key} {value!r}, this build has "
                             f"{self.header[key]!r}; write this one to another --out (or delete that folder)")
        self.done = merged_files(parts)
        self.present = cache_files(self.fs, self.folder)
        return parts

    def is_done(self, i: int, want: Dict[str, Any]) -> bool:
        f = self.plan.units.files[i]
        return any(matches(e, want) and self.present.get(e[K_CACHE]) == e.get(K_CACHE_BYTES)
                   for e in self.done.get(f.name, []))

    def record(self, i: int, entry: Dict[str, Any]) -> None:
        self.part[K_FILES][self.plan.units.files[i].name] = entry
        self.write_part()

    def write_part(self) -> None:
        write_atomic(self.fs, self.part_path, json.dumps(self.part, separators=(",", ":")).encode())


class _FileWriter:
    """The cache file of one source file, written aside and moved into place when whole."""

    def __init__(self, src: _Source, i: int, units: np.ndarray):
        self.src, self.i, self.units = src, i, units
        self.entry = file_entry(src.plan, i, units)
        self.final = f"{src.folder}/{self.entry[K_CACHE]}"
        self.tmp = f"{self.final}{src.tmp_prefix}{os.getpid()}"
        src.fs.create_dir(os.path.dirname(self.final), recursive=True)
        f = src.plan.units.files[i]
        meta = {"tokenloom.cache": json.dumps({K_SOURCE: src.plan.name, "file": f.name, **src.header})}
        self.schema = schema(meta)
        self.stream = src.fs.open_output_stream(self.tmp)
        self.writer = pq.ParquetWriter(self.stream, self.schema, **WRITER_OPTIONS)
        self.written = 0
        self.documents = 0
        self.tokens = 0

    def add(self, values: np.ndarray, offsets: np.ndarray, valid: Optional[np.ndarray], chars: np.ndarray) -> bool:
        """Write the next unit; True when it was the file's last."""
        n = len(chars)
        self.writer.write_table(_unit_table(values, offsets, valid, chars, self.schema, self.src.dtype),
                                row_group_size=max(n, 1))
        self.written += 1
        self.documents += n if valid is None else int(valid.sum())
        self.tokens += len(values)
        return self.written == len(self.units)

    def finish(self) -> Dict[str, Any]:
        self.writer.close()
        self.stream.close()
        fs = self.src.fs
        with fs.open_input_file(self.tmp) as handle:
            meta = pq.ParquetFile(handle).metadata
            size = handle.size()
        rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        if rows != self.entry["units"]:
            raise RuntimeError(f"{self.tmp}: wrote row groups of {rows[:8]} rows for units of "
                               f"{self.entry['units'][:8]}; this pyarrow split the row groups: report it, with its "
                               "version")
        fs.move(self.tmp, self.final)
        self.entry.update({K_CACHE_BYTES: int(size), K_DOCUMENTS: self.documents, K_TOKENS: self.tokens})
        self.src.record(self.i, self.entry)
        return self.entry

    def abandon(self) -> None:
        try:
            self.writer.close()
            self.stream.close()
            self.src.fs.delete_file(self.tmp)
        except Exception:  # the build's own error is what the user needs to see
            pass


def build_cache(sources: Union[SourceSpec, Mapping[str, SourceSpec]], tokenizer: Any, out: str, *,
                text_column: Union[str, Mapping[str, str]] = "text", text_mode: Union[str, Mapping[str, str]] = "file",
                manifest: Union[str, Mapping[str, str], None] = None, processes: Optional[int] = None,
                rank: Optional[int] = None, world_size: Optional[int] = None,
                progress: Optional[Progress] = None) -> Dict[str, Any]:
    """Tokenize this rank's share of ``sources`` into the cache at ``out`` (path or URI; see
    the module docstring); ``sources``, ``text_column``, ``text_mode`` (each one value or ``{name: value}``)
    and ``manifest`` as in ``pretrain``, whose source names pick the cache folder: build and train with the same names.
    ``processes``: build processes (default: the CPUs this process may use). ``progress`` is
    called after every unit with the counts so far. Returns what was done."""
    start = time.perf_counter()
    if processes is not None and processes < 1:
        raise ValueError(f"processes={processes} must be >= 1 (None: every CPU this process may use)")
    rank, world_size = rank_world(rank, world_size)
    named = named_sources(sources)
    manifests = dict(manifest) if isinstance(manifest, Mapping) else \
        ({} if manifest is None else {n: manifest for n in named})
    encoder = load_encoder(tokenizer)
    dtype = dtype_for(encoder.vocab_size)
    fs, root, shown = open_root(out)
    plans = _plans(named, text_column, text_mode, manifests)
    srcs = [_Source(p, fs, root, shown, encoder, dtype, rank, world_size) for p in plans]
    mine, todo, tasks = _share(plans, srcs, rank, world_size)
    tally = _Tally(plans, mine, len(todo), len(tasks), start, progress)
    tally.report()
    n_proc = max(1, min(processes or len(os.sched_getaffinity(0)), len(tasks)))
    _build(plans, srcs, encoder, dtype, todo, tasks, n_proc, tally)
    _count_reused(plans, srcs, mine, todo, tally)
    for src in srcs:  # with other ranks' files: is the whole cache there now?
        src.scan()
    complete = all(src.is_done(i, file_entry(src.plan, i, units)) for src in srcs
                   for i, units in file_units(src.plan).items())
    return {"path": shown, "rank": rank, "world_size": world_size, "dtype": dtype, "processes": n_proc,
            "seconds": time.perf_counter() - start, "sources": tally.per_source, "complete": complete}


def _plans(named: Mapping[str, SourceSpec], text_column: Union[str, Mapping[str, str]],
           text_mode: Union[str, Mapping[str, str]], manifests: Mapping[str, str]) -> List[SourcePlan]:
    """Each source listed as ``pretrain`` lists it, with its own text column, text mode and manifest."""
    columns = setting_per_source("text_column", text_column, list(named))
    modes = setting_per_source("text_mode", text_mode, list(named), what="a text mode")
    return [plan_source(name, spec, column=columns[name], text_mode=modes[name], manifest=manifests.get(name))
            for name, spec in named.items()]


_Job = Tuple[int, int, np.ndarray]  # (source, file, its units)


def _share(plans: List[SourcePlan], srcs: List[_Source], rank: int, world_size: int
           ) -> Tuple[List[_Job], List[_Job], List[Tuple[int, int]]]:
    """This rank's files, those of them not already built, and the units of those, in order (see `assign`)."""
    every = [(si, i, units) for si, p in enumerate(plans) for i, units in sorted(file_units(p).items())]
    owner = assign([int(plans[si].units.rows[units].sum()) for si, i, units in every], world_size)
    mine = [job for job, r in zip(every, owner) if r == rank]
    todo = [(si, i, units) for si, i, units in mine if not srcs[si].is_done(i, file_entry(plans[si], i, units))]
    tasks = [(si, int(u)) for si, i, units in todo for u in units]
    return mine, todo, tasks


def _build(plans: List[SourcePlan], srcs: List[_Source], encoder: Encoder, dtype: str, todo: List[_Job],
           tasks: List[Tuple[int, int]], n_proc: int, tally: _Tally) -> None:
    """Encode ``tasks`` in ``n_proc`` processes (or this one) and write the cache files of ``todo``."""
    pool = None
    try:
        if n_proc > 1:
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            pool = ctx.Pool(n_proc, initializer=_init, initargs=(plans, encoder, dtype))
            results = pool.imap(_encode_unit, tasks, chunksize=1)
        else:
            _init(plans, encoder, dtype)
            results = map(_encode_unit, tasks)
        _write(plans, srcs, todo, results, tally)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def _write(plans: List[SourcePlan], srcs: List[_Source], todo: List[_Job], results: Iterator[tuple],
           tally: _Tally) -> None:
    """Write the encoded units in order, each file's into its cache file, counting after every unit; a
    file left half-written by an error is deleted."""
    writers = iter(todo)
    current: Optional[_FileWriter] = None
    try:
        for si, u, values, offsets, valid, chars in results:
            if current is None:
                s, i, units = next(writers)
                current = _FileWriter(srcs[s], i, units)
            last = current.add(values, offsets, valid, chars)
            tally.unit(values, valid, chars)
            if last:
                tally.built(plans[si].name, current.finish())
                current = None
            tally.tick()
    except BaseException:
        if current is not None:
            current.abandon()
        raise


def _count_reused(plans: List[SourcePlan], srcs: List[_Source], mine: List[_Job], todo: List[_Job],
                  tally: _Tally) -> None:
    """Count this rank's files that an earlier build left whole (as their manifest entries record them)."""
    built = {(si, i) for si, i, _ in todo}
    for si, i, units in mine:
        if (si, i) in built:
            continue
        entry = next(e for e in srcs[si].done[plans[si].units.files[i].name]
                     if matches(e, file_entry(plans[si], i, units)))
        tally.file(plans[si].name, "reused", entry)


class _Tally:
    """What a build counts: the counts ``progress`` gets (after every unit), and per source its files
    on this rank, those built and reused, and their documents, tokens and bytes."""

    def __init__(self, plans: List[SourcePlan], mine: List[_Job], files_total: int, units_total: int,
                 start: float, progress: Optional[Progress]):
        self.counts = {"units_done": 0, "units_total": units_total, "files_done": 0, "files_total": files_total,
                       "documents": 0, "tokens": 0, "seconds": 0.0}
        self.per_source = {p.name: {"files": 0, "built": 0, "reused": 0, "documents": 0, "tokens": 0, "bytes": 0}
                           for p in plans}
        for si, i, units in mine:
            self.per_source[plans[si].name]["files"] += 1
        self.start, self.progress = start, progress

    def report(self) -> None:
        """Hand the counts so far to ``progress``."""
        if self.progress is not None:
            self.progress(dict(self.counts))

    def unit(self, values: np.ndarray, valid: Optional[np.ndarray], chars: np.ndarray) -> None:
        """Count a unit written: its documents and tokens."""
        self.counts["units_done"] += 1
        self.counts["documents"] += len(chars) if valid is None else int(valid.sum())
        self.counts["tokens"] += len(values)

    def built(self, name: str, entry: Dict[str, Any]) -> None:
        """Count a cache file of source ``name`` built whole, its manifest entry ``entry``."""
        self.file(name, "built", entry)
        self.counts["files_done"] += 1

    def file(self, name: str, how: str, entry: Dict[str, Any]) -> None:
        """Count a cache file of source ``name`` as ``how`` ("built" or "reused"), with the documents,
        tokens and bytes its manifest entry ``entry`` records."""
        stats = self.per_source[name]
        stats[how] += 1
        for k, e in (("documents", K_DOCUMENTS), ("tokens", K_TOKENS), ("bytes", K_CACHE_BYTES)):
            stats[k] += int(entry.get(e, 0))

    def tick(self) -> None:
        """Time the build so far and report the counts."""
        self.counts["seconds"] = time.perf_counter() - self.start
        self.report()
