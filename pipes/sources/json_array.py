"""JSON-array files: one ``[{...}, {...}, ...]`` per file, one document per element.

A file like TinyStories' (one array of about 100k objects on one line) is listed
the way a jsonl file is: one streaming pass in ``CHUNK_BYTES`` blocks that never
parses a document, only finds where each top-level element starts. Units are byte
ranges of whole elements (up to ``rows_per_unit`` of them, cut earlier at
``max_unit_bytes``): a unit starts just after the ``[`` or after the comma that
precedes its first element and ends at the comma after its last one (or at the
closing ``]``), so a reader seeks straight to it, finds the commas between its
elements the same way, and parses only the elements it hands out.

Finding the elements, all with numpy over a block, no Python per byte or element:
quotes preceded by an odd run of backslashes are escaped (the runs before quotes are
measured together, one byte back per step); the parity of the
unescaped quotes before a byte says whether it is inside a string, so brackets,
braces and commas inside strings are ignored; the nesting depth is a cumulative
sum over the remaining brackets and braces; the commas at depth 1 separate elements.
Carried across blocks: inside-a-string, the depth, and a trailing run of backslashes
(moved to the next block whole). benchmarks/json_sources.py measures the scan on a
one-line array of stories cut from source code, where quotes, brackets and escaped
newlines are dense, against the jsonl line listing and the reading of the same stories
(see docs/performance.md).

What the scan checks, naming the file, byte offset and line: the array is closed
(not cut off inside a string or with brackets open), is closed by ``]``, and only
whitespace follows it. It does not validate the elements: a malformed one is found
when it is read, and reported with the file, the element's index, byte and line
(``on_error`` decides, as for a bad jsonl line).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .files import SourceFile
from .line_listing import CHUNK_BYTES, _WS, _UnitBuilder, read_blocks

QUOTE, BACKSLASH, COMMA, NEWLINE = 34, 92, 44, 10
OPENERS = (ord("["), ord("{"))


def _unescaped(a: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The quotes at ``q`` that are not escaped: not after an odd run of backslashes. Only quotes
    right after a backslash are looked at; their runs are measured all together, one byte back
    per step (runs are a few bytes long)."""
    prev = q - 1
    cand = np.flatnonzero(a[np.maximum(prev, 0)] == BACKSLASH)
    cand = cand[prev[cand] >= 0]
    if not len(cand):
        return q
    run = np.ones(len(cand), np.int64)
    pos = q[cand] - 2
    active = np.arange(len(cand))
    while len(active):
        p = pos[active]
        more = (p >= 0) & (a[np.maximum(p, 0)] == BACKSLASH)
        active = active[more]
        run[active] += 1
        pos[active] -= 1
    return np.delete(q, cand[run % 2 == 1])


_STEP = np.zeros(256, np.int64)
_STEP[list(OPENERS)] = 1
_STEP[[ord("]"), ord("}")]] = -1


def structure(a: np.ndarray, in_string: bool) -> Tuple[np.ndarray, np.ndarray, bool]:
    """The positions of ``[ ] { } ,`` outside strings in ``a`` (a block that starts inside a string
    when ``in_string``), their nesting steps (+1, -1, 0 for a comma), and whether ``a`` ends inside a
    string. A backslash run must not be cut at the block's start."""
    q = _unescaped(a, np.flatnonzero(a == QUOTE))
    # [ ] { } are 0x5B 0x5D 0x7B 0x7D: | 0x20 folds [ ] onto { }, and { } differ only in bit 1
    s = np.flatnonzero(((((a | 0x20) - 0x7B) & 0xFD) == 0) | (a == COMMA))
    if len(q) or in_string:
        s = s[(np.searchsorted(q, s) + in_string) % 2 == 0]
    return s, _STEP[a[s]], bool((len(q) + in_string) % 2)


def split_elements(data: bytes) -> Tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the elements in a unit's bytes (between its depth-0 commas)."""
    a = np.frombuffer(data, np.uint8)
    s, step, _ = structure(a, False)
    seps = s[(step == 0) & (np.cumsum(step) == 0)]
    return np.concatenate([[0], seps + 1]), np.concatenate([seps, [len(data)]])


def first_byte(f: SourceFile, opener: Callable[[SourceFile], Any]) -> bytes:
    """The first byte of ``f`` that is not whitespace (nor a byte order mark); ``b""`` if none."""
    with opener(f) as h:
        for _, chunk in read_blocks(h, 1 << 16):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1]
    return b""


class ArrayError(ValueError):
    """A JSON-array file that is not one closed array."""


