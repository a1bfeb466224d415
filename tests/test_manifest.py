"""The parquet index (`tokenloom index`): no footer reads at build, same units, same resume,
and a stale index refused with the file named and the command to re-run."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.index_cmd import register
from tokenloom.pipes import plan_source
from tokenloom.pipes.sources.files import MANIFEST_NAME
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts
from .resume import items_equal

TEXTS = synthetic_texts(480)
FILES = 12


@pytest.fixture
def data(tmp_path):
    """12 files of 40 documents in 16-row row groups (some files in a subdirectory)."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    for f in range(FILES):
        where = root / "sub" if f % 3 == 0 else root
        pq.write_table(pa.table({"text": TEXTS[f * 40:(f + 1) * 40], "n": list(range(40))}),
                       where / f"part-{f:03d}.parquet", row_group_size=16)
    return root


@pytest.fixture
def footer_reads(monkeypatch):
    """Counts every parquet footer opened (pq.ParquetFile is how every footer is read)."""
    count = [0]
    real = pq.ParquetFile

    class Counting(real):
        def __init__(self, *args, **kwargs):
            count[0] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", Counting)
    return count


def index(*argv: str) -> int:
    """`tokenloom index ...` through the subcommand's own registration."""
    parser = argparse.ArgumentParser(prog="tokenloom")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["index", *argv])
    return args.run(args)


def build(spec, tok_path, **kw):
    return pretrain(spec, tokenizer=tok_path, seq_len=63, batch_size=2, packing="flat", **kw)


def test_build_reads_no_footer_with_an_index(data, tok_path, footer_reads, capsys):
    build(str(data), tok_path)
    assert footer_reads[0] == FILES

    footer_reads[0] = 0
    assert index(str(data)) == 0
    assert footer_reads[0] == FILES  # the index reads each footer once
    out = capsys.readouterr().out
    assert f"indexed {FILES} parquet files, {FILES * 3} row groups, 480 rows -> {data / MANIFEST_NAME}" in out

    footer_reads[0] = 0
    build(str(data), tok_path)
    build(str(data / "*" / "*.parquet"), tok_path)  # a glob resolving under the same directory
    assert footer_reads[0] == 0


def test_same_units_and_an_exact_resume_across_the_index(data, tok_path):
    without = plan_source("default", str(data)).units
    loader = build(str(data), tok_path)
    fingerprint = loader.config["sources"]
    it = iter(loader)
    for _ in range(8):
        next(it)
    state = loader.state_dict()
    more = [next(it) for _ in range(6)]
    del it, loader

    assert index(str(data)) == 0
    with_index = plan_source("default", str(data)).units
    for key in ("file", "row_group", "rows"):
        assert np.array_equal(getattr(without, key), getattr(with_index, key)), key
    resumed = build(str(data), tok_path)
    assert resumed.config["sources"] == fingerprint  # the fingerprint does not see the index
    resumed.load_state_dict(state)
    it = iter(resumed)
    again = [next(it) for _ in range(6)]
    assert len(again) == 6 and all(items_equal(a, b) for a, b in zip(more, again))


def test_changed_file_is_refused_naming_it_and_the_command(data, tok_path):
    assert index(str(data)) == 0
    path = data / "part-001.parquet"
    old = path.stat().st_size
    pq.write_table(pa.table({"text": TEXTS[:7]}), path)
    with pytest.raises(ValueError, match=rf"lists 'part-001.parquet' with size={old} bytes but .*part-001\.parquet "
                                         rf"is {path.stat().st_size} bytes now.*re-run `tokenloom index {data}`"):
        build(str(data), tok_path)


def test_added_file_is_refused_naming_it(data, tok_path):
    assert index(str(data)) == 0
    pq.write_table(pa.table({"text": TEXTS[:7]}), data / "sub" / "late.parquet")
    with pytest.raises(ValueError, match=r"sub/late\.parquet is not in the index .*_tokenloom_index\.json \(it lists "
                                         rf"{FILES} files.*re-run `tokenloom index"):
        build(str(data), tok_path)


