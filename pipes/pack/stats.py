"""Cumulative packing statistics, checkpointed with the packer.

Every packer counts the same things so the loader can report them uniformly:
``tokens_in`` (tokens of documents pulled, BOS included), ``tokens_out`` (real
tokens placed in rows), ``padding``, ``discarded`` (tokens a cropping packer
threw away), ``documents``, ``chunked`` (documents cut across rows) and ``rows``.
When nothing is buffered, ``tokens_in == tokens_out + discarded``.
"""

from __future__ import annotations

from typing import Dict

PACK_STAT_KEYS = ("tokens_in", "tokens_out", "padding", "discarded", "documents", "chunked", "rows")


def new_stats() -> Dict[str, int]:
    return {k: 0 for k in PACK_STAT_KEYS}


def load_stats(state: Dict[str, int]) -> Dict[str, int]:
    """Read stats strictly: the same keys as `new_stats`."""
    if set(state) != set(PACK_STAT_KEYS):
        raise ValueError(f"packing stats in the saved state have keys {sorted(state)}, expected {list(PACK_STAT_KEYS)}")
    return {k: int(state[k]) for k in PACK_STAT_KEYS}
