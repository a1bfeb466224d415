"""Windows of a row group held compressed (pipes/sources/held_rows.py): the same rows as reading each
window again, bad text still named by its row, and what is held let go as the reader passes it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.pipes import ReadParquet, ShardUnits, list_parquet_units, resolve_files
from tokenloom.pipes.sources import held_rows, parquet_windows
from tokenloom.pipes.sources.held_rows import BadRow, HeldWindow

from .resume import check_node_resume

ROWS = 120  # rows per row group
WINDOW = 16  # 8 windows a row group


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two files of 2 row groups: nulls, empty texts, non-ASCII, one row far larger than the rest.
    One file as pyarrow writes by default (a dictionary page per group), one plain."""
    root = tmp_path_factory.mktemp("held")
    texts = [f"doc {i} é€😀 " + "word " * (i % 23) for i in range(4 * ROWS)]
    for i in (5, 130, 300):
        texts[i] = None
    for i in (6, 250):
        texts[i] = ""
    texts[17] = "big " * 20_000
    pq.write_table(pa.table({"text": texts[:2 * ROWS]}), root / "a.parquet", row_group_size=ROWS)
    pq.write_table(pa.table({"text": texts[2 * ROWS:]}), root / "b.parquet", row_group_size=ROWS,
                   use_dictionary=False, compression="zstd")
    return str(root / "*.parquet"), texts


def _read(pattern, *, shard=0, num_shards=1, epochs=2):
    units = list_parquet_units(resolve_files(pattern), "text")
    node = ShardUnits(units.rows, shard=shard, num_shards=num_shards, seed=7, epochs=epochs)
    reader = ReadParquet(node, units, column="text", seed=7, windows=np.full(len(units.rows), WINDOW))
    reader.reset(None)
    return reader


def _docs(reader):
    return [(d.text, d.unit, d.row, d.pos, d.epoch) for d in reader]


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_a_held_window_gives_arrows_texts_in_any_order(kind):
    values = ["ab", None, "", "é" * 300, "x" * 5000, None, "last"]
    window = pa.chunked_array([pa.array(values[:3], kind), pa.array(values[3:], kind)]).slice(0)
    held = HeldWindow(window)
    assert len(held) == len(values)
    assert held.nbytes < sum(len(v.encode()) for v in values if v)  # compressed
    order = np.array([6, 1, 4, 0, 2, 5, 3])
    assert held.texts(order, 1 << 20) == [values[i] for i in order]
    # the reader's chunk: as many first rows as hold `limit` bytes of text, at least one
    assert held.texts(np.array([4, 0, 6]), 100) == [values[4]]
    assert held.texts(np.array([0, 6, 4]), 100) == ["ab", "last"]
    # a sliced chunk (an offset into Arrow's buffers)
    assert HeldWindow(window.slice(2, 3)).texts(np.arange(3), 1 << 20) == values[2:5]


