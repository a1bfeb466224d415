"""Row groups read in windows (issue 46, memory): order, coverage, shards, resume, the setting, and
what a reader holds. Real parquet files through pyarrow."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.pipes import ReadParquet, ShardUnits, list_parquet_units, resolve_files
from tokenloom.pipes.shard import ROW_ORDER_TAG, rng_for
from tokenloom.pipes.sources.manifest import list_units, write_manifest
from tokenloom.pipes.sources.row_windows import ordered_rows, window_rows
from tokenloom.recipes import pretrain

from .resume import check_loader_resume, check_node_resume

ROWS = 100  # rows per row group
GROUPS = 3


@pytest.fixture(scope="module")
def big_groups(tmp_path_factory):
    """One file of 3 row groups of 100 documents, each naming its row ("doc <global row> ...")."""
    root = tmp_path_factory.mktemp("windows")
    texts = [f"doc {i} " + "word " * (3 + i % 17) for i in range(ROWS * GROUPS)]
    texts[7] = None  # a null: skipped and counted, as with whole row groups
    pq.write_table(pa.table({"text": texts}), root / "a.parquet", row_group_size=ROWS)
    return str(root / "a.parquet"), texts


def _units(path):
    return list_parquet_units(resolve_files(path), "text")


def _read_all(units, *, windows, shard=0, num_shards=1, epochs=1, seed=3):
    node = ShardUnits(units.rows, shard=shard, num_shards=num_shards, seed=seed, epochs=epochs)
    reader = ReadParquet(node, units, column="text", seed=seed, windows=windows)
    reader.reset(None)
    return list(reader)


def test_the_listing_gives_each_row_groups_column_size_from_the_footer(big_groups):
    path, _ = big_groups
    units = _units(path)
    meta = pq.ParquetFile(path).metadata
    want = [meta.row_group(g).column(0).total_uncompressed_size for g in range(GROUPS)]
    assert units.col_bytes.tolist() == want
    w = window_rows(units.rows, units.col_bytes, 1000)
    assert (w >= 8).all() and (w < ROWS).all()


def test_an_index_records_the_sizes_and_gives_the_same_windows(big_groups, tmp_path):
    path, _ = big_groups
    out = str(tmp_path / "index.json")
    write_manifest(path, out=out)
    indexed = list_units(resolve_files(path), "text", manifest=out)
    assert indexed.col_bytes.tolist() == _units(path).col_bytes.tolist()


def test_units_that_fit_a_window_keep_the_whole_unit_permutation(big_groups):
    """The order of whole-unit reading, rng_for(seed, ROW_ORDER_TAG, epoch, unit).permutation(n), exactly."""
    path, texts = big_groups
    units = _units(path)
    for windows in (None, np.full(len(units.rows), ROWS), np.full(len(units.rows), 10 * ROWS)):
        docs = _read_all(units, windows=windows, epochs=2)
        got = [(d.epoch, d.unit, d.row) for d in docs]
        want = []
        node = ShardUnits(units.rows, shard=0, num_shards=1, seed=3, epochs=2)
        node.reset(None)
        for s in node:
            perm = rng_for(3, ROW_ORDER_TAG, s.epoch, s.unit).permutation(int(units.rows[s.unit]))[s.lo:s.hi]
            want += [(s.epoch, s.unit, int(r)) for r in perm if texts[int(r) + ROWS * s.unit] is not None]
        assert got == want
        assert all(d.text == texts[d.row + ROWS * d.unit] for d in docs)


@pytest.mark.parametrize("window", [16, 33, 99])
def test_windowed_order_reads_every_row_once_within_its_window(big_groups, window):
    path, texts = big_groups
    units = _units(path)
    windows = np.full(len(units.rows), window)
    docs = _read_all(units, windows=windows)
    seen = [(d.unit, d.row) for d in docs]
    assert len(seen) == len(set(seen)) == ROWS * GROUPS - 1
    for d in docs:
        assert d.row // window == d.pos // window  # a position's row lies in the position's window
        assert d.text == texts[d.row + ROWS * d.unit]
    # the order within a window is shuffled, and not the whole-unit permutation
    assert [d.row for d in docs if d.unit == 0][:window] != list(range(window))
    whole = rng_for(3, ROW_ORDER_TAG, 0, 0).permutation(ROWS)
    assert not np.array_equal(ordered_rows(3, 0, 0, ROWS, 0, ROWS, window=window), whole)


def test_windowed_shards_are_disjoint_and_complete(big_groups):
    path, _ = big_groups
    units = _units(path)
    windows = np.full(len(units.rows), 16)
    for num_shards in (2, 3, 7):
        seen = []
        for g in range(num_shards):
            seen += [(d.unit, d.row) for d in _read_all(units, windows=windows, shard=g, num_shards=num_shards)]
        assert len(seen) == len(set(seen)) == ROWS * GROUPS - 1, num_shards


def test_ordered_rows_of_a_range_are_that_range_of_the_whole_order():
    whole = ordered_rows(5, 2, 9, 250, 0, 250, window=40)
    assert sorted(whole.tolist()) == list(range(250))
    for lo, hi in ((0, 1), (39, 41), (37, 203), (240, 250), (120, 120)):
        assert ordered_rows(5, 2, 9, 250, lo, hi, window=40).tolist() == whole[lo:hi].tolist()


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_windowed_reader_resumes_at_every_step(big_groups, num_shards):
    """Restored mid-window (and mid-slice, where 3 shards split the row groups): the exact next documents."""
    path, _ = big_groups
    units = _units(path)
    windows = np.full(len(units.rows), 16)

    def build():
        node = ShardUnits(units.rows, shard=num_shards - 1, num_shards=num_shards, seed=3, epochs=2)
        return ReadParquet(node, units, column="text", seed=3, windows=windows)

    assert check_node_resume(build, max_steps=250) > 100


def test_a_reader_holds_a_chunk_of_texts_and_one_window(tmp_path):
    """Counts, not timings: the Python texts a reader holds are at most CHUNK_ROWS rows (fewer when
    large), its Arrow rows at most one window, and nothing of a slice once it is read."""
    texts = [f"doc {i} " + "x" * (100 if i % 3 else 30_000) for i in range(400)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "b.parquet", row_group_size=200)
    units = _units(str(tmp_path / "b.parquet"))
    window = 50
    node = ShardUnits(units.rows, shard=0, num_shards=1, seed=1, epochs=1)
    reader = ReadParquet(node, units, column="text", seed=1, windows=np.full(len(units.rows), window))
    reader.reset(None)
    most_texts = most_rows = 0
    for d in reader:
        held = [t for t in reader._texts if t is not None]
        most_texts = max(most_texts, len(held))
        assert sum(map(len, held)) <= ReadParquet.CHUNK_BYTES + 30_100  # one large row may pass the byte bound
        if reader._column is not None:
            most_rows = max(most_rows, len(reader._column))
        if d.pos == int(units.rows[d.unit]) - 1:  # the slice's last row: its texts and rows are let go
            assert reader._texts == [] and reader._column is None
    assert 1 <= most_texts <= ReadParquet.CHUNK_ROWS
    assert most_rows == window


def test_the_chunk_is_a_bounded_part_of_a_whole_row_group(tmp_path):
    """Whole row groups (no windows) too: the texts held are a chunk, not the slice."""
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(300)]}), tmp_path / "c.parquet", row_group_size=300)
    units = _units(str(tmp_path / "c.parquet"))
    node = ShardUnits(units.rows, shard=0, num_shards=1, seed=1, epochs=1)
    reader = ReadParquet(node, units, column="text", seed=1)
    reader.reset(None)
    sizes = []
    for _ in reader:
        sizes.append(len(reader._texts))
    assert max(sizes) == ReadParquet.CHUNK_ROWS and len(sizes) == 300


def _two_sources(root):
    for name in ("a", "b"):
        os.makedirs(root / name, exist_ok=True)
        texts = [f"{name} document {i} " + "word " * (5 + i % 40) for i in range(240)]
        pq.write_table(pa.table({"text": texts}), root / name / "x.parquet", row_group_size=120)
    return {"a": str(root / "a"), "b": str(root / "b")}


def test_read_budget_is_recorded_only_where_it_windows_a_row_group(tmp_path):
    sources = _two_sources(tmp_path)
    assert "read_budget" not in pretrain(sources, "demo", seq_len=63).config  # the default windows nothing here
    assert pretrain(sources, "demo", seq_len=63, read_budget=4000).config["read_budget"] == 4000


def test_a_resume_with_another_read_budget_is_refused_naming_it(tmp_path):
    sources = _two_sources(tmp_path)
    loader = pretrain(sources, "demo", seq_len=63, batch_size=2, read_budget=4000)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    for other in (None, 8000):
        with pytest.raises(ValueError, match=r"read_budget: saved with 4000, this loader has "
                                              + ("None" if other is None else "8000")):
            pretrain(sources, "demo", seq_len=63, batch_size=2, read_budget=other).load_state_dict(state)
    with pytest.raises(ValueError, match=r"read_budget=0 must be >= 1"):
        pretrain(sources, "demo", seq_len=63, read_budget=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_windowed_loader_resumes_exactly(tmp_path, num_workers):
    sources = _two_sources(tmp_path)

    def build():
        return pretrain(sources, "demo", seq_len=63, batch_size=2, read_budget=4000, num_workers=num_workers,
                        epochs=1)

    check_loader_resume(build, steps=[1, 7], total=20)