def test_removed_file_and_subsets_are_fine(data, tok_path, footer_reads):
    assert index(str(data)) == 0
    os.remove(data / "part-001.parquet")
    footer_reads[0] = 0
    build(str(data), tok_path)
    build(str(data / "part-002.parquet"), tok_path)  # a single file: its directory's index
    assert footer_reads[0] == 0


@pytest.mark.parametrize("content, what", [
    (b"{not json", "is not a tokenloom index"),
    (json.dumps({"format": "tokenloom.index", "version": 99, "spec": "x"}).encode(), "version 99"),
    (json.dumps({"format": "tokenloom.index", "version": 1, "spec": "x", "schemas": [],
                 "files": [{"name": "a"}]}).encode(), "is not a tokenloom index this version can read"),
])
def test_unreadable_index_is_refused(data, tok_path, content, what):
    (data / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(ValueError, match=f"{MANIFEST_NAME} .*{what}.*delete it to list the files' footers instead"):
        build(str(data), tok_path)


def test_index_holds_what_the_column_checks_need(data, tok_path):
    pq.write_table(pa.table({"text": list(range(10))}), data / "sub" / "ints.parquet")
    assert index(str(data)) == 0  # the column exists; its type is checked by the loader that wants text
    with pytest.raises(ValueError, match=r"column 'text' in .*sub/ints\.parquet has type int64, not text"):
        build(str(data), tok_path)
    pq.write_table(pa.table({"body": ["x"] * 3}), data / "sub" / "ints.parquet")
    with pytest.raises(ValueError, match=r"column 'text' not found in .*sub/ints\.parquet; it has columns \['body'\]"):
        index(str(data))
    assert index(str(data), "--text-column", "") == 0  # no check asked: indexed anyway ...
    with pytest.raises(ValueError, match=r"column 'text' not found in .*sub/ints\.parquet"):
        build(str(data), tok_path)  # ... and the loader still refuses the file


def test_index_elsewhere_is_passed_as_manifest(data, tmp_path, tok_path, footer_reads):
    out = tmp_path / "indexes" / "web.json"
    out.parent.mkdir()
    assert index(str(data / "*.parquet"), "--out", str(out)) == 0
    assert not (data / MANIFEST_NAME).exists()
    footer_reads[0] = 0
    build(str(data / "*.parquet"), tok_path, manifest=str(out))
    build({"web": str(data / "*.parquet"), "code": str(data / "sub")}, tok_path, manifest={"web": str(out)})
    assert footer_reads[0] == FILES // 3  # only the "code" source, which has no index, read its footers
    with pytest.raises(FileNotFoundError, match=r"index .*nope\.json does not exist"):
        build(str(data), tok_path, manifest=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"manifest= names unknown sources \['wbe'\]"):
        build({"web": str(data)}, tok_path, manifest={"wbe": str(out)})


def test_a_json_glob_never_reads_the_index_as_data(tmp_path, tok_path):
    (tmp_path / "a.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20]))
    (tmp_path / MANIFEST_NAME).write_text("{}")
    loader = build(str(tmp_path / "*.json"), tok_path, epochs=1)
    list(loader)
    assert loader.stats()["documents"] == 20


def test_through_the_tokenloom_command(data, capsys):
    from tokenloom.cli import main

    assert main(["index", str(data), "--text-column", "text"]) == 0
    assert "indexed 12 parquet files" in capsys.readouterr().out
    assert main(["index", str(data / "missing")]) == 2
    assert "missing" in capsys.readouterr().err



def test_index_takes_debug_after_the_subcommand_like_every_command(data):
    from tokenloom.cli import main

    with pytest.raises(FileNotFoundError, match="missing"):  # --debug: the exception itself, not one line
        main(["index", str(data / "missing"), "--debug"])
