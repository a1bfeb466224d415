"""A demo corpus and a small tokenizer built from files every CPython installation has.

Tests, examples and benchmarks need text whose document lengths look like real
pretraining data: many short documents and a long tail of very long ones, which is
what stresses packing and mixing. The standard library provides that for free,
offline, on every machine that can run tokenloom:

- ``"code"``: one document per ``.py`` file (the file's text).
- ``"prose"``: every docstring of at least 40 characters (modules, classes,
  functions), the topics of the language reference shipped in
  ``pydoc_data/topics.py``, and the paragraphs of the stdlib's text files
  (``LICENSE.txt``, idlelib's ``NEWS.txt``, ...).

``site-packages``, ``__pycache__`` and test folders are left out: test suites are
stripped from many distribution builds (Debian's ``python3`` among them), and they
contain deliberately undecodable or unparseable files.

The corpus depends on the Python version it is built from (its document counts and
length percentiles per kind are in docs/performance.md). ``code`` documents are few and
long, with a long tail (the longest is ``pydoc_data/topics.py``); ``prose`` documents are
many and short (the longest is that file's ``specialnames`` topic).
`build_demo_corpus` writes both kinds to parquet in one pass over the stdlib; a second
call reuses the files. The shipped ``data/tokenizer.json`` (byte-level BPE, 4096 ids)
was trained by ``python -m tokenloom.sample_data`` on all the documents of both kinds.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import re
import sys
import sysconfig
import time
import warnings
import zlib
from itertools import islice
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

log = logging.getLogger(__name__)

KINDS = ("code", "prose")

#: Special tokens of the shipped tokenizer; their ids are 0..6 in this order.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

#: Docstrings and paragraphs shorter than this are mostly "Return x." noise.
MIN_PROSE_CHARS = 40

# Pruned while walking, so a system Python with a huge site-packages stays fast.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_PROSE_SUFFIXES = (".txt", ".rst")
# Grammar files are .txt but not natural language.
_NOT_PROSE = re.compile(r"grammar", re.IGNORECASE)
# Module-level dicts of documentation strings: {relative path: variable name}.
_TEXT_TABLES = {"pydoc_data/topics.py": "topics"}
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Statements are the only nodes that can hold a def; not descending into expressions
# keeps the walk shallow (long "a" + "b" + ... chains nest thousands deep).
_STATEMENT_LIKE = (ast.stmt, ast.excepthandler, ast.match_case)

# Demo layout: (rows per file, rows per row group). Several files and row groups
# per source, so sharding and resuming have something to split.
_DEMO_LAYOUT = {"code": (200, 25), "prose": (2000, 250)}
_MANIFEST = "MANIFEST.json"
_MANIFEST_FORMAT = 1


# --- walking the stdlib -----------------------------------------------------------

def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path, suffixes: Tuple[str, ...]) -> List[str]:
    """Relative POSIX paths of the files with ``suffixes``, sorted as strings so the
    order is the same on every filesystem."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(suffixes))
    return sorted(found)


def _read_utf8(path: Path) -> Optional[str]:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _parse(text: str, rel: str) -> Optional[ast.Module]:
    # Old escape sequences raise DeprecationWarning/SyntaxWarning noise, not errors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text, filename=rel)
        except (SyntaxError, ValueError):  # ValueError: NUL bytes in source
            return None


def _utf8_ok(text: str) -> bool:
    # A string literal may hold a lone surrogate ("\\udc80"), which parquet cannot store.
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# --- documents from one file ------------------------------------------------------

