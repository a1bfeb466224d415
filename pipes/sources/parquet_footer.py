"""A parquet file's footer as bytes: the thrift metadata, its length and the closing magic.

Read with one read of the file's last `TAIL_BYTES` (pyarrow's own first read, one round trip on
remote storage), and a second only for a footer larger than that. Its own module so that both the
parquet listing (parquet.py) and the read-ahead (readahead.py) use it without importing each other.
"""

from __future__ import annotations

from typing import Any

#: Bytes read from a file's end to find its footer: pyarrow's own first read (one round trip on S3).
TAIL_BYTES = 64 << 10
MAGIC = b"PAR1"


def footer_bytes(handle: Any, size: int) -> bytes:
    """The footer, its length and the closing magic: the last ``len + 8`` bytes of the file."""
    tail_len = min(size, TAIL_BYTES)
    handle.seek(size - tail_len)
    tail = handle.read(tail_len)
    if len(tail) < 8 or tail[-4:] != MAGIC:
        handle.seek(0)
        head = handle.read(4)
        if head != MAGIC:
            raise ValueError(f"it neither starts nor ends with the parquet magic {MAGIC!r} (its first bytes are "
                             f"{head!r}), so it is not a parquet file")
        raise ValueError(f"it starts like a parquet file but does not end with {MAGIC!r}")
    need = int.from_bytes(tail[-8:-4], "little") + 8
    if need > size:
        raise ValueError(f"its footer length ({need - 8} bytes) is larger than the file")
    if need > len(tail):
        handle.seek(size - need)
        tail = handle.read(need)
    return tail[-need:]
