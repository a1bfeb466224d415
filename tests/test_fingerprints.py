"""Resume fingerprints follow content: a parquet file rewritten to the same size is refused with
its name, a jsonl/text file with a new mtime is a warning naming it, the tokenizer is
fingerprinted by content (path, object and re-saved copy agree), an index gives the same
fingerprint as the footers; and the format messages name what is wrong in one line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import warnings

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tokenloom.index_cmd import register
from tokenloom.pipes.sources import fingerprint as fpmod
from tokenloom.pipes import plan_source
from tokenloom.pipes.sources.fingerprint import check_sources, describe_source_change, source_fingerprint, source_warnings
from tokenloom.pipes.sources.files import SourceFile
from tokenloom.pipes.tokenizer import load_encoder
from tokenloom.recipes import pretrain
from tokenloom.pipes.loader.bridge import decode_state

from .conftest import synthetic_texts

TEXTS = synthetic_texts(300)


def write_parquet(path, texts) -> None:
    # No compression and no dictionary: a file's size depends only on its values' lengths.
    pq.write_table(pa.table({"text": texts}), path, row_group_size=32, compression="none", use_dictionary=False)


@pytest.fixture
def parquet_dir(tmp_path):
    root = tmp_path / "pq"
    root.mkdir()
    for f in range(3):
        write_parquet(root / f"part-{f:03d}.parquet", TEXTS[f * 100:(f + 1) * 100])
    return root


def rewrite_same_size(path) -> None:
    """Other text of the same lengths (letters swapped to the other case), so the same byte size."""
    before = os.path.getsize(path)
    texts = pq.read_table(path).column("text").to_pylist()
    write_parquet(path, [t.swapcase() for t in texts])
    assert os.path.getsize(path) == before


def build(spec, tok_path, **kw):
    return pretrain(spec, tokenizer=tok_path, seq_len=63, batch_size=2, packing="flat", **kw)


def state_after(loader, steps: int = 2):
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader.state_dict()


# --- parquet: the footer's hash ----------------------------------------------------------

def test_parquet_rewritten_to_the_same_size_is_refused_naming_it(parquet_dir, tok_path):
    loader = build(str(parquet_dir), tok_path)
    state = state_after(loader)
    rewrite_same_size(parquet_dir / "part-001.parquet")
    resumed = build(str(parquet_dir), tok_path)

    problem = describe_source_change("default", decode_state(state)["tokenloom"]["config"]["sources"]["default"],
                                     resumed.config["sources"]["default"])
    assert "part-001.parquet rewritten (same size" in problem and "part-000" not in problem, problem
    with pytest.raises(ValueError) as e:
        resumed.load_state_dict(state)
    # TODO(lead): passes once check_config calls fingerprint.check_sources for the "sources" key.
    assert "part-001.parquet" in str(e.value)


def test_resized_added_and_removed_files_are_named(parquet_dir, tok_path):
    saved = plan_source("web", str(parquet_dir)).fingerprint
    write_parquet(parquet_dir / "part-000.parquet", TEXTS[:50])
    os.remove(parquet_dir / "part-002.parquet")
    write_parquet(parquet_dir / "late.parquet", TEXTS[:7])
    problem = describe_source_change("web", saved, plan_source("web", str(parquet_dir)).fingerprint)
    assert "source 'web' changed" in problem
    for what in ("part-000.parquet resized (", "part-002.parquet removed (was", "late.parquet added (",
                 "(3 files then, 3 now)"):
        assert what in problem, (what, problem)
    assert "part-001" not in problem


def test_an_index_gives_the_fingerprint_of_the_footers(parquet_dir):
    plain = plan_source("default", str(parquet_dir)).fingerprint
    assert index(str(parquet_dir)) == 0
    assert plan_source("default", str(parquet_dir)).fingerprint == plain
    # ... and it is the footers' content, not the sizes: an index of a same-size rewrite differs
    rewrite_same_size(parquet_dir / "part-002.parquet")
    assert index(str(parquet_dir)) == 0
    indexed = plan_source("default", str(parquet_dir)).fingerprint
    assert indexed != plain
    os.remove(parquet_dir / "_tokenloom_index.json")
    assert plan_source("default", str(parquet_dir)).fingerprint == indexed


# --- jsonl and text: modification times, a warning -------------------------------------------

def write_line_files(root, fmt: str) -> str:
    root.mkdir()
    for f in range(2):
        docs = TEXTS[f * 50:(f + 1) * 50]
        if fmt == "jsonl":
            (root / f"part-{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        else:
            (root / f"part-{f}.txt").write_text("\n\n".join(docs))
        # Fixed times: the sketch names a changed file unless its old and new entries share all their cells
        # (~1 in 400 pairs of times: the warning then says "more than the state can name"), so times taken
        # from the clock made the tests that read the name fail at random.
        os.utime(root / f"part-{f}.{fmt}", ns=(1_700_000_000 * 10**9 + f, 1_700_000_000 * 10**9 + f))
    return str(root)


def touch_later(path) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_a_new_mtime_warns_naming_the_file(tmp_path, tok_path, fmt):
    spec = write_line_files(tmp_path / "docs", fmt)
    kw = {"text_mode": "paragraphs"} if fmt == "txt" else {}
    loader = build(spec, tok_path, **kw)
    state = state_after(loader)
    touch_later(os.path.join(spec, f"part-1.{fmt}"))
    resumed = build(spec, tok_path, **kw)

    saved, current = decode_state(state)["tokenloom"]["config"]["sources"], resumed.config["sources"]
    assert describe_source_change("default", saved["default"], current["default"]) == ""
    with pytest.warns(UserWarning, match=rf"part-1\.{fmt}\. jsonl and text files carry no content hash"):
        assert check_sources(saved, current) == []
    # TODO(lead): passes once check_config calls fingerprint.check_sources for the "sources" key.
    with pytest.warns(UserWarning, match=rf"other modification times .*part-1\.{fmt}"):
        resumed.load_state_dict(state)


def test_a_resized_jsonl_file_is_refused_and_its_mtime_not_warned(tmp_path):
    spec = write_line_files(tmp_path / "docs", "jsonl")
    saved = plan_source("default", spec).fingerprint
    with open(os.path.join(spec, "part-0.jsonl"), "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    current = plan_source("default", spec).fingerprint
    assert "part-0.jsonl resized (" in describe_source_change("default", saved, current)
    assert source_warnings("default", saved, current) == []  # the refusal says it all


# --- the bound: a fixed size, whatever the number of files ------------------------------------

def fake_files(n: int, **kw):
    fs = pafs.LocalFileSystem()
    return [SourceFile(f"/x/{i}", 1000 + i, f"shards/train-{i:06d}-of-{n:06d}.parquet", fs, key=f"{i * 7919:016x}",
                       **kw) for i in range(n)]


def test_the_fingerprint_has_a_fixed_bound_and_names_a_change_among_many_files():
    files = fake_files(20_000)
    saved = source_fingerprint("parquet", files)
    raw = fpmod.FILE_CELLS * (1 + fpmod.ELEMENT_BYTES + 4) + 64  # cells + zlib's worst-case overhead
    assert len(saved["sketch"]) <= 4 * math.ceil(raw / 3), len(saved["sketch"])
    changed = list(files)
    changed[12_345] = dataclasses.replace(changed[12_345], key="0123456789abcdef")
    problem = describe_source_change("web", saved, source_fingerprint("parquet", changed))
    assert "shards/train-012345-of-020000.parquet rewritten (same size" in problem, problem

    many = [dataclasses.replace(f, key="00") for f in files[:200]] + files[200:]
    problem = describe_source_change("web", saved, source_fingerprint("parquet", many))
    assert "than the state can name" in problem and "20,000 files then, 20,000 now" in problem


# --- the tokenizer by content ----------------------------------------------------------------

def test_tokenizer_path_object_and_resaved_copy_agree(tmp_path, tok_path):
    copy = tmp_path / "copy.json"
    with open(tok_path) as f:
        copy.write_text(json.dumps(json.load(f), indent=3, sort_keys=True))  # other text, same tokenizer
    prints = {load_encoder(tok_path).fingerprint, load_encoder(Tokenizer.from_file(tok_path)).fingerprint,
              load_encoder(str(copy)).fingerprint, load_encoder(Tokenizer.from_file(str(copy))).fingerprint}
    assert len(prints) == 1, prints


def test_tokenizer_with_a_changed_vocab_entry_differs(tmp_path, tok_path):
    with open(tok_path) as f:
        doc = json.load(f)
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same merges, other ids
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    assert load_encoder(str(other)).fingerprint != load_encoder(tok_path).fingerprint


def test_a_tokenizer_object_resumes_a_state_saved_with_its_path(parquet_dir, tok_path):
    state = state_after(build(str(parquet_dir), tok_path))
    build(str(parquet_dir), Tokenizer.from_file(tok_path)).load_state_dict(state)


# --- messages: unknown endings, JSON arrays, non-parquet files ---------------------------------

def index(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["index", *argv])
    return args.run(args)


@pytest.mark.parametrize("name", ["data.csv", "run.log"])
def test_an_unknown_ending_says_which_endings_are_read(tmp_path, tok_path, name):
    (tmp_path / name).write_text("a,b\n1,2\n")
    with pytest.raises(ValueError) as e:
        build(str(tmp_path / name), tok_path)
    message = str(e.value)
    assert "\n" not in message and "several kinds" not in message and "format" not in message
    assert f"{name}' has none of them" in message
    assert "parquet .parquet .pq, jsonl .jsonl .json .ndjson, txt .txt .md .text" in message


def test_a_glob_without_an_ending_reads_the_kind_it_matches(parquet_dir, tok_path):
    assert plan_source("default", str(parquet_dir / "part-*")).fmt == "parquet"


@pytest.mark.parametrize("layout", ["pretty", "one line"])
def test_a_json_array_is_fingerprinted_as_a_json_source(tmp_path, tok_path, layout):
    """A .json file holding one array is read (tests/test_json_sources.py); its state names the file
    when it changes, as a jsonl file's does."""
    stories = [{"story": t} for t in TEXTS[:40]]
    path = tmp_path / "TinyStories.json"
    indent = 2 if layout == "pretty" else None
    path.write_text(json.dumps(stories, indent=indent))
    state = state_after(build(str(path), tok_path, text_column="story"))
    build(str(path), tok_path, text_column="story").load_state_dict(state)
    path.write_text(json.dumps(stories + stories[:1], indent=indent))
    with pytest.raises(ValueError, match=r"TinyStories\.json resized"):
        build(str(path), tok_path, text_column="story").load_state_dict(state)


def test_index_of_a_jsonl_file_says_so(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError) as e:
        index(str(path))
    message = str(e.value)
    assert "truncated" not in message and "readable parquet" not in message
    assert "docs.jsonl is a jsonl file, and `tokenloom index` indexes parquet footers only" in message


def test_a_parquet_ending_on_other_bytes_is_not_called_truncated(tmp_path, tok_path):
    path = tmp_path / "docs.parquet"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError) as e:
        build(str(path), tok_path)
    message = str(e.value)
    assert "truncated" not in message
    assert "docs.parquet: it neither starts nor ends with the parquet magic b'PAR1'" in message
