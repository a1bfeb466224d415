"""Compressed JSON sources (``.jsonl.gz``, ``.json.zst``, ``.ndjson.bz2`` ...) through pyarrow's codecs.

A compressed stream cannot be entered in the middle, and pyarrow has no seek index,
so a compressed file is listed by decompressing it once (its lines or array elements
found as in an uncompressed file, unit boundaries recorded as *decompressed* byte
offsets) and a unit is read by decompressing from the start of the file up to the
unit's end. A reader keeps one decompressing stream per file open at the position it
stopped, so units met in file order continue where the last one ended; a unit
behind that position starts the file over.

Trade-off: exact resume and work units of any size without a second copy of the
data or an index, against re-decompressing. The listing merges a compressed file's
units into ``UNITS_PER_COMPRESSED_FILE`` (8; more of ``max_unit_bytes`` in a larger
file), so an epoch, whose unit order is shuffled, decompresses each file about
(8 + 1) / 2 = 4.5 times, and a resume decompresses from the file start to the end
of its unit. benchmarks/json_sources.py measures listing, a resume mid-file and a read
epoch (every document parsed once, units shuffled) per codec (gzip, zstd, bz2) against
plain JSON lines; decompressing is cheap next to tokenizing the same text (see
docs/performance.md).

On remote storage the compressed bytes are read ahead in order (`listing_at_once.InOrder`:
positional reads of ``BLOCK_BYTES``, ``BLOCKS_AHEAD`` in flight) instead of in the codec's
own small reads (``64 << 10`` bytes), a request each; both a read epoch and the listing of
a remote compressed file are faster for it (figures in docs/performance.md).

Content key (fingerprint.py): a hash of the file's last 64 compressed bytes and
where its data ends once decompressed (found by the listing). The tail of a gzip
or bz2 file holds a CRC of the whole content, and so does a zstd file's when it
was written with a checksum (the `zstd` command's default; libraries, pyarrow
among them, leave it out, and then the tail is the last compressed block), so a
rewrite to the same compressed size is caught; it costs one small read at listing.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa

from .files import COMPRESSIONS, OpenFiles, SourceFile
from .listing_at_once import InOrder
from .text_files import LineUnitTable, UnitBytes

#: At most this many units per compressed file (see the module docstring).
UNITS_PER_COMPRESSED_FILE = 8
#: Decompressed bytes read per step when skipping to a unit.
SKIP_BYTES = 8 << 20
#: Compressed bytes at the end of a file that go into its content key.
TAIL_BYTES = 64


def compression_of(path: str) -> Optional[str]:
    """The pyarrow codec name of ``path``'s ending (``"gzip"``, ``"zstd"``, ``"bz2"``), or None."""
    lower = path.lower()
    for ending, codec in COMPRESSIONS.items():
        if lower.endswith(ending):
            return codec
    return None


def check_codec(f: SourceFile, codec: str) -> None:
    if not pa.Codec.is_available(codec):
        raise ValueError(f"{f.uri or f.path} is {codec}-compressed, but this pyarrow ({pa.__version__}) was built "
                         f"without the {codec} codec; install a pyarrow wheel from PyPI (it has gzip, zstd and bz2), "
                         "or decompress the file")


def open_decompressed(f: SourceFile, *, unchanged: bool = False):
    """A stream of ``f``'s decompressed bytes (``f`` must have a compressed ending);
    ``unchanged`` refuses a file whose compressed size is not the listed one."""
    codec = compression_of(f.path)
    check_codec(f, codec)
    raw = f.open_unchanged() if unchanged else f.open()
    if f.fs.type_name != "local":  # the codec's 64 KB reads, a request each: read ahead in order instead
        raw = pa.PythonFile(InOrder(raw, raw.size()), mode="r")
    return pa.CompressedInputStream(raw, codec)  # closing it closes ``raw``


def content_key(f: SourceFile, data_end: int) -> str:
    """The content key of a compressed file whose decompressed data ends at ``data_end`` (see the
    module docstring)."""
    try:
        with f.open() as h:
            h.seek(max(0, h.size() - TAIL_BYTES))
            tail = h.read()
    except OSError as e:
        raise ValueError(f"cannot read {f.uri or f.path}: {e}") from e
    return hashlib.sha256(tail + b"\0" + str(data_end).encode()).hexdigest()[:16]


def merge_units(units: List[Tuple[int, int, int, int]], max_unit_bytes: int) -> List[Tuple[int, int, int, int]]:
    """Consecutive ``(start, end, first_line, rows)`` units of one compressed file joined into
    ``UNITS_PER_COMPRESSED_FILE`` (more when the file is larger than that many ``max_unit_bytes``):
    unit ``i`` joins the group its start falls in, of equal byte ranges; a group that would pass
    ``max_unit_bytes`` starts another. (An array's units have a comma between one's end and the
    next one's start: a merged unit holds it, as a separator.)"""
    if len(units) <= 1:
        return units
    first, total = units[0][0], units[-1][1] - units[0][0]
    groups = max(UNITS_PER_COMPRESSED_FILE, -(-total // max_unit_bytes))
    out: List[List[int]] = []
    for start, end, line, rows in units:
        group = (start - first) * groups // total
        if out and out[-1][4] == group and end - out[-1][0] <= max_unit_bytes:
            out[-1][1], out[-1][3] = end, out[-1][3] + rows
        else:
            out.append([start, end, line, rows, group])
    return [(u[0], u[1], u[2], u[3]) for u in out]


class DecompressedRanges:
    """Reads decompressed byte ranges of compressed files, keeping one stream per file open
    (a few files per worker) at the position it stopped."""

    OPEN_FILES = 4

    def __init__(self, files: List[SourceFile]):
        self.files = files
        self._open = OpenFiles(self.OPEN_FILES)
        self._pos: Dict[int, int] = {}  # file -> decompressed position of its open stream

    def _stream(self, i: int) -> Any:
        self._pos[i] = 0
        return open_decompressed(self.files[i], unchanged=True)

    def read(self, i: int, start: int, end: int) -> bytes:
        if self._pos.get(i, 0) > start:  # behind the stream: start the file over
            self._open.drop(i)
        stream = self._open.get(i, self._stream)
        while self._pos[i] < start:
            got = len(stream.read(min(SKIP_BYTES, start - self._pos[i])))
            if not got:
                break
            self._pos[i] += got
        data = stream.read(end - start) if self._pos[i] == start else b""
        self._pos[i] += len(data)
        return data

    def close(self) -> None:
        self._open.close()


class CompressedUnitBytes(UnitBytes):
    """`UnitBytes` that also reads units of compressed files (decompressed offsets)."""

    def __init__(self, units: LineUnitTable):
        super().__init__(units)
        self._compressed = [compression_of(f.path) is not None for f in units.files]
        self._ranges = DecompressedRanges(units.files)

    def fetchable(self, u: int) -> bool:
        return not self._compressed[int(self.units.file[u])]

    def read(self, u: int) -> bytes:
        if not self._compressed[int(self.units.file[u])]:
            return super().read(u)
        return self._checked(u, self._ranges.read, "decompressed bytes")
