"""The index of a parquet source (`tokenloom index`): list units without opening every footer.

Listing a parquet source opens every file's footer in the process that builds the
loader: an open and two small reads per file, i.e. one or two round trips per file
on S3, at every start. ``tokenloom index SPEC`` reads the footers once and writes
what listing needs into one small JSON file, ``_tokenloom_index.json`` in the
directory the spec resolves under (the directory itself, a glob's fixed prefix,
a single file's directory), or where ``--out`` says. Per file it records the name
relative to that directory, the size in bytes, the hash of the footer (the file's
content key in resume fingerprints), the rows of every row group, and the columns
(name, arrow type, kind), so the column checks of listing run on it unchanged. A
loader built on the spec then reads that one file instead of N footers (a path
elsewhere is passed as ``manifest=``).

Trade-off: the index is trusted for row counts and columns, but checked against
the files. The spec is still resolved (it finds the files), and every matched
file must appear in the index with the size it has now; a file missing from it or
of another size is refused with the file named and the command to re-run. Files
the index lists that the spec does not match are ignored. The resume fingerprint
is the same with or without an index (same names, sizes and footer hashes). A file
rewritten to exactly the same size after indexing is not caught at build: the
index's footer hash is trusted (re-run the index after rewriting files), and a
worker refuses a row group whose row count differs.

Only parquet has footers to index; a jsonl or text file given to the index is
refused naming its format (their listing reads the lines, and needs no index).

The index is plain JSON read with ``json.loads`` and checked key by key (keys
are the constants below); nothing in it is evaluated or unpickled.

Footer reads at build: N without an index (``LIST_THREADS`` at a time on remote storage,
parquet.py), 0 with one, which is one request (`tests/test_manifest.py` counts them).
``plan_source`` from footers and from the index, on local files and on S3, is measured in
docs/performance.md. Whether a directory holds an index is seen in the listing of a glob or
a directory (`SourceFile.index_listed`), so only a single-file spec costs a lookup for it.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow.fs as pafs

from .parquet import TEXT, Footer, UnitTable, check_column, footers_or_errors, units_from_footers
from .files import FORMAT_SUFFIXES, MANIFEST_NAME, SourceFile, _redact, resolve_files
from .from_uri import filesystem_from_uri

FORMAT = "tokenloom.index"
VERSION = 2  # 2: the footer hash of every file

# Keys of the JSON document.
K_FORMAT, K_VERSION, K_SPEC, K_COLUMN = "format", "version", "spec", "column"
K_SCHEMAS, K_FILES = "schemas", "files"
K_NAME, K_SIZE, K_ROW_GROUPS, K_SCHEMA, K_FOOTER = "name", "size", "row_groups", "schema", "footer"
#: Per row group, each column's uncompressed bytes (what sizes read windows, row_windows.py); an index
#: written before it lacks the key, and its sources are then read in whole row groups (a warning says so).
K_SIZES = "sizes"


def _base(f: SourceFile) -> str:
    """The directory ``f``'s spec resolved under: its path minus its relative name."""
    return f.path[:len(f.path) - len(f.name)].rstrip("/")


def _location(where: str) -> Tuple[pafs.FileSystem, str]:
    if "://" in where:
        return filesystem_from_uri(where)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(where))


def _shown(f: SourceFile, path: str) -> str:
    """``path`` (on ``f``'s filesystem) as the user would write it."""
    return f.uri[:len(f.uri) - len(f.path)] + path if f.uri.endswith(f.path) else path


# --- writing -------------------------------------------------------------------------

def _refuse_other_formats(f: SourceFile) -> None:
    """A jsonl or text file (by its ending) is named as such, not read as a broken parquet file."""
    for fmt, kind in (("jsonl", "a jsonl"), ("txt", "a text")):
        if f.path.lower().endswith(FORMAT_SUFFIXES[fmt]):
            raise ValueError(f"{f.uri or f.path} is {kind} file, and `tokenloom index` indexes parquet footers "
                             f"only; {fmt} sources need no index (loaders list them from their lines): give "
                             "it parquet files, e.g. a glob such as 'data/*.parquet'")


