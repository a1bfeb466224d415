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
    scan = _ArrayScan(f.uri or f.path, rows_per_unit, max_unit_bytes)
    pending = b""
    with opener(f) as h:
        for dropped, chunk in read_blocks(h, CHUNK_BYTES):
            scan.off += dropped
            final = not chunk
            buf = pending + chunk if pending else chunk
            n = len(buf)
            if not final:
                while n and buf[n - 1] == BACKSLASH:  # a backslash run is never cut: it moves on whole
                    n -= 1
            pending = buf[n:]
            if n:
                scan.block(buf, n)
            if final:
                break
    return scan.finish()


class _ArrayScan:
    """The state `scan_array` carries from block to block: where the block starts (byte and line),
    inside-a-string and the depth, where the array opened and closed, and its first element."""

    def __init__(self, name: str, rows_per_unit: int, max_unit_bytes: int):
        self.name = name
        self.units = _UnitBuilder(rows_per_unit, max_unit_bytes)
        self.off, self.line = 0, 1  # of the block's start
        self.in_string, self.depth = False, 0
        self.opened = self.closed = -1
        self.first_start = self.first_line = -1
        self.first_row: Optional[bytes] = None
        self.rows_seen = False  # a separator was met: the first element exists
        self.first_content = False  # a non-whitespace byte between '[' and the first separator or ']'

    def fail(self, pos: int, line_no: int, what: str) -> None:
        """Refuse the file: ``what`` is wrong at byte ``pos`` (line ``line_no``)."""
        raise ArrayError(f"{self.name}: {what} at byte {pos} (line {line_no}); a JSON-array source holds one "
                         "array of objects, [{...}, {...}]: fix the file, or convert it to JSON lines")

    def line_at(self, nl: np.ndarray, p: int) -> int:
        """The line of byte ``p`` of the block whose newlines are at ``nl``."""
        return self.line + int(np.searchsorted(nl, p))

    def block(self, buf: bytes, n: int) -> None:
        """Scan the first ``n`` bytes of ``buf`` (a block that cuts no backslash run), then move past them."""
        a = np.frombuffer(buf, np.uint8, n)
        nl = np.flatnonzero(a == NEWLINE)
        lo = 0
        if self.closed >= 0:
            self.nothing_after(a, buf, nl)
        elif self.opened < 0:
            lo = self.open_array(a, buf, nl)
        if self.closed < 0 and self.opened >= 0:  # not before the array, nor after it
            self.elements(a, buf, nl, lo)
        self.off, self.line = self.off + n, self.line + len(nl)

    def nothing_after(self, a: np.ndarray, buf: bytes, nl: np.ndarray) -> None:
        """Refuse a block after the closed array that holds more than whitespace."""
        rest = np.flatnonzero(~_WS[a])
        if len(rest):
            p = int(rest[0])
            self.fail(self.off + p, self.line_at(nl, p),
                      f"more follows the array that closed at byte {self.closed} ({buf[p:p + 20]!r})")

    def open_array(self, a: np.ndarray, buf: bytes, nl: np.ndarray) -> int:
        """Find the ``[`` that opens the array (refusing anything else) and return where its first element
        may start; the array stays unopened when the block is whitespace only."""
        lo = int(np.flatnonzero(~_WS[a])[0]) if (~_WS[a]).any() else len(a)
        if lo == len(a):
            return lo
        if a[lo] != OPENERS[0]:
            self.fail(self.off + lo, self.line_at(nl, lo), f"{buf[lo:lo + 20]!r} is not a JSON array")
        self.opened, self.depth, lo = self.off + lo, 1, lo + 1
        self.first_start, self.first_line = self.off + lo, self.line_at(nl, lo)
        return lo

    def elements(self, a: np.ndarray, buf: bytes, nl: np.ndarray, lo: int) -> None:
        """Find the separators between the elements from byte ``lo`` of the block on (and the array's
        closing ``]`` when it is in the block): a unit may start after each."""
        s, step, ends_in_string = structure(a[lo:], self.in_string)
        s = s + lo
        after = self.depth + np.cumsum(step)
        shut = np.flatnonzero(after == 0)
        if len(shut):
            c = int(shut[0])
            p = int(s[c])
            self.check_close(a, buf, nl, p)
            self.closed, s, step, after, hi = self.off + p, s[:c], step[:c], after[:c], p
        else:
            self.in_string, self.depth, hi = ends_in_string, int(after[-1]) if len(after) else self.depth, len(a)
        seps = s[(step == 0) & (after == 1)]
        self.first_element(a, buf, lo, hi, seps)
        if len(seps):
            self.units.add(self.off + seps + 1, self.line + np.searchsorted(nl, seps + 1))

    def check_close(self, a: np.ndarray, buf: bytes, nl: np.ndarray, p: int) -> None:
        """Refuse an array closed at byte ``p`` of the block by other than ``]``, or followed by more than
        whitespace in the block."""
        if a[p] != ord("]"):
            self.fail(self.off + p, self.line_at(nl, p), f"{chr(a[p])!r} closes the array opened at byte {self.opened}")
        tail = np.flatnonzero(~_WS[a[p + 1:]])
        if len(tail):
            q = p + 1 + int(tail[0])
            self.fail(self.off + q, self.line_at(nl, q),
                      f"more follows the array that closed at byte {self.off + p} ({buf[q:q + 20]!r})")

    def first_element(self, a: np.ndarray, buf: bytes, lo: int, hi: int, seps: np.ndarray) -> None:
        """Start the first unit once the first element is known to exist (a separator follows it, or it
        holds more than whitespace before the ``]``), and keep its bytes when it starts in this block."""
        if not self.rows_seen:
            stop = int(seps[0]) if len(seps) else hi
            self.first_content = self.first_content or bool((~_WS[a[lo:stop]]).any())
            if len(seps) or (self.closed >= 0 and self.first_content):
                self.rows_seen = True
                self.units.add(np.array([self.first_start]), np.array([self.first_line]))
        if self.first_row is None and self.rows_seen:
            end = int(seps[0]) if len(seps) else hi
            if self.first_start >= self.off:  # the first element starts in this block
                self.first_row = buf[self.first_start - self.off:end][:1 << 20]

    def finish(self) -> Tuple[List[Tuple[int, int, int, int]], Optional[bytes], int]:
        """`scan_array`'s result at the file's end, refusing an array that was cut off."""
        if self.opened < 0:
            return [], None, self.off  # nothing but whitespace
        if self.closed < 0:
            inside = "inside a string" if self.in_string else f"with {self.depth} bracket(s) or brace(s) open"
            self.fail(self.off, self.line, f"the file ends {inside}: the array opened at byte {self.opened} is cut off")
        found = self.units.finish(self.closed)
        # a unit ends at the comma before the next unit's first element
        fixed = [(s0, nxt[0] - 1, ln, rows) for (s0, _, ln, rows), nxt in zip(found, found[1:])]
        return fixed + found[-1:], self.first_row, self.closed
