"""``tokenloom index PATH_OR_GLOB``: write the index of a parquet source.

Reads every file's footer once and writes ``_tokenloom_index.json`` in the
directory the spec resolves under (or ``--out``), so loaders built on that spec
list their work units from one small file instead of opening every footer (see
`tokenloom.pipes.sources.manifest`). Re-run it whenever files are added, removed or
rewritten: a loader refuses an index that does not match the files, naming the
file that changed.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from tokenloom.pipes.sources.manifest import write_manifest


def run_index(args: argparse.Namespace) -> int:
    summary = write_manifest(args.spec, out=args.out, column=args.text_column or None)
    print(f"indexed {summary['files']} parquet files, {summary['row_groups']} row groups, {summary['rows']:,} rows "
          f"-> {summary['path']} ({summary['bytes'] / 1024:.1f} KiB)")
    return 0


def register(subparsers: Any, common: Optional[argparse.ArgumentParser] = None) -> None:
    p = subparsers.add_parser("index", parents=[common] if common is not None else [],
                              help="index a parquet source so loaders start without reading every footer",
                              description=__doc__.split("\n\n")[1].replace("\n", " ").replace("`", ""))
    p.add_argument("spec", metavar="PATH_OR_GLOB", help="a parquet file, directory, glob or URI (quote globs)")
    p.add_argument("--out", default=None, help="where to write the index (path or URI); default: "
                                                "_tokenloom_index.json in the directory the spec resolves under")
    p.add_argument("--text-column", default="text",
                   help="check that every file with rows has this column (default: text; '' skips the check)")
    p.set_defaults(run=run_index)