def build_manifest(spec: str, files: Sequence[SourceFile], column: Optional[str] = "text") -> Dict[str, Any]:
    """Read every footer of ``files`` once; with ``column``, every file with rows must have it."""
    schemas: "OrderedDict[tuple, int]" = OrderedDict()
    entries = []
    for f in files:
        _refuse_other_formats(f)
    for f, footer in zip(files, footers_or_errors(files)):  # remote footers read at once
        if isinstance(footer, Exception):
            raise footer
        if column:
            check_column(f, footer, column, None)
        schema = schemas.setdefault(footer.columns, len(schemas))
        entries.append({K_NAME: f.name, K_SIZE: f.size, K_FOOTER: footer.digest, K_ROW_GROUPS: list(footer.row_groups),
                        K_SCHEMA: schema, K_SIZES: [list(x) for x in footer.sizes]})
        if footer.handle is not None:
            footer.handle.close()
    # Absolute, so the "re-run `tokenloom index SPEC`" hint works from any directory.
    shown_spec = _redact(spec, spec) if "://" in spec else os.path.abspath(os.path.expanduser(spec))
    return {K_FORMAT: FORMAT, K_VERSION: VERSION, K_SPEC: shown_spec, K_COLUMN: column,
            K_SCHEMAS: [[list(c) for c in cols] for cols in schemas], K_FILES: entries}


def write_manifest(spec: str, out: Optional[str] = None, column: Optional[str] = "text") -> Dict[str, Any]:
    """Index the parquet files of ``spec`` into ``out`` (default: ``_tokenloom_index.json``
    in the directory the spec resolves under). Returns a summary: where, and how much."""
    files = resolve_files(spec, "parquet")
    bases = {_base(f) for f in files}
    if out is None and len(bases) != 1:
        raise ValueError(f"{spec=} resolves under several directories {sorted(bases)[:3]}; index one directory or "
                         "glob at a time, or pass --out")
    doc = build_manifest(spec, files, column)
    if out is None:
        fs, path = files[0].fs, f"{bases.pop()}/{MANIFEST_NAME}"
        shown = _shown(files[0], path)
    else:
        fs, path = _location(out)
        shown = out
    data = json.dumps(doc, separators=(",", ":")).encode()
    # Written aside and moved, so a reader never sees half an index.
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as stream:
        stream.write(data)
    fs.move(tmp, path)
    return {"path": shown, "bytes": len(data), "files": len(files),
            "row_groups": sum(len(e[K_ROW_GROUPS]) for e in doc[K_FILES]),
            "rows": sum(sum(e[K_ROW_GROUPS]) for e in doc[K_FILES])}


# --- reading -------------------------------------------------------------------------

