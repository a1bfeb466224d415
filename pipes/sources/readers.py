"""One source, any format: resolve the files, list the work units, and build the reader.

`plan_source` runs once in the process that builds the loader (so a missing file,
a missing column or an unreadable footer fails before any worker starts) and
returns a small picklable `SourcePlan`; inside each worker
``plan.reader(shard_node)`` builds the right reader for the shard.

Parquet footers come from the source's index when `tokenloom index` wrote one
(see manifest.py). A source whose files hold no rows at all is an error naming
its files; empty files among others contribute nothing.

The format comes from the file endings (``.parquet``, ``.jsonl``/``.json``/``.ndjson``,
``.txt``/``.md``/``.text``); a directory is searched for each format and must
hold exactly one kind, or ``fmt=`` must say which. A Hugging Face dataset (a
``datasets.Dataset`` or a ``save_to_disk`` folder) is format ``hf`` (hf_datasets.py).

A missing or wrongly typed column is reported by the listing (parquet footers,
the first jsonl record) in the words of the pipes (``field=``, ``text_column=``);
`plan_source` re-words it for its caller, whose parameter may be called
``messages_field`` (``column_param``; by default from ``require_type``: a list is a
conversation, so ``sft(messages_field=)``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from ..base import Node
from ..items import Doc
from .hf_datasets import HF, ReadArrow, is_dataset_dict, is_hf_source, list_hf_units
from .jsonl import ReadJsonl, list_jsonl_units
from .manifest import list_units
from .parquet import LIST, TEXT, ReadParquet
from ..shard import ShardUnits
from .fingerprint import source_fingerprint
from .files import COMPRESSIONS, FORMAT_SUFFIXES, SourceFile, SourceSpec, resolve_files
from .line_listing import list_text_units
from .parquet_windows import HOLD_WINDOWS
from .row_windows import window_rows
from .text_files import ReadText
from .retry import RetryPolicy

TEXT_MODES = ("file", "paragraphs")

# How the listing names the column parameter, longest first; `plan_source` puts its caller's name there.
_COLUMN_HINTS = (
    # list_jsonl_units: also offers field=None and on_error=, which the recipes do not take.
    ("Pass field= (text_column= in recipes) naming one of them; if only some records lack it, pass field=None "
     "here to list without this check and on_error='skip' to the reader", "Pass {param}= naming one of them"),
    ("field= (text_column= in recipes)", "{param}="),
    ("text_column=", "{param}="),  # parquet's check_column
)


def named_sources(sources: Union[SourceSpec, Mapping[str, SourceSpec]]) -> Dict[str, SourceSpec]:
    """``{name: spec}`` of what a recipe or a cache build is given: a mapping names its sources, anything
    else is the one source ``"default"``. A ``DatasetDict`` is a mapping of splits, not of sources: one
    source, which `plan_source` refuses naming its splits."""
    named = dict(sources) if isinstance(sources, Mapping) and not is_dataset_dict(sources) else {"default": sources}
    if not named:
        raise ValueError("sources is empty: give a path, glob, directory or URI, or {name: spec}")
    return named


def _reworded(text: str, param: str) -> Optional[str]:
    """``text`` with the column parameter called ``param``; None when it names none."""
    for old, new in _COLUMN_HINTS:
        if old in text:
            return text.replace(old, new.format(param=param))
    return None


@dataclass
class SourcePlan:
    """A listed source: its files, work units, and how to read a document from them."""

    name: str
    fmt: str
    files: List[SourceFile]
    units: Any  # UnitTable (parquet), LineUnitTable (jsonl, txt) or ArrowUnits (hf)
    column: str
    text_mode: str
    require_type: Optional[type] = str
    #: Rows per read window of each unit (row_windows.py; `with_window_bytes` sets them for parquet
    #: sources); None: whole units.
    windows: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    #: Bytes of texts a parquet reader converts at once (`ReadParquet` ``chunk_bytes``; None: its default).
    chunk_bytes: Optional[int] = field(default=None, compare=False, repr=False)
    #: Compressed bytes of rows a parquet reader holds ahead (`ReadParquet` ``hold_bytes``; None: its default).
    hold_bytes: Optional[int] = field(default=None, compare=False, repr=False)

    def with_window_bytes(self, window_bytes: Optional[int]) -> "SourcePlan":
        """This plan with its parquet units read in windows of about ``window_bytes`` decoded bytes
        (row_windows.py; None: whole units). Other formats hold bounded units already (jsonl and text
        units are cut at listing, a dataset's Arrow files are memory-mapped): unchanged. A listing
        without the columns' sizes (an index written before it recorded them) reads whole row
        groups, and a warning says to write the index again."""
        if window_bytes is None or self.fmt != "parquet":
            return replace(self, windows=None, chunk_bytes=None, hold_bytes=None)
        # a quarter of the source's share of the budget: the texts held beside its window
        chunk = max(ReadParquet.CHUNK_BYTES, window_bytes // 4)
        col_bytes = getattr(self.units, "col_bytes", None)
        if col_bytes is None:
            warnings.warn(f"source {self.name!r}: its listing does not give the row groups' sizes (an index written "
                          "by an older tokenloom), so its row groups are read whole, whatever read_budget says; "
                          "re-run `tokenloom index` on it to bound its memory", stacklevel=2)
            return replace(self, windows=None, chunk_bytes=chunk)
        # the rows of a window pass held compressed: HOLD_WINDOWS shares (one decoded window used to be held)
        return replace(self, windows=window_rows(self.units.rows, col_bytes, window_bytes), chunk_bytes=chunk,
                       hold_bytes=HOLD_WINDOWS * window_bytes)

    @property
    def windowed(self) -> bool:
        """Is any unit read in several windows (which changes its row order, row_windows.py)?"""
        return self.windows is not None and bool((np.asarray(self.units.rows) > self.windows).any())

    @property
    def total_rows(self) -> int:
        return int(self.units.total_rows)

    @property
    def fingerprint(self) -> Dict[str, Any]:
        """What a resume must match (fingerprint.py); the listed files carry the content keys."""
        return source_fingerprint(self.fmt, self.units.files)

    def fetched(self) -> Tuple[Any, Optional[str]]:
        """What this plan's readers fetch from the files, for the first fetches of a remote source
        (first_fetches.py): the table of units, and the column (None: all of them)."""
        return self.units, self.column

    def reader(self, shard: ShardUnits, *, seed: int, shuffle_rows: bool = True) -> Node[Doc]:
        """The reader of this source's documents; ``shuffle_rows=False`` reads a unit's rows in
        file order (what a token cache is built from, cache.py)."""
        kw = dict(source=self.name, seed=seed, shuffle_rows=shuffle_rows)
        if self.fmt == HF:
            return ReadArrow(shard, self.units, column=self.column, **kw)
        if self.fmt == "parquet":
            return ReadParquet(shard, self.units, column=self.column, windows=self.windows,
                               chunk_bytes=self.chunk_bytes, hold_bytes=self.hold_bytes, **kw)
        if self.fmt == "jsonl":
            return ReadJsonl(shard, self.units, field=self.column, require_type=self.require_type, **kw)
        return ReadText(shard, self.units, **kw)


def _format_of(spec: str) -> Optional[str]:
    base = spec.split("?", 1)[0].lower()
    for fmt, suffixes in FORMAT_SUFFIXES.items():
        if base.endswith(suffixes):
            return fmt
    return None


def detect_format(spec: SourceSpec) -> str:
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    found = set()
    for one in specs:
        if not isinstance(one, (str, os.PathLike)):
            raise TypeError(f"source entry {one!r} is a {type(one).__name__}; a source is a path, glob, directory or "
                            "URI, or a list of them (a Hugging Face dataset stands alone); to mix sources pass "
                            "{name: source}")
        one = os.fspath(one)
        fmt = _format_of(one)
        if fmt is None:  # a directory (or a glob without an ending): look for each kind
            kinds, other = [], None
            for candidate in FORMAT_SUFFIXES:
                try:
                    matched = resolve_files(one, candidate)
                except FileNotFoundError:
                    continue
                # a file or a glob matches whatever its ending: only files with this kind's ending count
                if any(f.path.lower().endswith(FORMAT_SUFFIXES[candidate]) for f in matched):
                    kinds.append(candidate)
                else:
                    other = matched[0].uri or matched[0].path
            plain = {k: [e for e in v if e.count(".") == 1] for k, v in FORMAT_SUFFIXES.items()}
            endings = ", ".join(f"{k} {' '.join(v)}" for k, v in plain.items())
            endings += f"; jsonl also compressed ({' '.join(COMPRESSIONS)})"
            if len(kinds) > 1:
                raise ValueError(f"source {one!r} holds several kinds of files ({kinds}); point it at one kind "
                                 "(e.g. a glob with its ending), or give each kind its own source name")
            if not kinds and other is not None:
                raise ValueError(f"source {one!r}: tokenloom reads parquet, jsonl and txt files, told apart by their "
                                 f"endings ({endings}); {other!r} has none of them")
            if not kinds:
                raise FileNotFoundError(f"source {one!r} matched no parquet, jsonl or txt files ({endings})")
            fmt = kinds[0]
        found.add(fmt)
    if len(found) > 1:
        raise ValueError(f"one source mixes formats {sorted(found)}; give each format its own source name")
    return found.pop()


def plan_source(name: str, spec: SourceSpec, *, column: str = "text", text_mode: str = "file",
                fmt: Optional[str] = None, require_type: Optional[type] = str,
                manifest: Optional[str] = None, column_param: Optional[str] = None,
                retry: Optional[RetryPolicy] = None) -> SourcePlan:
    """Resolve, check and list one source (see the module docstring); ``manifest`` is the
    path or URI of a parquet source's index when it is not in the default place;
    ``column_param`` is what the caller calls ``column`` in its errors (default:
    ``messages_field`` when ``require_type`` is list, else ``text_column``); ``retry``: how requests to
    ``https://`` and ``hf://`` files are retried (retry.py)."""
    if text_mode not in TEXT_MODES:
        raise ValueError(f"{text_mode=} is not one of {TEXT_MODES}")
    fmt = fmt or (HF if is_hf_source(spec) else detect_format(spec))
    if manifest is not None and fmt != "parquet":
        raise ValueError(f"manifest={manifest!r} is an index of parquet files, but source {name!r} is {fmt}; "
                         "leave manifest= out for it")
    files = [] if fmt == HF else resolve_files(spec, fmt, retry=retry)
    param = column_param or ("messages_field" if require_type is list else "text_column")
    require = TEXT if require_type is str else LIST if require_type is list else None  # the column kind listed
    try:
        if fmt == HF:
            units = list_hf_units(name, spec, column, require=require)
            files = units.files
        elif fmt == "parquet":
            units = list_units(files, column, require=require, manifest=manifest)
        elif fmt == "jsonl":
            units = list_jsonl_units(files, field=column, require_type=require_type)
        else:
            units = list_text_units(files, mode=text_mode)
    except ValueError as e:
        reworded = _reworded(str(e), param)
        if reworded is None:
            raise
        raise ValueError(reworded) from e
    if units.total_rows == 0:
        more = f" and {len(files) - 3} more" if len(files) > 3 else ""
        shown = ", ".join(f.uri or f.path for f in files[:3]) + more
        raise ValueError(f"source {name!r} has 0 rows: its {len(files)} {fmt} file(s) ({shown}) hold no documents; "
                         "point it at files with data, or leave the source out")
    return SourcePlan(name, fmt, files, units, column, text_mode, require_type)
