"""listing_at_once.py: remote files listed at once, each file's blocks read by positional reads at once.

The S3 side (a remote listing equal to local disk's, and its time behind a slow store) is in
test_readahead.py, beside the other line-unit tests on S3."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.pipes.sources import listing_at_once
from tokenloom.pipes.sources.listing_at_once import BOM, blocks_at_once, each_file
from tokenloom.pipes.sources.line_listing import read_blocks


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=300), bom=st.booleans(), block=st.integers(1, 64), ahead=st.integers(1, 5))
def test_blocks_at_once_are_the_blocks_of_a_sequential_read(pool, body, bom, block, ahead):
    data = (BOM if bom else b"") + body
    want = list(read_blocks(pa.BufferReader(data), block))
    got = list(blocks_at_once(pa.BufferReader(data), len(data), pool, block=block, ahead=ahead))
    assert got == want


class _Shrunk:
    """A file listed at ``size`` bytes that holds fewer now: positional reads past its end come back short."""

    def __init__(self, data: bytes):
        self.data, self.calls = data, 0

    def read_at(self, n: int, off: int) -> bytes:
        self.calls += 1
        return self.data[off:off + n]


def test_a_file_shorter_than_listed_ends_where_a_sequential_read_ends(pool):
    data = b"line\n" * 12  # 60 bytes, listed as 100
    got = list(blocks_at_once(_Shrunk(data), 100, pool, block=16, ahead=2))
    assert b"".join(c for _, c in got) == data and got[-1] == (0, b"")
    assert list(got) == list(read_blocks(pa.BufferReader(data), 16))


def test_each_file_keeps_the_file_order_and_returns_errors_in_place(monkeypatch):
    class F:
        def __init__(self, i, remote):
            self.i = i
            self.fs = type("FS", (), {"type_name": "s3" if remote else "local"})()

    def fn(f):
        if f.i % 3 == 1:
            raise ValueError(f"bad {f.i}")
        return f.i * 10

    for remote in (False, True):
        out = list(each_file(fn, [F(i, remote) for i in range(7)]))
        assert [x if isinstance(x, int) else str(x) for x in out] == [0, "bad 1", 20, 30, "bad 4", 50, 60]


def test_local_files_are_listed_only_as_far_as_the_caller_reads():
    """A caller that stops at a bad local file reads no further (a wrong field name in the first of many
    local files fails at once, as before)."""
    seen = []

    class F:
        fs = type("FS", (), {"type_name": "local"})()

    def fn(f):
        seen.append(f)
        return f

    files = [F() for _ in range(5)]
    it = each_file(fn, files)
    next(it), next(it)
    assert len(seen) == 2
    assert listing_at_once.is_remote(files) is False


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(max_size=8).map(lambda b: b.replace(b"[", b"x")) | st.sampled_from([b" ", b"\n\t", b"["]),
                       max_size=8))
def test_first_byte_of_finds_the_first_non_whitespace_byte_and_gives_every_block_back(chunks):
    blocks = [(0, c) for c in chunks if c] + [(0, b"")]
    whole = b"".join(c for _, c in blocks)
    head, again = listing_at_once.first_byte_of(iter(blocks))
    assert head == whole.lstrip()[:1]
    assert list(again) == blocks


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 250_000])
def test_a_compressed_stream_over_in_order_reads_decompresses_the_same(size, monkeypatch):
    """What a codec reads through `InOrder` (positional reads of BLOCK_BYTES, several in flight) is the file,
    in order: gzip data decompresses to what was compressed; closing ends the reads and closes the handle."""
    import gzip
    import random

    rng = random.Random(size)
    data = bytes(rng.choice(b"abc \n{}") for _ in range(size))
    comp = gzip.compress(data)
    monkeypatch.setattr(listing_at_once, "blocks_at_once",
                        lambda h, n, pool, **kw: blocks_at_once(h, n, pool, block=1000, ahead=3, bom=False))
    raw = pa.BufferReader(comp)
    stream = pa.CompressedInputStream(pa.PythonFile(listing_at_once.InOrder(raw, len(comp)), mode="r"), "gzip")
    assert stream.read() == data
    stream.close()
    assert raw.closed


def test_in_order_keeps_a_byte_order_mark():
    """Compressed bytes are not text: a first block starting with the bytes of a UTF-8 BOM keeps them."""
    data = BOM + b"rest"
    reader = listing_at_once.InOrder(pa.BufferReader(data), len(data))
    assert reader.read() == data
    reader.close()


def test_streams_left_open_are_closed_by_the_exit_hook():
    """`InOrder` streams still open when the process exits are closed by an atexit hook, before the modules
    go: left to pyarrow, a stream was closed during teardown, into Python whose globals were gone ("Error
    ignored when destroying file" on stderr at the end of a run reading .jsonl.gz from S3). A second close,
    pyarrow's, then does nothing."""
    data = b"y" * 5000
    raw = pa.BufferReader(data)
    stream = listing_at_once.InOrder(raw, len(data))
    assert stream.read(3) == b"yyy" and stream in listing_at_once._OPEN
    listing_at_once._close_open()
    assert stream.closed and raw.closed and stream not in listing_at_once._OPEN
    stream.close()
