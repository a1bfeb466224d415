"""JSON sources: one JSON object per line (jsonl), or one JSON array of objects per file
(json_array.py), plain or compressed (compressed.py); one document per object.

Each file is looked at once at listing: a file whose first non-whitespace byte is
``[`` is an array, any other is JSON lines, and a file that is neither (its first
line a JSON value that is not an object, or one that goes on past the line, as a
pretty-printed object does) is refused in one line naming it. A source may mix
the two layouts and compressed and plain files.

Listing is the line listing of `text_files` (one numpy pass per file, line_listing.py):
units of up to ``rows_per_unit`` non-blank lines, each recorded with its byte
range and first line number, so a reader seeks straight to a unit. Blank
(empty or whitespace-only) lines are not documents: listing leaves them out of
the rows and counts them in ``table.blank_lines``. The first record of each
file is parsed at listing, so a wrong field name fails in the calling process
with the keys the file does have, before any worker starts.

Reading loads one unit's bytes, splits them into lines, and parses only the
lines it hands out. Parsing each document (``json.loads``' decoder) dominates the
cost of reading; docs/performance.md sets it against a bare ``for line in f:
json.loads(line)`` loop over the same file. The state is the `UnitCursor`
position (sharder state at the slice start + rows handed out) plus the count of skipped lines.

Bad lines, and what happens to them (the location is always the file and the
1-based line number in that file; for an array element, its index in the file,
its byte offset and line):

- malformed JSON, invalid UTF-8, a line that is not an object, a missing field,
  a value of the wrong type (``require_type``; a list of messages where text is
  wanted is told as a conversation, for the sft recipe): ``on_error="raise"`` (default)
  stops with the file, line and the fix, because a corrupt file usually means a
  broken export that should be fixed, not silently trained around;
  ``on_error="skip"`` skips them.
- a null value (``{"text": null}``): ``on_null="skip"`` (default) skips it, as
  the parquet reader skips null rows: a null is a valid record that has no
  document, not a corrupt file. ``on_null="raise"`` stops instead.

Skipped lines are counted in the reader's state (``skipped``) and logged once
per worker and kind with file and line, so they are never lost silently.

``Doc.text`` is the field's value as parsed: a ``str`` for text sources, and
whatever JSON holds otherwise, e.g. the list of ``{"role", "content"}`` dicts
under ``"messages"`` for conversations. Pass ``require_type=str`` (or ``list``)
to have other values treated as bad lines.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..base import Node
from ..items import Doc
from ..shard import ShardUnits, WorkSlice
from .compressed import CompressedUnitBytes, compression_of, content_key, merge_units, open_decompressed
from .files import SourceFile, sft_advice
from .listing_at_once import KeptBytes, blocks_at_once, each_file, first_byte_of, in_memory, pool_for
from .json_array import first_byte, scan_array, split_elements
from .line_listing import KEEP_OPEN, MAX_UNIT_BYTES, scan_blocks, scan_file, unit_columns
from .text_files import CursorReader, LineUnitTable, SkipCount, UnitCursor

log = logging.getLogger(__name__)

POLICIES = ("raise", "skip")
_DECODER = json.JSONDecoder()  # json.loads minus its per-call argument checks
_JSON_WS = b" \t\n\r"

# What to do about each kind of bad line, appended to the error.
_HINTS = {
    "malformed": "Fix or remove the line, or pass on_error='skip' to skip bad lines (counted as 'skipped' "
                 "in the reader's state)",
    "not_object": "Every line (or array element) must be one JSON object ({...}); or pass on_error='skip'",
    "missing": "Pass field= (in recipes: text_column= for pretrain, messages_field= for sft) naming one of the "
               "keys, or on_error='skip' to skip such lines",
    "type": "Pass field= (in recipes: text_column= for pretrain, messages_field= for sft) naming a field that "
            "holds that type, or on_error='skip' to skip such lines",
    "conversation": "A list of messages is a conversation: to train on conversations use {sft}; for text, pass "
                    "field= (in recipes: text_column= for pretrain, messages_field= for sft) naming a text field, "
                    "or on_error='skip' to skip such lines",
    "null": "Pass on_null='skip' to skip null values (counted as 'skipped' in the reader's state)",
}


def _hint(kind: str, field: str) -> str:
    return _HINTS[kind].format(sft=sft_advice(field)) if kind == "conversation" else _HINTS[kind]


def _is_conversation(value: Any) -> bool:
    """A list of JSON objects (messages), as a chat record holds."""
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _wants_text(require_type: Optional[Union[type, Tuple[type, ...]]]) -> bool:
    """``require_type`` takes strings and not lists: a text recipe's."""
    types = require_type if isinstance(require_type, tuple) else (require_type,)
    return str in types and list not in types