class Manifest:
    """A loaded index: footers by relative file name, checked against the files on use."""

    def __init__(self, doc: Any, shown: str):
        self.shown = shown
        rerun = "re-run `tokenloom index` on the source"
        try:
            if doc[K_FORMAT] != FORMAT or doc[K_VERSION] != VERSION:
                raise ValueError(f"format {doc[K_FORMAT]!r} version {doc[K_VERSION]!r}, expected {FORMAT!r} "
                                 f"version {VERSION}")
            self.spec = str(doc[K_SPEC])
            rerun = f"re-run `tokenloom index {self.spec}`"
            schemas = [tuple((str(n), str(t), str(k)) for n, t, k in cols) for cols in doc[K_SCHEMAS]]
            self.footers: Dict[str, Tuple[int, Footer]] = {}
            for e in doc[K_FILES]:
                rows = tuple(int(x) for x in e[K_ROW_GROUPS])
                if any(x < 0 for x in rows) or not isinstance(e[K_SIZE], int) or not isinstance(e[K_FOOTER], str):
                    raise ValueError(f"bad entry {e!r:.200}")
                columns = schemas[int(e[K_SCHEMA])]
                sizes = tuple(tuple(int(x) for x in rg) for rg in e.get(K_SIZES, ()))
                if sizes and (len(sizes) != len(rows) or any(len(rg) != len(columns) for rg in sizes)):
                    raise ValueError(f"bad sizes in entry {e!r:.200}")
                self.footers[str(e[K_NAME])] = (e[K_SIZE], Footer(columns, rows, e[K_FOOTER], sizes))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"{shown} is not a tokenloom index this version can read ({e!r:.300}); {rerun}, "
                             f"or delete it to list the files' footers instead") from None
        self.rerun = rerun

    def footer(self, f: SourceFile) -> Footer:
        """The indexed footer of ``f``, refused unless ``f`` is listed with its current size."""
        entry = self.footers.get(f.name)
        if entry is None:
            raise ValueError(f"{f.uri or f.path} is not in the index {self.shown} (it lists {len(self.footers)} "
                             f"files; {f.name!r} was added or renamed since); {self.rerun}")
        size, footer = entry
        if size != f.size:
            raise ValueError(f"the index {self.shown} lists {f.name!r} with size={size} bytes but "
                             f"{f.uri or f.path} is {f.size} bytes now: the file changed since it was indexed; "
                             f"{self.rerun}")
        return footer


def load_manifest(fs: pafs.FileSystem, path: str, shown: str) -> Manifest:
    try:
        with fs.open_input_stream(path) as stream:
            data = stream.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"index {shown} does not exist; write it with `tokenloom index SOURCE --out "
                                f"{shown}`, or leave manifest= out") from None
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{shown} is not a tokenloom index ({e}); re-run `tokenloom index` on the source, "
                         "or delete it to list the files' footers instead") from None
    return Manifest(doc, shown)


def _default_manifest(f: SourceFile) -> Optional[Manifest]:
    """The index in the directory ``f``'s spec resolved under, if there is one."""
    base = _base(f)
    if not base or f.index_listed is False:  # the listing of that directory saw none: no request
        return None
    path = f"{base}/{MANIFEST_NAME}"
    if not f.index_listed and f.fs.get_file_info(path).type != pafs.FileType.File:
        return None
    return load_manifest(f.fs, path, _shown(f, path))


def list_units(files: Sequence[SourceFile], column: str, *, require: Optional[str] = TEXT,
               manifest: Optional[str] = None) -> UnitTable:
    """`list_parquet_units`, taking footers from an index where there is one: ``manifest``
    (a path or URI) for all files, else the index of each directory the files resolved
    under, else the footers themselves."""
    footers: List[Footer] = []
    if manifest is not None:
        index = load_manifest(*_location(manifest), manifest)
        footers = [index.footer(f) for f in files]
    else:
        found: Dict[str, Any] = {}  # base -> its Manifest, None, or the error looking it up raised
        bases = []
        for f in files:
            base = _shown(f, _base(f))  # with the scheme: a local and a remote directory may share a path
            if base not in found:
                try:
                    found[base] = _default_manifest(f)
                except Exception as e:  # noqa: BLE001 - raised below where its first file comes
                    found[base] = e
            bases.append(base)
        unindexed = [f for f, b in zip(files, bases) if found[b] is None]
        read = dict(zip((id(f) for f in unindexed), footers_or_errors(unindexed)))  # remote ones at once
        for f, base in zip(files, bases):  # errors in file order, as reading one by one raised them
            index = found[base]
            if isinstance(index, Exception):
                raise index
            footer = index.footer(f) if index is not None else read[id(f)]
            if isinstance(footer, Exception):
                raise footer
            footers.append(footer)
    return units_from_footers(files, footers, column, require=require)