def _walk_defs(node: ast.AST, prefix: str) -> Iterator[Tuple[str, ast.AST]]:
    """(qualified name, node) for every class/function in source order, including
    those nested in if/try/with blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFS):
            name = prefix + child.name
            yield name, child
            yield from _walk_defs(child, name + ".")
        elif isinstance(child, _STATEMENT_LIKE):
            yield from _walk_defs(child, prefix)


def _text_table(tree: ast.Module, variable: str) -> Iterator[Tuple[str, str]]:
    for stmt in tree.body:
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == variable for t in stmt.targets)):
            for key, value in zip(stmt.value.keys, stmt.value.values):
                if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                        and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                    yield f"{variable}[{key.value}]", value.value


def _prose_from_python(rel: str, tree: ast.Module) -> Iterator[Dict[str, str]]:
    named: List[Tuple[str, str]] = []
    doc = ast.get_docstring(tree)
    if doc:
        named.append(("<module>", doc))
    named.extend((name, ast.get_docstring(node) or "") for name, node in _walk_defs(tree, ""))
    if rel in _TEXT_TABLES:
        named.extend(_text_table(tree, _TEXT_TABLES[rel]))
    seen: Dict[str, int] = {}
    for name, text in named:
        # Redefinitions (property setters, platform branches) share a name; keep ids unique.
        seen[name] = seen.get(name, 0) + 1
        if len(text) >= MIN_PROSE_CHARS and _utf8_ok(text):
            suffix = "" if seen[name] == 1 else f"#{seen[name]}"
            yield {"text": text, "id": f"prose:{rel}:{name}{suffix}"}


def _prose_from_text(rel: str, text: str) -> Iterator[Dict[str, str]]:
    paragraphs = (p.strip() for p in re.split(r"\n[ \t]*\n", text))
    for i, para in enumerate(p for p in paragraphs if len(p) >= MIN_PROSE_CHARS):
        yield {"text": para, "id": f"prose:{rel}:p{i}"}


def _iter_stdlib(kinds: Tuple[str, ...], skipped: Optional[List[str]]) -> Iterator[Tuple[str, Dict[str, str]]]:
    """(kind, document) for the requested kinds in one pass over sorted paths, so
    each file is read and parsed once however many kinds are built from it."""
    root = stdlib_root()
    want_prose = "prose" in kinds
    suffixes = (".py",) + (_PROSE_SUFFIXES if want_prose else ())
    n_skipped = 0
    for rel in _stdlib_files(root, suffixes):
        is_py = rel.endswith(".py")
        if not is_py and _NOT_PROSE.search(rel):
            continue
        text = _read_utf8(root / rel)
        tree = _parse(text, rel) if (text is not None and is_py) else None
        if text is None or (is_py and tree is None):
            n_skipped += 1
            if skipped is not None:
                skipped.append(rel)
            continue
        if not is_py:
            yield from (("prose", d) for d in _prose_from_text(rel, text))
            continue
        if "code" in kinds:
            yield "code", {"text": text, "id": f"code:{rel}"}
        if want_prose:
            yield from (("prose", d) for d in _prose_from_python(rel, tree))
    if n_skipped:
        log.info("skipped %d stdlib files that are not UTF-8 or do not parse", n_skipped)


def stdlib_documents(kind: str, limit: Optional[int] = None, *,
                     skipped: Optional[List[str]] = None) -> Iterator[Dict[str, str]]:
    """Documents ``{"text", "id"}`` of one kind from the running Python's stdlib.

    ``kind="code"`` yields one document per ``.py`` file, id ``"code:json/decoder.py"``
    (734 documents, median 7,832 characters on CPython 3.11). ``kind="prose"`` yields
    docstrings of at least 40 characters, reference-manual topics and text-file
    paragraphs (8,162 documents, median 122 characters), ids like
    ``"prose:json/decoder.py:JSONDecoder.decode"`` or ``"prose:LICENSE.txt:p3"``.

    Order is deterministic: sorted relative paths, then source order within a file.
    Files that are not UTF-8 or do not parse are skipped; pass a list as ``skipped``
    to receive their relative paths. ``limit`` caps the number of documents.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    docs = (doc for _, doc in _iter_stdlib((kind,), skipped))
    return islice(docs, limit) if limit is not None else docs


# --- parquet ----------------------------------------------------------------------

def _batches(documents: Iterable[Dict[str, str]], size: int) -> Iterator[List[Dict[str, str]]]:
    it = iter(documents)
    while batch := list(islice(it, size)):
        yield batch