def jsonl_field(line: bytes, field: str, require_type: Optional[Union[type, Tuple[type, ...]]] = None,
                record: str = "line") -> Tuple[Any, Optional[Tuple[str, str]]]:
    """``(value, None)``, or ``(None, (kind, what is wrong))`` for a bad line (``record``: what to call it)."""
    try:
        obj = _DECODER.decode(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, ("malformed", f"invalid UTF-8 at byte {e.start} of the {record} ({line[e.start:e.start + 8]!r})")
    except json.JSONDecodeError as e:
        where = f"column {e.colno}" if record == "line" else f"line {e.lineno} column {e.colno} of the element"
        # json says where some errors begin in the message itself ("Unterminated string starting at")
        at = "" if e.msg.endswith(" at") else " at"
        return None, ("malformed", f"malformed JSON: {e.msg}{at} {where} ({line.strip()[:80]!r})")
    if not isinstance(obj, dict):
        return None, ("not_object", f"the {record} holds a JSON {type(obj).__name__}, not an object "
                                    f"({line.strip()[:80]!r})")
    if field not in obj:
        keys = sorted(obj)
        more = " ..." if len(keys) > 20 else ""
        return None, ("missing", f"no field {field!r}; the {record} has keys {keys[:20]}{more}")
    value = obj[field]
    if value is None:
        return None, ("null", f"field {field!r} is null")
    if require_type is not None and not isinstance(value, require_type):
        want = getattr(require_type, "__name__", None) or [t.__name__ for t in require_type]
        kind = "conversation" if _wants_text(require_type) and _is_conversation(value) else "type"
        got = type(value).__name__
        return None, (kind, f"field {field!r} holds {'an' if got[0] in 'aeiou' else 'a'} {got}, expected {want}")
    return value, None


@dataclass
class JsonUnitTable(LineUnitTable):
    """A `LineUnitTable` whose files are JSON lines or JSON arrays: ``arrays[i]`` says which
    file is an array (its units are ranges of elements, ``first_line`` the line of the first)."""

    arrays: Optional[np.ndarray] = None

    def is_array(self, unit: int) -> bool:
        return self.arrays is not None and bool(self.arrays[int(self.file[unit])])


def _neither(first: bytes) -> Optional[str]:
    """Why a file whose first record is ``first`` is neither JSON lines nor an array (None: it may be)."""
    try:
        text = first.decode("utf-8")
        obj = _DECODER.decode(text)
    except UnicodeDecodeError:
        return None  # a bad line: the reader and its on_error
    except json.JSONDecodeError as e:
        if e.pos < len(text.rstrip()):
            return None  # broken inside the line: a bad line
        return (f"its first line {text.strip()[:60]!r} ends before the JSON value it starts does (one object "
                "over several lines, as pretty-printed JSON is?)")
    if isinstance(obj, dict):
        return None
    return f"its first record is a JSON {type(obj).__name__} ({text.strip()[:60]!r}), not an object"


def list_jsonl_units(files: Sequence[SourceFile], *, field: Optional[str] = "text", rows_per_unit: int = 1000,
                     max_unit_bytes: int = MAX_UNIT_BYTES,
                     require_type: Optional[Union[type, Tuple[type, ...]]] = None) -> JsonUnitTable:
    """Units of up to ``rows_per_unit`` non-blank lines or array elements (and ``max_unit_bytes``)
    per file; a compressed file's merged into a few (compressed.py).

    The first record of each file must hold ``field`` when it is a JSON object (a
    malformed first line is left to the reader and its ``on_error``); ``field=None``
    lists without looking. A file that is neither JSON lines nor one JSON array is
    refused here in one line instead of as a malformed line somewhere in the middle.
    When ``require_type`` wants text (str, not list), a first record whose field holds a
    conversation (a list of messages) is refused here too, and a missing field's error
    names a field of the record that holds one: both point to the sft recipe.
    """
    if rows_per_unit < 1:
        raise ValueError(f"{rows_per_unit=} must be >= 1")
    if max_unit_bytes < 1:
        raise ValueError(f"{max_unit_bytes=} must be >= 1")
    pool = pool_for(files)  # remote files at once, each file's blocks at once (listing_at_once.py)
    keep = pool is not None and len(files) <= KEEP_OPEN
    budget = KeptBytes()
    results: Any = each_file(lambda f: _scan(f, pool, keep, budget, rows_per_unit, max_unit_bytes), files)
    handles: Dict[int, Any] = {}
    if keep:  # remote: every file is scanned whatever the first error, so every handle kept is seen here
        results = list(results)
        handles = {i: got[-1] for i, got in enumerate(results)
                   if not isinstance(got, Exception) and got[-1] is not None}
    check = partial(_check_first_record, field=field, require_type=require_type)
    try:
        table = _table(files, results, check, max_unit_bytes)
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    table.handles = handles or None
    return table


def _check_first_record(f: SourceFile, first: bytes, record: str, field: Optional[str],
                        require_type: Optional[Union[type, Tuple[type, ...]]]) -> None:
    """Refuse a file whose first record (a ``record``: line or element) shows it is neither layout,
    lacks ``field`` or holds a conversation where text is wanted (see `list_jsonl_units`)."""
    if record == "line":
        why = _neither(first)
        if why is not None:
            raise ValueError(f"{f.uri or f.path} is neither JSON lines nor a JSON array: {why}; a JSON source "
                             "holds one object per line, or one array of objects, [{...}, {...}]")
    if field is None:
        return
    _, problem = jsonl_field(first, field, require_type, record=record)
    if problem is not None and problem[0] == "missing":
        chats = [k for k, v in _DECODER.decode(first.decode("utf-8")).items() if _is_conversation(v) and v] \
            if _wants_text(require_type) else []
        chats.sort(key=lambda k: k != "messages")  # sft's default first
        sft = (f"; or, as its field {chats[0]!r} holds a list of messages (a conversation), train on it with "
               f"{sft_advice(chats[0])}") if chats else ""
        raise ValueError(f"{f.uri or f.path}, first record: {problem[1]}. Pass field= (text_column= in "
                         "recipes) naming one of them; if only some records lack it, pass field=None here "
                         "to list without this check and on_error='skip' to the reader" + sft)
    if problem is not None and problem[0] == "conversation":
        raise ValueError(f"{f.uri or f.path}, first record: {problem[1]}. A list of messages is a "
                         f"conversation: to train on conversations use {sft_advice(field)}; for text, pass "
                         "field= (text_column= in recipes) naming a text field")


def _scan(f: SourceFile, pool: Any, keep: bool, budget: KeptBytes, rows_per_unit: int, max_unit_bytes: int
          ) -> tuple:
    """One file's listing: ``(compressed, array, units, blank lines, first record, size, kept handle)``."""
    compressed = compression_of(f.path) is not None
    try:
        if pool is not None and not compressed:  # remote: one open, its first reads tell an array apart
            got = _scan_remote_lines(f, pool, keep, budget, rows_per_unit, max_unit_bytes)
            if got is not None:
                return got
        return _scan_by_layout(f, compressed, pool, rows_per_unit, max_unit_bytes)
    except OSError as e:
        raise ValueError(f"cannot read {f.uri or f.path}: {e}") from e


def _scan_remote_lines(f: SourceFile, pool: Any, keep: bool, budget: KeptBytes, rows_per_unit: int,
                       max_unit_bytes: int) -> Optional[tuple]:
    """`_scan` of a remote plain file in one open when it is JSON lines, its handle kept when ``keep``
    (its bytes too, within ``budget``); None when it is an array."""
    handle, kept = f.open(), None
    try:
        size = handle.size()
        raw: Optional[list] = [] if keep and budget.reserve(size) else None
        blocks = blocks_at_once(handle, size, pool, keep=raw)
        try:
            head, again = first_byte_of(blocks)
            if head != b"[":
                found, blank, first = scan_blocks(again, paragraphs=False, rows_per_unit=rows_per_unit,
                                                  max_unit_bytes=max_unit_bytes)
        finally:
            blocks.close()  # reads in flight end before the handle closes
        if head == b"[":
            return None
        if keep:  # the first fetches read its units with it (from memory when the budget kept it)
            kept = handle if raw is None else in_memory(handle, raw, size)
        return False, False, found, blank, first, found[-1][1] if found else 0, kept
    finally:
        if kept is None:
            handle.close()


def _scan_by_layout(f: SourceFile, compressed: bool, pool: Any, rows_per_unit: int, max_unit_bytes: int) -> tuple:
    """`_scan` of a file looked at first for its layout: a JSON array's elements, or its lines."""
    opener = open_decompressed if compressed else SourceFile.open
    array = first_byte(f, opener) == b"["
    if array:
        found, first, size = scan_array(f, opener, rows_per_unit=rows_per_unit, max_unit_bytes=max_unit_bytes)
        blank = 0
    else:
        found, blank, first = scan_file(f, paragraphs=False, rows_per_unit=rows_per_unit,
                                        max_unit_bytes=max_unit_bytes, opener=opener,
                                        pool=None if compressed else pool)
        size = found[-1][1] if found else 0  # where the last line ends
    return compressed, array, found, blank, first, size, None


def _table(files: Sequence[SourceFile], results: Sequence[Any], inspect: Callable[[SourceFile, bytes, str], None],
           max_unit_bytes: int) -> "JsonUnitTable":
    """The units of ``files`` from each one's scan (or the error it raised: the first in file order is raised)."""
    listed, per_file, arrays, blanks = [], [], [], 0
    for f, got in zip(files, results):
        if isinstance(got, Exception):
            raise got
        compressed, array, found, blank, first, size, _ = got
        blanks += blank
        if first is not None:
            inspect(f, first, "element" if array else "line")
        if compressed:
            found = merge_units(found, max_unit_bytes)
            f = replace(f, key=content_key(f, size), mtime_ns=None)  # keyed: a copy's new mtime says nothing
        listed.append(f)
        per_file.append(found)
        arrays.append(array)
    return JsonUnitTable(listed, *unit_columns(per_file), "lines", blanks, np.asarray(arrays, bool))


class ReadJsonl(CursorReader, SkipCount, Node[Doc]):
    """Reads ``field`` of every JSON line (or array element) of the slices a `ShardUnits` node
    emits: ``Doc(value, source, unit, row)`` with ``row`` the record's index among the unit's
    non-blank lines (or elements), in file order. See the module docstring for bad lines.

    Args:
        parent: the `ShardUnits` node whose slices this reader reads.
        units: the source's units from `list_jsonl_units` (kind ``"lines"``; a `JsonUnitTable`
            says which files are JSON arrays).
        field: the key whose value is the document (``Doc.text``).
        source: the source's name (``Doc.source``, and in messages).
        seed: seeds the row permutation per (epoch, unit).
        shuffle_rows: False: records in file order (what a token cache is built from).
        on_error: ``"raise"`` (default) or ``"skip"`` a bad line: malformed JSON, invalid UTF-8,
            not an object, a missing field, a value of the wrong type.
        on_null: ``"skip"`` (default) or ``"raise"`` a null value.
        require_type: the type (or types) the value must have, e.g. ``str`` or ``list``; None: any.

    State keys: ``PARENT`` (the sharder's state at the start of the current slice), ``ROW``
    (records of that slice handed out, skipped ones included; a restore reads the unit again and
    skips them) and ``SKIPPED`` (bad and null lines skipped so far).
    """

    PARENT = "parent"
    ROW = "row"
    SKIPPED = "skipped"
    STATE_KEYS = (PARENT, ROW, SKIPPED)

    def __init__(self, parent: ShardUnits, units: LineUnitTable, *, field: str = "text", source: str = "",
                 seed: int = 0, shuffle_rows: bool = True, on_error: str = "raise", on_null: str = "skip",
                 require_type: Optional[Union[type, Tuple[type, ...]]] = None):
        super().__init__(parent)
        if units.kind != "lines":
            raise ValueError(f"ReadJsonl reads units listed by list_jsonl_units, got kind {units.kind!r}")
        if on_error not in POLICIES or on_null not in POLICIES:
            raise ValueError(f"{on_error=} and {on_null=} must each be one of {POLICIES}")
        self.units, self.field, self.source = units, field, source
        self.on_error, self.on_null, self.require_type = on_error, on_null, require_type
        self._bytes = CompressedUnitBytes(units)
        self._lines: List[bytes] = []
        self._keep: List[int] = []
        # an array unit: its bytes and where its elements start and end (sliced when handed out)
        self._data, self._starts, self._ends = b"", [], []
        self._skipped = 0
        self._warned: set = set()
        self._cursor = UnitCursor(parent, self._load, seed=seed, shuffle_rows=shuffle_rows)

    def _is_array(self, u: int) -> bool:
        return isinstance(self.units, JsonUnitTable) and self.units.is_array(u)

    def _load(self, s: WorkSlice) -> int:
        data = self._bytes.read(s.unit)
        if self._is_array(s.unit):
            starts, ends = split_elements(data)
            self._data, self._starts, self._ends = data, starts.tolist(), ends.tolist()
            self._lines, self._keep = [], range(len(self._starts))
        else:
            self._data, self._starts, self._ends = b"", [], []
            self._lines = data.split(b"\n")
            # the listing's blank test, on bytes: isspace() is ASCII whitespace
            self._keep = [i for i, line in enumerate(self._lines) if line and not line.isspace()]
        self._bytes.check_rows(s.unit, len(self._keep))
        return len(self._keep)

    def _where(self, u: int, i: int) -> str:
        """Where line (or element) ``i`` of unit ``u`` is, for a message."""
        t = self.units
        if not self._is_array(u):
            return f"{t.path(u)}, line {int(t.first_line[u]) + i}"
        piece = self._data[self._starts[i]:self._ends[i]]
        rel = self._starts[i] + len(piece) - len(piece.lstrip(_JSON_WS))
        before = int(t.rows[:u][t.file[:u] == t.file[u]].sum())
        line = int(t.first_line[u]) + self._data.count(b"\n", 0, rel)
        of = " of the decompressed data" if compression_of(t.path(u)) else ""
        return f"{t.path(u)}, element {before + i} (byte {int(t.start[u]) + rel}{of}, line {line})"

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._lines, self._keep = [], []
        self._data, self._starts, self._ends = b"", [], []
        self._restore_position(initial_state)
        self._bytes.plan_from(self._cursor.parent)

    def readahead_stats(self) -> Optional[Dict[str, Any]]:
        return self._bytes.readahead_stats()

    def next(self) -> Doc:
        while True:
            s, row = self._cursor.next()
            i = self._keep[row]
            if self._starts:  # stripped, so a parse error's line and column count from the element's start
                value, problem = jsonl_field(self._data[self._starts[i]:self._ends[i]].strip(_JSON_WS), self.field,
                                             self.require_type, "element")
            else:
                value, problem = jsonl_field(self._lines[i], self.field, self.require_type)
            if problem is None:
                return Doc(value, self.source, s.unit, row, s.epoch, self._cursor.last_pos(), s.used)
            kind, what = problem
            where = self._where(s.unit, i)
            if (self.on_null if kind == "null" else self.on_error) == "raise":
                raise ValueError(f"{where}: {what}. {_hint(kind, self.field)}")
            self._skipped += 1
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("skipping line at %s: %s (further %s lines are counted in the reader state as "
                            "'skipped', not logged)", where, what, kind)

    def get_state(self) -> Dict[str, Any]:
        return self._position_state()
