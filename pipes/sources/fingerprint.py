"""A source's resume fingerprint, and which of its files changed.

A loader state records one fingerprint per source; a resume must see the same files
with the same contents. Per file it covers the name relative to the spec (a corpus
moved to another mount still matches), the size, and a *content key*: for parquet,
a hash of the footer bytes, which listing reads anyway (row counts, column-chunk
offsets and compressed sizes, min/max statistics), so it costs nothing extra.
jsonl and text files have no footer: their key is empty and their modification
times are recorded apart, as a warning only (copies and rsync change them).
A Hugging Face dataset's Arrow files carry a key from their record batches
(hf_datasets.py) and no modification times.

The fingerprint is a small dict of plain values:

- ``digest``: sha256 of (name, size, key) of every file, in order. A different
  digest refuses the state; `describe_source_change` says why.
- ``sketch``: an invertible Bloom lookup table (Goodrich & Mitzenmacher 2011) over
  one 64-byte element per file (the name's last 48 bytes, the size, 8 bytes of the
  key). Each element is XOR-ed into 3 of 48 cells (one per third). Subtracting the
  saved sketch from the current one cancels every unchanged file, whatever their
  number, and "peeling" cells left with one element recovers the rest, named.
- ``mtimes``: the same kind of sketch (24 cells) over (name, mtime) of jsonl and
  text files; a difference there is a warning naming the files (`source_warnings`).

Trade-off: a fixed size instead of a per-file table. A sketch's size is set by its cells,
not by the number of files: the same whether a source has 3 files or 200,000 (stored
zlib-compressed as base64, so a small source's sketch, its cells mostly empty, is smaller
still); building it hashes each file's element once and XORs the elements in with numpy. It names every changed file with high probability
up to about a dozen differing elements (a rewritten file is two, old and new); beyond
that the message names what it could and says more changed. A parquet rewrite that
keeps every column chunk's offset, size and min/max (uncompressed data with bytes
swapped mid-value) keeps its footer and is not caught here; readers still check row
counts. Sizes, build time and recovery rates are in docs/performance.md.
"""

from __future__ import annotations

import base64
import hashlib
import warnings
import zlib
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from .files import SourceFile

#: Bytes of a file's name kept in a sketch element (its end: the most specific part).
NAME_BYTES = 48
#: Element layout: name (NAME_BYTES), then two little-endian uint64 values.
ELEMENT_BYTES = NAME_BYTES + 16
#: Cells of the files sketch and of the mtimes sketch (multiples of HASHES).
FILE_CELLS, MTIME_CELLS = 48, 24
HASHES = 3
#: Changed files listed in one message at most.
SHOWN = 8
#: A name cut to its last bytes starts with this byte (names never hold control bytes).
_CUT = 1

K_FORMAT, K_FILES, K_DIGEST, K_SKETCH, K_MTIMES = "format", "files", "digest", "sketch", "mtimes"


def content_key(data: bytes) -> str:
    """The content key of a file from bytes that change with its content (a parquet footer)."""
    return hashlib.sha256(data).hexdigest()[:16]


# --- the sketch ----------------------------------------------------------------------

def _name_field(name: str) -> bytes:
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > NAME_BYTES:
        raw = bytes([_CUT]) + raw[-(NAME_BYTES - 1):]
    return raw


def _shown_name(field: bytes) -> str:
    field = field.rstrip(b"\0")
    if field[:1] == bytes([_CUT]):
        return "..." + field[1:].decode("utf-8", "replace")
    return field.decode("utf-8", "replace")


_ELEMENT = np.dtype([("name", f"S{NAME_BYTES}"), ("a", "<u8"), ("b", "<u8")])


def _elements(rows: Sequence[Tuple[str, int, int]]) -> np.ndarray:
    """(n, ELEMENT_BYTES) uint8: each (name, a, b) as the name's field, then a and b."""
    table = np.array([(_name_field(n), a & (2**64 - 1), b & (2**64 - 1)) for n, a, b in rows], _ELEMENT)
    return table.view(np.uint8).reshape(len(rows), ELEMENT_BYTES)


def _placement(data: np.ndarray, cells: int) -> Tuple[np.ndarray, np.ndarray]:
    """Each element's HASHES cells (one per part of ``cells // HASHES``) and its check word,
    from the 16-byte blake2b of its bytes."""
    blob = data.tobytes()
    digests = b"".join(hashlib.blake2b(blob[i:i + ELEMENT_BYTES], digest_size=16).digest()
                       for i in range(0, len(blob), ELEMENT_BYTES))
    words = np.frombuffer(digests, "<u4").reshape(len(data), 4).astype(np.int64)
    part = cells // HASHES
    return words[:, :HASHES] % part + np.arange(HASHES) * part, words[:, HASHES].astype(np.uint32)


