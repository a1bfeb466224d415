"""A token cache on remote storage: read its folders while the sources are listed, and hand the
workers its footers and first row groups.

Why: read when matching asks and one after another, a remote cache's own reads would be round
trips in a row after the sources' listing, before the first batch: the source's cache folder
listed, its manifest opened and read, ``tokens/`` listed; and then every loader worker would open
each cache file and read its footer before it fetched its first row group. benchmarks/remote_peers.py
measures the first batch from a token cache in S3 against tokenizing the same text from the same
bucket (see docs/performance.md).

- `read_cache` reads one source's cache folder: one listing of it and its ``tokens/``, then its
  manifest parts (all at once) beside every cache file there, opened and its footer read,
  ``LIST_THREADS`` at a time, the files kept open. cache.py's `start_cache_reads` runs it in a thread
  per source from the moment the recipe starts, beside the listing of the sources and the
  tokenizer's load; matching the cache against the sources (cache.py's `_attach_one`) waits for it.
- `ship_footers` keeps, of those, the footers and open files of the cache files the source reads
  (`UnitCache.footers`, up to ``SHIP_FOOTERS`` a source, as parquet sources ship theirs): the workers
  read no footer, and the recipe fetches the first row groups of its workers' shards with the open
  files before they fork (first_fetches.py), as it does for a parquet source.

Trade-off: the cache files of other contents under ``tokens/`` (a source file rewritten since the
build) are opened and their footers read too, then closed at matching: a round trip's work each, in
parallel. A local cache is read when matching asks, in the calling thread. Errors are raised where a
synchronous read raises them: a failed listing or manifest at matching, in source order, with the
message a read at matching gives; a cache file whose footer cannot be read is not shipped (nor, then, is any footer
of its source), and the worker that reads it names it.
"""

from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import pyarrow.fs as pafs

from .cache_format import TOKENS_DIR, has_parts, list_folder, open_root, read_parts, source_dir
from .files import SourceFile
from .parquet import Footer, footers_or_errors


@dataclass
class CacheRead:
    """What one source's cache folder holds. ``parts`` and ``present`` are None when not read yet
    (a local cache: read at matching), or the exception reading them raised (raised at matching);
    ``footers`` maps a cache file (``tokens/<id>.parquet``) to its `Footer`, its file kept open, or
    to the exception reading it raised (a remote cache only)."""

    fs: pafs.FileSystem
    root: str
    shown: str
    folder: str
    infos: List[pafs.FileInfo]
    parts: Any = None
    present: Any = None
    footers: Dict[str, Any] = field(default_factory=dict)

    def has_parts(self) -> bool:
        return has_parts(self.fs, self.folder, self.infos)

    def close(self) -> None:
        """Close the files kept open (those `ship_footers` did not hand on)."""
        for footer in self.footers.values():
            if isinstance(footer, Footer) and footer.handle is not None:
                footer.handle.close()
        self.footers = {}


def read_cache(spec: str, name: str) -> CacheRead:
    """Read source ``name``'s folder of the cache ``spec`` (see the module docstring)."""
    fs, root, shown = open_root(spec)
    folder = source_dir(root, name)
    if fs.type_name == "local":
        return CacheRead(fs, root, shown, folder, list_folder(fs, folder))
    # One listing of the folder and its tokens/ (a round trip, not two in a row).
    everything = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    tokens = f"{folder}/{TOKENS_DIR}"
    read = CacheRead(fs, root, shown, folder, [i for i in everything if posixpath.dirname(i.path) == folder])
    if not read.has_parts():
        return read
    read.present = {f"{TOKENS_DIR}/{posixpath.basename(i.path)}": int(i.size) for i in everything
                    if i.type == pafs.FileType.File and posixpath.dirname(i.path) == tokens}
    with ThreadPoolExecutor(1, thread_name_prefix="tokenloom-cache") as pool:
        parts = pool.submit(read_parts, fs, folder, f"{shown}/{name}", read.infos)
        files = [SourceFile(f"{folder}/{rel}", size, rel, fs) for rel, size in read.present.items()]
        read.footers = dict(zip(read.present, footers_or_errors(files)))
        try:
            read.parts = parts.result()
        except Exception as e:  # noqa: BLE001 - raised at matching
            read.parts = e
    return read


def ship_footers(read: CacheRead, names: List[str]) -> Tuple[Optional[List[bytes]], Optional[Dict[int, Any]]]:
    """The footers (``b""`` where not kept) and open files (by index) of cache files ``names`` (relative to
    the source's folder, in the `UnitCache`'s order), from ``read``; the other files are closed. ``(None,
    None)`` when none were read (a local cache), or when any of ``names`` failed: its worker reads it."""
    got = [read.footers.get(n) for n in names]
    if not got or any(not isinstance(f, Footer) for f in got):
        read.close()
        return None, None
    for n in names:
        read.footers.pop(n)
    read.close()
    handles = {i: f.handle for i, f in enumerate(got) if f.handle is not None}
    return [f.raw for f in got], handles or None