def scan_array(f: SourceFile, opener: Callable[[SourceFile], Any], *, rows_per_unit: int, max_unit_bytes: int
               ) -> Tuple[List[Tuple[int, int, int, int]], Optional[bytes], int]:
    """One pass over a JSON-array file: its units ``(start, end, first_line, rows)``, the bytes of its
    first element (None if the array is empty), and the offset of its closing ``]``."""
    name = f.uri or f.path
    units = _UnitBuilder(rows_per_unit, max_unit_bytes)
    off, line = 0, 1  # of the block's start
    in_string, depth = False, 0
    opened = closed = -1
    first_start = first_line = -1
    first_row: Optional[bytes] = None
    rows_seen = False  # a separator was met: the first element exists
    first_content = False  # a non-whitespace byte between '[' and the first separator or ']'
    pending = b""

    def fail(pos: int, line_no: int, what: str) -> None:
        raise ArrayError(f"{name}: {what} at byte {pos} (line {line_no}); a JSON-array source holds one "
                         "array of objects, [{...}, {...}]: fix the file, or convert it to JSON lines")

    with opener(f) as h:
        for dropped, chunk in read_blocks(h, CHUNK_BYTES):
            off += dropped
            final = not chunk
            buf = pending + chunk if pending else chunk
            n = len(buf)
            if not final:
                while n and buf[n - 1] == BACKSLASH:  # a backslash run is never cut: it moves on whole
                    n -= 1
            pending = buf[n:]
            if not n:
                if final:
                    break
                continue
            a = np.frombuffer(buf, np.uint8, n)
            nl = np.flatnonzero(a == NEWLINE)
            lo = 0
            if closed >= 0:
                rest = np.flatnonzero(~_WS[a])
                if len(rest):
                    p = int(rest[0])
                    fail(off + p, line + int(np.searchsorted(nl, p)),
                         f"more follows the array that closed at byte {closed} ({buf[p:p + 20]!r})")
            elif opened < 0:
                lo = int(np.flatnonzero(~_WS[a])[0]) if (~_WS[a]).any() else len(a)
                if lo == len(a):
                    off, line = off + n, line + len(nl)
                    continue
                if a[lo] != OPENERS[0]:
                    fail(off + lo, line + int(np.searchsorted(nl, lo)), f"{buf[lo:lo + 20]!r} is not a JSON array")
                opened, depth, lo = off + lo, 1, lo + 1
                first_start, first_line = off + lo, line + int(np.searchsorted(nl, lo))
            if closed < 0:
                s, step, ends_in_string = structure(a[lo:], in_string)
                s = s + lo
                after = depth + np.cumsum(step)
                shut = np.flatnonzero(after == 0)
                if len(shut):
                    c = int(shut[0])
                    p = int(s[c])
                    if a[p] != ord("]"):
                        fail(off + p, line + int(np.searchsorted(nl, p)),
                             f"{chr(a[p])!r} closes the array opened at byte {opened}")
                    tail = np.flatnonzero(~_WS[a[p + 1:]])
                    if len(tail):
                        q = p + 1 + int(tail[0])
                        fail(off + q, line + int(np.searchsorted(nl, q)),
                             f"more follows the array that closed at byte {off + p} ({buf[q:q + 20]!r})")
                    closed, s, step, after, hi = off + p, s[:c], step[:c], after[:c], p
                else:
                    in_string, depth, hi = ends_in_string, int(after[-1]) if len(after) else depth, len(a)
                seps = s[(step == 0) & (after == 1)]
                if not rows_seen:
                    stop = int(seps[0]) if len(seps) else hi
                    first_content = first_content or bool((~_WS[a[lo:stop]]).any())
                    if len(seps) or (closed >= 0 and first_content):
                        rows_seen = True
                        units.add(np.array([first_start]), np.array([first_line]))
                if len(seps):
                    units.add(off + seps + 1, line + np.searchsorted(nl, seps + 1))
                if first_row is None and rows_seen:
                    end = int(seps[0]) if len(seps) else hi
                    if first_start >= off:  # the first element starts in this block
                        first_row = buf[first_start - off:end][:1 << 20]
            off, line = off + n, line + len(nl)
            if final:
                break
    if opened < 0:
        return [], None, off  # nothing but whitespace
    if closed < 0:
        inside = "inside a string" if in_string else f"with {depth} bracket(s) or brace(s) open"
        fail(off, line, f"the file ends {inside}: the array opened at byte {opened} is cut off")
    found = units.finish(closed)
    # a unit ends at the comma before the next unit's first element
    fixed = [(s0, nxt[0] - 1, ln, rows) for (s0, _, ln, rows), nxt in zip(found, found[1:])]
    return fixed + found[-1:], first_row, closed
