"""JSON-lines sources: one JSON object per line, one document per object.

Listing is the line listing of `text_files` (one numpy pass per file, ~1.1 GB/s):
units of up to ``rows_per_unit`` non-blank lines, each recorded with its byte
range and first line number, so a reader seeks straight to a unit. Blank
(empty or whitespace-only) lines are not documents: listing leaves them out of
the rows and counts them in ``table.blank_lines``. The first record of each
file is parsed at listing, so a wrong field name fails in the calling process
with the keys the file does have, before any worker starts.

Reading loads one unit's bytes, splits them into lines, and parses only the
lines it hands out. ``json.loads`` per document dominates: ~140k docs/s (180 MB/s)
for 1.3 KB documents on this machine, 0.85x a bare ``for line in f: json.loads(line)``
loop over the same file in the same run. The state is the `UnitCursor` position (sharder state
at the slice start + rows handed out) plus the count of skipped lines.

Bad lines, and what happens to them (the location is always the file and the
1-based line number in that file):

- malformed JSON, invalid UTF-8, a line that is not an object, a missing field,
  a value of the wrong type (``require_type``): ``on_error="raise"`` (default)
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
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..base import Node
from ..items import Doc
from ..shard import ShardUnits, WorkSlice
from .files import SourceFile
from .text_files import MAX_UNIT_BYTES, LineUnitTable, UnitBytes, UnitCursor, list_line_units

log = logging.getLogger(__name__)

POLICIES = ("raise", "skip")
_DECODER = json.JSONDecoder()  # json.loads minus its per-call argument checks

# What to do about each kind of bad line, appended to the error.
_HINTS = {
    "malformed": "Fix or remove the line, or pass on_error='skip' to skip bad lines (counted as 'skipped' "
                 "in the reader's state)",
    "not_object": "Every line must be one JSON object ({...}); a .json file holding a single array must be "
                  "converted to JSON lines first. Or pass on_error='skip'",
    "missing": "Pass field= (in recipes: text_column= for pretrain, messages_field= for sft) naming one of the "
               "keys, or on_error='skip' to skip such lines",
    "type": "Pass require_type= matching the data, or on_error='skip' to skip such lines",
    "null": "Pass on_null='skip' to skip null values (counted as 'skipped' in the reader's state)",
}


def jsonl_field(line: bytes, field: str, require_type: Optional[Union[type, Tuple[type, ...]]] = None
                ) -> Tuple[Any, Optional[Tuple[str, str]]]:
    """``(value, None)``, or ``(None, (kind, what is wrong))`` for a bad line."""
    try:
        obj = _DECODER.decode(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, ("malformed", f"invalid UTF-8 at byte {e.start} of the line ({line[e.start:e.start + 8]!r})")
    except json.JSONDecodeError as e:
        return None, ("malformed", f"malformed JSON: {e.msg} at column {e.colno} ({line[:80]!r})")
    if not isinstance(obj, dict):
        return None, ("not_object", f"the line holds a JSON {type(obj).__name__}, not an object ({line[:80]!r})")
    if field not in obj:
        keys = sorted(obj)
        return None, ("missing", f"no field {field!r}; the line has keys {keys[:20]}{' ...' if len(keys) > 20 else ''}")
    value = obj[field]
    if value is None:
        return None, ("null", f"field {field!r} is null")
    if require_type is not None and not isinstance(value, require_type):
        want = getattr(require_type, "__name__", None) or [t.__name__ for t in require_type]
        return None, ("type", f"field {field!r} holds a {type(value).__name__}, expected {want}")
    return value, None


def list_jsonl_units(files: Sequence[SourceFile], *, field: Optional[str] = "text", rows_per_unit: int = 1000,
                     max_unit_bytes: int = MAX_UNIT_BYTES) -> LineUnitTable:
    """Units of up to ``rows_per_unit`` non-blank lines (and ``max_unit_bytes``) per file.

    The first record of each file must hold ``field`` when it is a JSON object (a
    malformed first line is left to the reader and its ``on_error``); ``field=None``
    lists without looking. A file whose first record starts with ``[`` is a JSON
    array (one document for the whole file, or lines of arrays), refused here in one
    line instead of as a malformed line somewhere in the middle.
    """
    def inspect(f: SourceFile, first: bytes) -> None:
        if first.lstrip()[:1] == b"[":
            raise ValueError(f"{f.uri or f.path} holds a JSON array (its first record starts with '['), but a jsonl "
                             "source needs JSON lines, one object per line; convert it, e.g. `jq -c '.[]' "
                             "in.json > out.jsonl`")
        if field is None:
            return
        _, problem = jsonl_field(first, field)
        if problem is not None and problem[0] == "missing":
            raise ValueError(f"{f.uri or f.path}, first record: {problem[1]}. Pass field= (text_column= in "
                             "recipes) naming one of them; if only some records lack it, pass field=None here "
                             "to list without this check and on_error='skip' to the reader")

    return list_line_units(files, kind="lines", rows_per_unit=rows_per_unit, max_unit_bytes=max_unit_bytes,
                           inspect=inspect)


class ReadJsonl(Node[Doc]):
    """Reads ``field`` of every JSON line of the slices a `ShardUnits` node emits:
    ``Doc(value, source, unit, row)`` with ``row`` the line's index among the unit's
    non-blank lines, in file order. See the module docstring for bad lines."""

    PARENT = "parent"
    ROW = "row"
    SKIPPED = "skipped"
    STATE_KEYS = (PARENT, ROW, SKIPPED)

    def __init__(self, parent: ShardUnits, units: LineUnitTable, *, field: str = "text", source: str = "",
                 seed: int = 0, shuffle_rows: bool = True, on_error: str = "raise", on_null: str = "skip",
                 require_type: Optional[Union[type, Tuple[type, ...]]] = None):
        super().__init__()
        if units.kind != "lines":
            raise ValueError(f"ReadJsonl reads units listed by list_jsonl_units, got kind {units.kind!r}")
        if on_error not in POLICIES or on_null not in POLICIES:
            raise ValueError(f"{on_error=} and {on_null=} must each be one of {POLICIES}")
        self.units, self.field, self.source = units, field, source
        self.on_error, self.on_null, self.require_type = on_error, on_null, require_type
        self._bytes = UnitBytes(units)
        self._lines: List[bytes] = []
        self._keep: List[int] = []
        self._skipped = 0
        self._warned: set = set()
        self._cursor = UnitCursor(parent, self._load, seed=seed, shuffle_rows=shuffle_rows)

    def _load(self, s: WorkSlice) -> int:
        self._lines = self._bytes.read(s.unit).split(b"\n")
        # the listing's blank test, on bytes: isspace() is ASCII whitespace
        self._keep = [i for i, line in enumerate(self._lines) if line and not line.isspace()]
        self._bytes.check_rows(s.unit, len(self._keep))
        return len(self._keep)

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._lines, self._keep = [], []
        if initial_state is None:
            self._cursor.reset(None, 0)
            self._skipped = 0
        else:
            self._cursor.reset(initial_state[self.PARENT], initial_state[self.ROW])
            self._skipped = int(initial_state[self.SKIPPED])

    def next(self) -> Doc:
        while True:
            s, row = self._cursor.next()
            i = self._keep[row]
            value, problem = jsonl_field(self._lines[i], self.field, self.require_type)
            if problem is None:
                return Doc(value, self.source, s.unit, row, s.epoch, self._cursor.last_pos(), s.used)
            kind, what = problem
            where = f"{self.units.path(s.unit)}, line {int(self.units.first_line[s.unit]) + i}"
            if (self.on_null if kind == "null" else self.on_error) == "raise":
                raise ValueError(f"{where}: {what}. {_HINTS[kind]}")
            self._skipped += 1
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("skipping line at %s: %s (further %s lines are counted in the reader state as "
                            "'skipped', not logged)", where, what, kind)

    @property
    def skipped(self) -> int:
        """Rows skipped so far (restored with the state); recipes show it in ``loader.stats()``."""
        return self._skipped

    def unread(self, upto_epoch: int) -> List["WorkSlice"]:
        return self._cursor.unread(upto_epoch)

    def next_epoch(self) -> int:
        return self._cursor.next_epoch()

    def carry_skipped(self, skipped: int) -> None:
        """Continue the skipped count of an elastic resume (elastic.py)."""
        self._skipped = int(skipped)

    def get_state(self) -> Dict[str, Any]:
        parent, row = self._cursor.position()
        return {self.PARENT: parent, self.ROW: row, self.SKIPPED: self._skipped}
