"""``tokenloom tokenize SOURCES --tokenizer T --out DIR``: build a token cache.

Tokenizes every document of the sources once and writes the token ids to DIR (a
path or URI), one folder per source name; ``pretrain(..., cache=DIR)`` (or
``tokenloom run ... --cache DIR``) then reads ids instead of text and gives the
very batches of tokenizing on the fly. Name the sources as the run does. Several
processes encode at once (``--processes``, default: every CPU), a progress line
shows how far it is, and a build that was stopped resumes where it stopped. On a
cluster, run it on every rank (``torchrun ... -m tokenloom tokenize`` or
``--rank``/``--world-size``): each rank builds its share of the files.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from tokenloom.pipes.sources.cache_build import build_cache
from tokenloom.pipes.sources.readers import TEXT_MODES

from .cli_config import add_per_source_argument, merged_settings, tokenizer_path
from .progress import WIDTH, Progress


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


class _Line(Progress):
    """`Progress`'s line (redrawn in place on a terminal, every tenth of the way otherwise) with the
    build's counts: units, files, tokens/s and the time left."""

    def __init__(self, enabled: bool):
        super().__init__("tokenize", None, enabled=enabled)
        self._counts: Optional[Dict[str, Any]] = None

    def __call__(self, c: Dict[str, Any]) -> None:
        self._counts, self.total = c, c["units_total"]
        self.update(c["units_done"], c["tokens"])

    def _line(self) -> str:
        c = self._counts
        done, total, s = c["units_done"], c["units_total"], c["seconds"]
        rate = c["tokens"] / s if s > 0 else 0.0
        eta = f"{(total - done) * s / done:4.0f}s" if done else "   ?"
        filled = WIDTH * done // total if total else WIDTH
        return (f"tokenize [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{total} units  "
                f"{c['files_done']}/{c['files_total']} files  {rate / 1e6:5.2f}M tok/s  {s:5.1f}s  eta {eta}")

    def close(self) -> None:
        # Nothing to end before the first count; with nothing to build, a log gets no line.
        if self._counts is not None and (self.live or self.total):
            super().close()


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def run(args: argparse.Namespace) -> int:
    settings = merged_settings(args)  # the TOML file, overridden by the flags given
    if "sources" not in settings:
        raise ValueError("no sources: give name=path or path arguments (named as in the run), or [sources] in --config")
    line = _Line(not args.quiet)
    try:
        done = build_cache(settings["sources"], tokenizer_path(settings), args.out,
                           text_column=settings.get("text_column", "text"), text_mode=settings.get("text_mode", "file"),
                           processes=args.processes, rank=args.rank, world_size=args.world_size, progress=line)
    finally:
        line.close()
    for name, s in done["sources"].items():
        per = f", {s['bytes'] / s['tokens']:.2f} bytes/token" if s["tokens"] else ""
        print(f"{name:<12} {s['files']} file{'s' if s['files'] != 1 else ''} ({s['built']} built, {s['reused']} "
              f"already there), {s['documents']:,} documents, {s['tokens']:,} tokens, {_size(s['bytes'])}{per}")
    who = f"rank {done['rank']} of {done['world_size']}: " if done["world_size"] > 1 else ""
    state = ("complete" if done["complete"] else
             "not complete yet: other ranks' files are missing (run it on every rank), or this build was cut short")
    print(f"{who}{done['dtype']} ids in {done['seconds']:.1f}s with {done['processes']} processes -> "
          f"{done['path']} ({state})")
    return 0


def register(sub: Any, common: Optional[argparse.ArgumentParser] = None) -> None:
    p = sub.add_parser("tokenize", parents=[common] if common is not None else [],
                       help="tokenize sources once into a token cache that pretrain(cache=) reads",
                       description=__doc__.split("\n\n")[1].replace("\n", " ").replace("`", ""))
    p.add_argument("sources", nargs="*", metavar="SOURCE", default=argparse.SUPPRESS,
                   help="name=path or path (file, glob, directory, URI), named as in the run")
    # Settings default to absent, so merged_settings lets the TOML file's values stand.
    p.add_argument("--tokenizer", default=argparse.SUPPRESS,
                   help="tokenizer.json, a tokenizer directory, a tiktoken name, or 'demo'")
    p.add_argument("--out", required=True, metavar="DIR", help="the cache directory (path or URI)")
    add_per_source_argument(p, "--text-column", "text_column", "COLUMN|NAME=COLUMN",
                            "parquet column / jsonl field holding the text (default: text); name=column per source, "
                            "e.g. --text-column stories=story web=text")
    add_per_source_argument(p, "--text-mode", "text_mode", "MODE|NAME=MODE",
                            f"text files: one document per file or per paragraph ({' or '.join(TEXT_MODES)}; "
                            "name=mode per source)")
    p.add_argument("--config", metavar="TOML", help="sources, tokenizer, text column and mode from a run's TOML file")
    p.add_argument("--processes", type=_positive, help="build processes (default: every CPU this process may use)")
    p.add_argument("--rank", type=int, help="this builder's rank (default: $RANK, as torchrun sets it, else 0)")
    p.add_argument("--world-size", type=int, help="builders in all (default: $WORLD_SIZE, else 1)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(run=run)