def test_invalid_utf8_in_a_held_window_names_its_row():
    data = pa.py_buffer(b"okbad\xff\xfe")
    offsets = pa.py_buffer(np.array([0, 2, 7], np.int32).tobytes())
    window = pa.chunked_array([pa.Array.from_buffers(pa.string(), 2, [None, offsets, data])])
    held = HeldWindow(window)
    assert held.texts(np.array([0]), 100) == ["ok"]
    with pytest.raises(BadRow) as e:
        held.texts(np.array([0, 1]), 100)
    assert e.value.index == 1 and isinstance(e.value.error, UnicodeDecodeError)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_held_windows_read_what_reopening_every_window_reads(corpus, monkeypatch, num_shards):
    pattern, texts = corpus
    held = []
    for g in range(num_shards):
        held += _docs(_read(pattern, shard=g, num_shards=num_shards))
    monkeypatch.setattr(parquet_windows, "holdable", lambda window: False)
    again = []
    for g in range(num_shards):
        again += _docs(_read(pattern, shard=g, num_shards=num_shards))
    assert held == again
    assert sorted((u, r) for _, u, r, _, e in held if e == 0) == sorted(
        (i // ROWS, i % ROWS) for i, t in enumerate(texts) if t is not None)


def test_without_the_codec_windows_are_read_as_before(corpus, monkeypatch):
    pattern, _ = corpus
    want = _docs(_read(pattern))
    monkeypatch.setattr(held_rows, "_codec", [None])
    reader = _read(pattern)
    got = []
    for d in reader:
        got.append((d.text, d.unit, d.row, d.pos, d.epoch))
        assert not isinstance(reader._column, HeldWindow)
    assert got == want


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_reader_of_held_windows_resumes_at_every_step(corpus, num_shards):
    pattern, _ = corpus
    units = list_parquet_units(resolve_files(pattern), "text")

    def build():
        node = ShardUnits(units.rows, shard=num_shards - 1, num_shards=num_shards, seed=7, epochs=2)
        return ReadParquet(node, units, column="text", seed=7, windows=np.full(len(units.rows), WINDOW))

    assert check_node_resume(build, max_steps=300) > 150


def test_held_windows_are_let_go_as_the_reader_passes_them(corpus, monkeypatch):
    """Counts, not timings: the window being read is a `HeldWindow`, never the decoded rows; the later
    windows of its slice wait compressed, within `HOLD_WINDOWS` windows' text, fewer as the reader goes
    on, none once the slice is read; and a row group is decoded once per few windows, not per window."""
    pattern, _ = corpus
    decodes = []
    real = parquet_windows.windows_of
    monkeypatch.setattr(parquet_windows, "windows_of", lambda *a: decodes.append(a[1]) or real(*a))
    reader = _read(pattern, epochs=1)
    units = reader.units
    count = -(-ROWS // WINDOW)
    last = None
    for d in reader:
        assert isinstance(reader._column, HeldWindow) or reader._column is None
        if reader._windows is not None:
            text = int(reader._column.sizes.sum())
            waiting = reader._windows._held
            assert reader._windows.held_bytes() <= parquet_windows.HOLD_WINDOWS * text
            now = (d.unit, d.pos // WINDOW, len(waiting))
            if last is not None and now[:2] != last[:2] and now[0] == last[0] and last[2]:
                assert now[2] == last[2] - 1  # the next window was held: one fewer waits
            last = now
        if d.pos == int(units.rows[d.unit]) - 1:
            assert reader._windows is None and reader._column is None
    assert len(units.rows) < len(decodes) < len(units.rows) * count / 2


@pytest.mark.timeout(60)
def test_invalid_utf8_in_a_held_window_is_named_by_file_group_and_row(tmp_path):
    texts = [f"doc {i} " + "x" * 50 for i in range(200)]
    texts[150] = "doc 150 MARKER-BAD"  # neither the least nor the greatest: not in the statistics
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=100, use_dictionary=False, compression="none")
    raw = bytearray(path.read_bytes())
    at = raw.index(b"MARKER-BAD")
    assert raw.find(b"MARKER-BAD", at + 1) < 0
    raw[at:at + 4] = b"\xff\xfe\xff\xfe"
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"c\.parquet, row group 1, row 50: invalid UTF-8 in column 'text'"):
        list(_read(str(path), epochs=1))


def test_the_recipes_hold_twice_a_sources_share_and_a_reader_keeps_to_it(corpus):
    from tokenloom.pipes.sources.readers import plan_source

    pattern, _ = corpus
    plan = plan_source("a", pattern).with_window_bytes(2000)
    assert plan.windowed and plan.hold_bytes == parquet_windows.HOLD_WINDOWS * 2000
    assert plan_source("a", pattern).with_window_bytes(None).hold_bytes is None
    units = plan.units
    node = ShardUnits(units.rows, shard=0, num_shards=1, seed=7, epochs=1)
    reader = ReadParquet(node, units, column="text", seed=7, windows=np.full(len(units.rows), WINDOW),
                         hold_bytes=3000)
    reader.reset(None)
    most = 0
    for _ in reader:
        if reader._windows is not None and reader._windows._held:
            held = list(reader._windows._held.values())
            # within the bound but for the last window held, which may pass it
            assert sum(h.nbytes for h in held[:-1]) <= 3000
            most = max(most, len(held))
    assert 1 <= most < -(-ROWS // WINDOW) - 1  # some windows held, not all of a row group's
    with pytest.raises(ValueError, match="hold_bytes=0 must be >= 1"):
        ReadParquet(node, units, hold_bytes=0)