def _xor_into(table: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """``table[index[i]] ^= values[i]`` for all i (repeated indices included), by sorting and
    ``np.bitwise_xor.reduceat``, faster than ``np.bitwise_xor.at`` (see docs/performance.md)."""
    order = np.argsort(index, kind="stable")
    idx = index[order]
    starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
    table[idx[starts]] ^= np.bitwise_xor.reduceat(values[order], starts, axis=0)


class _Sketch:
    """``cells`` counts (mod 256), XOR-sums of elements, and XOR-sums of their check words."""

    def __init__(self, cells: int):
        self.count = np.zeros(cells, np.uint8)
        self.sums = np.zeros((cells, ELEMENT_BYTES), np.uint8)
        self.checks = np.zeros(cells, np.uint32)

    @classmethod
    def build(cls, rows: Sequence[Tuple[str, int, int]], cells: int) -> "_Sketch":
        sk = cls(cells)
        if not rows:
            return sk
        data = _elements(rows)
        where, checks = _placement(data, cells)
        sk.count[:] = np.bincount(where.ravel(), minlength=cells) % 256
        words = data.view("<u8")  # XOR by 8 bytes at a time
        for j in range(HASHES):  # an element's cells are distinct (one per part)
            _xor_into(sk.sums.view("<u8"), where[:, j], words)
            _xor_into(sk.checks, where[:, j], checks)
        return sk

    def encode(self) -> str:
        # zlib: a source of a few files leaves most cells empty (~200 bytes instead of 3.4 KB)
        raw = self.count.tobytes() + self.sums.tobytes() + self.checks.astype("<u4").tobytes()
        return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> "_Sketch":
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
        cells, rest = divmod(len(raw), 1 + ELEMENT_BYTES + 4)
        if rest or cells % HASHES:
            raise ValueError(f"a sketch of {len(raw)} bytes is not a whole number of cells")
        sk = cls(cells)
        sk.count[:] = np.frombuffer(raw, np.uint8, cells)
        sk.sums[:] = np.frombuffer(raw, np.uint8, cells * ELEMENT_BYTES, cells).reshape(cells, ELEMENT_BYTES)
        sk.checks[:] = np.frombuffer(raw, "<u4", cells, cells * (1 + ELEMENT_BYTES))
        return sk


def _difference(saved: str, current: str) -> Tuple[List[bytes], List[bytes], bool]:
    """Elements only in ``saved``, only in ``current``, and whether that is all of them
    (nothing named from a sketch that does not decode: it only serves the message)."""
    try:
        old, new = _Sketch.decode(saved), _Sketch.decode(current)
    except (ValueError, zlib.error):
        return [], [], False
    cells = len(new.count)
    if len(old.count) != cells:
        return [], [], False
    count = (new.count.astype(np.int16) - old.count.astype(np.int16) + 128) % 256 - 128
    sums, checks = old.sums ^ new.sums, old.checks ^ new.checks
    gone: List[bytes] = []
    came: List[bytes] = []
    progress, budget = True, 2 * cells  # peels; more than a sketch can hold means it was not built here
    while progress and budget > 0:
        progress = False
        for c in np.flatnonzero(np.abs(count) == 1).tolist():
            if abs(int(count[c])) != 1:
                continue  # peeled meanwhile
            values = sums[c].copy()
            where, check = _placement(values[None], cells)
            if c not in where[0] or check[0] != checks[c]:
                continue  # several elements whose counts add up to +-1
            sign = int(count[c])
            (came if sign > 0 else gone).append(values.tobytes())
            budget -= 1
            for w in where[0].tolist():
                count[w] -= sign
                sums[w] ^= values
                checks[w] ^= check[0]
            progress = True
    complete = not count.any() and not sums.any() and not checks.any()
    return gone, came, complete


def _fields(element: bytes) -> Tuple[str, int, int]:
    return (_shown_name(element[:NAME_BYTES]), int.from_bytes(element[NAME_BYTES:NAME_BYTES + 8], "little"),
            int.from_bytes(element[NAME_BYTES + 8:], "little"))


# --- building ------------------------------------------------------------------------

def _key_int(key: str) -> int:
    return int(key[:16], 16) if key else 0


def source_fingerprint(fmt: str, files: Sequence[SourceFile]) -> Dict[str, Any]:
    """The fingerprint of a listed source (see the module docstring)."""
    listing = "".join(f"\n{f.name}\0{f.size}\0{f.key}" for f in files)
    digest = hashlib.sha256((fmt + listing).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    sketch = _Sketch.build([(f.name, f.size, _key_int(f.key)) for f in files], FILE_CELLS)
    mtimes = None
    if fmt != "parquet":
        mtimes = _Sketch.build([(f.name, f.mtime_ns, 0) for f in files if f.mtime_ns is not None], MTIME_CELLS)
    return {K_FORMAT: fmt, K_FILES: len(files), K_DIGEST: digest, K_SKETCH: sketch.encode(),
            K_MTIMES: None if mtimes is None else mtimes.encode()}


def fingerprint_summary(fp: Any) -> str:
    """One line for a person: ``parquet:<digest> (12 files)`` (other values as they are)."""
    if not _valid(fp):
        return str(fp)
    return f"{fp[K_FORMAT]}:{fp[K_DIGEST]} ({fp[K_FILES]:,} file{'s' if fp[K_FILES] != 1 else ''})"


# --- comparing -----------------------------------------------------------------------

def _valid(fp: Any) -> bool:
    return (isinstance(fp, Mapping) and set(fp) == {K_FORMAT, K_FILES, K_DIGEST, K_SKETCH, K_MTIMES}
            and isinstance(fp[K_FILES], int) and all(isinstance(fp[k], str) for k in (K_FORMAT, K_DIGEST, K_SKETCH))
            and (fp[K_MTIMES] is None or isinstance(fp[K_MTIMES], str)))


def _listed(items: List[str], incomplete: bool) -> str:
    text = "; ".join(items[:SHOWN])
    if len(items) > SHOWN:
        text += f"; and {len(items) - SHOWN} more"
    if incomplete:
        text += "; and more than the state can name"
    return text


def describe_source_change(name: str, saved: Any, current: Any) -> str:
    """What changed in source ``name`` between a saved fingerprint and the current one, naming the
    files (added, removed, resized, rewritten); ``""`` when the state may be loaded (the digests
    match: only modification times may differ, see `source_warnings`). ``saved`` or ``current``
    may be None (a source only one side has)."""
    if saved is None or current is None:
        side = "this loader" if saved is None else "the saved state"
        return (f"source {name!r} is only in {side}: resume with the sources the state was saved with "
                "(the same names), or start a new run")
    if saved == current:
        return ""
    if not (_valid(saved) and _valid(current)):
        return (f"source {name!r}: the state records {saved!r:.80} as its files' fingerprint, in another layout "
                f"than this tokenloom's; resume with the tokenloom that saved it")
    if saved[K_DIGEST] == current[K_DIGEST] and saved[K_FORMAT] == current[K_FORMAT]:
        return ""
    head = f"source {name!r} changed since the state was saved"
    if saved[K_FORMAT] != current[K_FORMAT]:
        return f"{head}: its files were {saved[K_FORMAT]}, they are {current[K_FORMAT]} now"
    gone, came, complete = _difference(saved[K_SKETCH], current[K_SKETCH])
    before = {n: (size, key) for n, size, key in map(_fields, gone)}
    after = {n: (size, key) for n, size, key in map(_fields, came)}
    # With some differences left unnamed, a file seen on one side only may have changed, not come or gone.
    added, removed = ("added", "removed") if complete else ("added or changed", "removed or changed")
    items = []
    for n in sorted(set(before) | set(after)):
        if n not in before:
            items.append(f"{n} {added} ({after[n][0]:,} bytes)")
        elif n not in after:
            items.append(f"{n} {removed} (was {before[n][0]:,} bytes)")
        elif before[n][0] != after[n][0]:
            items.append(f"{n} resized ({before[n][0]:,} -> {after[n][0]:,} bytes)")
        else:
            changed = "another parquet footer" if current[K_FORMAT] == "parquet" else "other rows or record batches"
            items.append(f"{n} rewritten (same size, {after[n][0]:,} bytes, {changed})")
    counts = f"{saved[K_FILES]:,} file{'' if saved[K_FILES] == 1 else 's'} then, {current[K_FILES]:,} now"
    if not items:
        what = f"more files changed than the state can name ({counts})"
    else:
        what = _listed(items, not complete) + f" ({counts})"
    return (f"{head}: {what}. A state is tied to its files' contents: resume with the files it was saved "
            "with, or start a new run")


def source_warnings(name: str, saved: Any, current: Any) -> List[str]:
    """Warnings for source ``name`` whose files kept their names and sizes but not their
    modification times (jsonl and text only: they have no content key). Empty when the
    fingerprints do not both have mtimes or `describe_source_change` refuses the state anyway."""
    if not (_valid(saved) and _valid(current)) or saved[K_MTIMES] is None or current[K_MTIMES] is None:
        return []
    if saved[K_MTIMES] == current[K_MTIMES] or describe_source_change(name, saved, current):
        return []
    gone, came, complete = _difference(saved[K_MTIMES], current[K_MTIMES])
    names = sorted({_fields(e)[0] for e in gone} | {_fields(e)[0] for e in came})
    which = _listed(names, not complete) if names else f"more of its {current[K_FILES]:,} files than the state can name"
    return [f"source {name!r}: files with the same names and sizes but other modification times than when the "
            f"state was saved: {which}. jsonl and text files carry no content hash: if they were rewritten (not "
            "just copied), this resume reads other documents"]


def check_sources(saved: Any, current: Mapping[str, Any]) -> List[str]:
    """For ``check_config``'s ``"sources"`` key: one problem per changed source (empty: the
    state may be loaded), after warning (`UserWarning`) about files with new mtimes."""
    if not isinstance(saved, Mapping):
        return [f"sources: saved with {saved!r:.80}, this loader has {sorted(current)}"]
    problems = []
    for name in sorted(set(saved) | set(current), key=str):
        old, new = saved.get(name), current.get(name)
        problem = describe_source_change(name, old, new)
        if problem:
            problems.append(problem)
        else:
            for message in source_warnings(name, old, new):
                warnings.warn(message, stacklevel=3)
    return problems
