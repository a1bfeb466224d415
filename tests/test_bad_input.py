"""Bad input on the pretrain path: a clear error naming the file, pattern, column or path."""

from __future__ import annotations

import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.recipes import pretrain
from tokenloom.pipes.loader.bridge import decode_state


def test_missing_file_names_it(tmp_path, tok_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        pretrain(str(tmp_path / "nope.parquet"), tokenizer=tok_path)


@pytest.mark.parametrize("spec", [["a.parquet", ["b.parquet"]], [3], [None]])
def test_a_source_entry_that_is_not_a_path_is_named(corpus, tok_path, spec):
    bad = spec[-1]
    with pytest.raises(TypeError, match=rf"source entry {re.escape(repr(bad))} is a {type(bad).__name__}.*name: source"):
        pretrain([corpus[0], *spec[1:]] if len(spec) > 1 else spec, tokenizer=tok_path)


def test_empty_glob_names_the_pattern(tmp_path, tok_path):
    with pytest.raises(FileNotFoundError, match=r"matched no parquet files.*\*\.parquet"):
        pretrain(str(tmp_path / "*.parquet"), tokenizer=tok_path)


def test_empty_directory_names_it(tmp_path, tok_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        pretrain(str(tmp_path / "empty"), tokenizer=tok_path)


def test_missing_column_lists_the_columns(tmp_path, tok_path):
    pq.write_table(pa.table({"content": ["a", "b"], "meta": [1, 2]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"column 'text' not found in .*x\.parquet.*\['content', 'meta'\]"):
        pretrain(str(tmp_path / "x.parquet"), tokenizer=tok_path)


def test_non_text_column_is_refused(tmp_path, tok_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="not text"):
        pretrain(str(tmp_path / "x.parquet"), tokenizer=tok_path)


def test_tokenizer_that_cannot_load_names_the_path(corpus, tmp_path):
    glob, _ = corpus
    with pytest.raises(ValueError, match="does not exist"):
        pretrain(glob, tokenizer=str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot load tokenizer from .*bad\.json"):
        pretrain(glob, tokenizer=str(bad))


def test_unknown_bos_is_named(corpus, tok_path):
    glob, _ = corpus
    with pytest.raises(ValueError, match="<nope>"):
        pretrain(glob, tokenizer=tok_path, bos="<nope>")


def test_too_few_rows_for_the_shards(tmp_path, tok_path):
    pq.write_table(pa.table({"text": ["one doc"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="1 rows but there are 2 shards"):
        pretrain(str(tmp_path / "x.parquet"), tokenizer=tok_path, num_workers=2)


def test_null_rows_are_skipped_counted_and_reported(tmp_path, tok_path, caplog):
    pq.write_table(pa.table({"text": ["a b c", None, "d e f", None] * 10}), tmp_path / "x.parquet")
    loader = pretrain(str(tmp_path / "x.parquet"), tokenizer=tok_path, seq_len=15, batch_size=2, epochs=1,
                      packing="flat")
    with caplog.at_level(logging.WARNING):
        batches = list(loader)
    assert loader.stats()["documents"] == 20
    assert loader.stats()["skipped"] == loader.stats()["sources"]["default"]["skipped"] == 20
    warned = [r.message for r in caplog.records if "skipping null text" in r.message]
    assert len(warned) == 1 and "x.parquet, row group 0, row" in warned[0]
    state = decode_state(loader.state_dict())
    reader_state = state["loader"]["fetcher_state"]["dataset_iter_state"]["node"]
    while "skipped" not in reader_state:
        reader_state = reader_state["parent"]
    assert reader_state["skipped"] == 20


@pytest.mark.parametrize("bad", [dict(seq_len=0), dict(batch_size=0), dict(packing="zigzag"), dict(epochs=0)])
def test_bad_settings(corpus, tok_path, bad):
    glob, _ = corpus
    with pytest.raises(ValueError, match=list(bad)[0]):
        pretrain(glob, tokenizer=tok_path, **bad)


def test_prefetch_without_workers(corpus, tok_path):
    glob, _ = corpus
    with pytest.raises(ValueError, match="prefetch_factor= needs num_workers > 0"):
        pretrain(glob, tokenizer=tok_path, prefetch_factor=2)
