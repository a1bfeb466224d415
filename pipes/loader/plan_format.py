"""An elastic resume's plan as plain data: what each new shard continues from.

A plan (per new shard, kept in the loader state until the round ends) holds ``ROUND``, the loop's
``STEP``, per source under ``SOURCES`` its ``PREFIX`` (the slices it reads first, packed by
`pack_slices`), the epoch it plans from after them (``RESUME_EPOCH``) and how many leading slices a
saved plan dropped (``DROPPED``), and under ``CARRY`` the counters it continues (elastic.py).
"""

from __future__ import annotations

import base64
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..shard import WorkSlice

#: Plan keys (plain data in the loader state).
ROUND, STEP, SOURCES, CARRY = "round", "step", "sources", "carry"
PREFIX, RESUME_EPOCH, DROPPED = "prefix", "resume_epoch", "dropped"


def pack_slices(slices: Sequence[WorkSlice]) -> str:
    """Slices as base64 of zlib'd little-endian int64 (epoch, unit, lo, hi, used) rows: a
    document in flight costs ~8 bytes of state instead of ~25 as JSON lists."""
    fields = len(WorkSlice._fields)
    table = np.array(list(zip(*slices)), dtype="<i8").T if slices else np.zeros((0, fields), "<i8")
    table = np.ascontiguousarray(table.reshape(-1, fields))
    return base64.b64encode(zlib.compress(table.tobytes(), 6)).decode("ascii")


def unpack_slices(text: str) -> List[WorkSlice]:
    raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, len(WorkSlice._fields))
    return list(map(WorkSlice._make, table.tolist()))


def prefix_of(plan: Optional[Mapping[str, Any]], source: str) -> Dict[str, Any]:
    """`ShardUnits` arguments for a new shard's ``source``: its prefix, the epoch it plans
    from after it, and how many leading prefix slices a saved plan dropped (nothing
    without a plan)."""
    if plan is None:
        return {}
    entry = plan[SOURCES][source]
    return {"prefix": unpack_slices(entry[PREFIX]), "resume_epoch": int(entry[RESUME_EPOCH]),
            "prefix_offset": int(entry.get(DROPPED, 0))}