def write_parquet_corpus(out_dir, documents: Iterable[Dict[str, str]], *, rows_per_file: int = 2000,
                         row_group_size: int = 250, prefix: str = "part") -> List[str]:
    """Write documents to ``out_dir/{prefix}-00000.parquet``, ... (string columns
    ``text`` and ``id``), ``rows_per_file`` rows per file in row groups of
    ``row_group_size`` rows; e.g. 8,000 documents with the defaults give 4 files of
    8 row groups. Creates ``out_dir``; returns the written paths in order.

    Only one file's rows are held in memory. Each file is written under a temporary
    name and renamed, so a crash never leaves a truncated file under a final name.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows_per_file < 1 or row_group_size < 1:
        raise ValueError(f"rows_per_file and row_group_size must be >= 1, got {rows_per_file}, {row_group_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("text", pa.string()), ("id", pa.string())])
    paths = []
    for i, batch in enumerate(_batches(documents, rows_per_file)):
        table = pa.table({"text": [d["text"] for d in batch], "id": [d["id"] for d in batch]}, schema=schema)
        path = out / f"{prefix}-{i:05d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp, row_group_size=row_group_size)
        os.replace(tmp, path)
        paths.append(str(path))
    return paths


def _demo_params(max_docs_per_source: Optional[int]) -> dict:
    # Everything that changes the bytes written: a different Python has a different stdlib.
    return {
        "format": _MANIFEST_FORMAT,
        "python": sys.version,
        "stdlib": str(stdlib_root()),
        "max_docs_per_source": max_docs_per_source,
        "layout": {k: list(v) for k, v in _DEMO_LAYOUT.items()},
    }


def _reuse(out: Path, params: dict) -> Optional[Dict[str, List[str]]]:
    try:
        manifest = json.loads((out / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if manifest.get("params") != params:
        return None
    paths = {k: [str(out / k / name) for name in manifest["files"][k]] for k in KINDS}
    if all(os.path.isfile(p) for ps in paths.values() for p in ps):
        return paths
    return None


def build_demo_corpus(out_dir, *, max_docs_per_source: Optional[int] = None) -> Dict[str, List[str]]:
    """Write the stdlib ``code`` and ``prose`` sources to ``out_dir/code/`` and
    ``out_dir/prose/``; return ``{"code": [paths], "prose": [paths]}``.

    Writes 4 code files (200 rows, row groups of 25) and 5 prose files (2000 rows, row
    groups of 250), in one pass over the stdlib. ``max_docs_per_source`` caps each
    source. Idempotent: ``out_dir/MANIFEST.json`` records the parameters and the
    Python version, and a matching manifest with all files present is reused as is.
    """
    out = Path(out_dir)
    params = _demo_params(max_docs_per_source)
    reused = _reuse(out, params)
    if reused is not None:
        return reused

    start = time.perf_counter()
    docs: Dict[str, List[Dict[str, str]]] = {k: [] for k in KINDS}
    skipped: List[str] = []
    cap = max_docs_per_source
    # One pass for both kinds, so each file is parsed once; the whole corpus is
    # ~16 MB of text, so holding it is cheaper than parsing twice.
    for kind, doc in _iter_stdlib(KINDS, skipped):
        if cap is None or len(docs[kind]) < cap:
            docs[kind].append(doc)
        elif all(len(d) >= cap for d in docs.values()):
            break

    (out / _MANIFEST).unlink(missing_ok=True)  # a half-rebuilt directory must not look reusable
    paths = {}
    for kind in KINDS:
        for stale in (out / kind).glob("part-*.parquet"):
            stale.unlink()
        rows, group = _DEMO_LAYOUT[kind]
        paths[kind] = write_parquet_corpus(out / kind, docs[kind], rows_per_file=rows, row_group_size=group)

    manifest = {
        "params": params,
        "files": {k: [Path(p).name for p in ps] for k, ps in paths.items()},
        "documents": {k: len(v) for k, v in docs.items()},
        "characters": {k: sum(len(d["text"]) for d in v) for k, v in docs.items()},
        "skipped_files": skipped,
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    (out / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return paths


# --- tokenizer --------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Train a GPT-2 style byte-level BPE `tokenizers.Tokenizer` on ``texts``.

    ByteLevel pre-tokenizer and decoder, no normalizer and no post-processor (the
    loader adds BOS itself), so ``decode(encode(x)) == x`` for any text. Ids 0..6 are
    `SPECIAL_TOKENS` (``"<|bos|>"`` is 0), then the 256 byte symbols, then merges up
    to ``vocab_size`` ids in all. The same texts give the same tokenizer, byte for byte.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a pair seen once is noise, not a unit worth an id
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front: any text encodes, and symbol ids do not
        # depend on which bytes the training sample happened to contain.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def default_tokenizer_path() -> str:
    """Path of the shipped ``tokenloom/data/tokenizer.json`` (4096-id byte-level BPE)."""
    from tokenloom.pipes.tokenizer import demo_tokenizer_path

    return demo_tokenizer_path()


def _training_sample(budget_chars: int) -> List[str]:
    """All stdlib documents if they fit in ``budget_chars``; otherwise a subset chosen
    by a hash of the id, so the sample does not depend on alphabetical position."""
    docs = [doc for _, doc in _iter_stdlib(KINDS, None)]
    docs.sort(key=lambda d: (zlib.crc32(d["id"].encode("utf-8")), d["id"]))
    texts, used = [], 0
    for d in docs:
        if used + len(d["text"]) > budget_chars:
            continue  # a smaller document later may still fit
        texts.append(d["text"])
        used += len(d["text"])
    return texts


def main(argv: Optional[List[str]] = None) -> None:
    """Regenerate the shipped tokenizer: ``python -m tokenloom.sample_data``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default=default_tokenizer_path(), help="where to write tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--budget-mb", type=float, default=24.0, help="cap on training text, in millions of characters")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    texts = _training_sample(int(args.budget_mb * 1e6))
    t1 = time.perf_counter()
    tok = train_tokenizer(texts, vocab_size=args.vocab_size)
    t2 = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out, pretty=True)
    size = os.path.getsize(args.out)
    print(f"sample: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} M characters in {t1 - t0:.1f} s")
    print(f"trained vocab {tok.get_vocab_size()} in {t2 - t1:.1f} s")
    print(f"wrote {args.out} ({size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
