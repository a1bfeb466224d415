"""The token cache (issue 18): `tokenloom tokenize` / `build_cache`, and `pretrain(..., cache=DIR)`.

On the stdlib corpus (two sources mixed, best-fit, 2 loader workers) the cache gives
bitwise the batches of tokenizing on the fly, and a state saved by either resumes
exactly on the other. A build killed with SIGKILL mid-way and restarted completes
with every unit whole. A cache of another tokenizer or of changed files is refused
naming which; a partial cache falls back to tokenizing (counted) or is refused with
``cache_strict=True``. The cache also lives on S3 (moto on loopback), and jsonl
(with null texts) and text sources go through it too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.cli import main
from tokenloom.pipes import load_encoder
from tokenloom.pipes.loader import decode_state
from tokenloom.pipes.pack.savepoint import SOURCE_FIELDS, SavePoint
from tokenloom.pipes.sources.cache import build_cache
from tokenloom.pipes.sources.cache_format import (TOKENS_DIR, WRITER_OPTIONS, UnitTexts, dtype_for, file_units,
                                                  ids_array, read_chars, read_ids)
from tokenloom.pipes.sources.readers import plan_source
from tokenloom.recipes import pretrain
from tokenloom.sample_data import train_tokenizer

from .conftest import synthetic_texts, write_corpus
from .resume import check_loader_resume, items_equal, torch_roundtrip
from .test_s3 import BUCKET, creds, s3  # noqa: F401  (fixtures: moto's S3 server and its credentials)

ARGS = dict(seq_len=95, batch_size=2, buffer_size=64, weights={"code": 0.6, "prose": 0.4})


@pytest.fixture(scope="module")
def sources(real_corpus):
    return {name: os.path.dirname(paths[0]) for name, paths in real_corpus.items()}


@pytest.fixture(scope="module")
def cache_dir(sources, tok_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cache") / "tokens")
    done = build_cache(sources, tok_path, out, processes=2)
    assert done["complete"] and all(s["built"] == s["files"] > 0 for s in done["sources"].values())
    return out


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _positions(state):
    """The loader state without what differs by design: documents encoded from text (also in a
    packer's save point, after each source's position fields), and the DataLoader's random base
    seed (each loader draws its own; tokenloom's nodes do not use it)."""
    if isinstance(state, dict) and set(state) == set(SavePoint.KEYS):
        return {**state, SavePoint.SOURCES: {n: e[:len(SOURCE_FIELDS)] for n, e in state[SavePoint.SOURCES].items()}}
    if isinstance(state, dict):
        return {k: _positions(v) for k, v in state.items() if k not in ("encoded", "_base_seed")}
    if isinstance(state, list):
        return [_positions(v) for v in state]
    return state


def test_cache_batches_are_bitwise_those_of_tokenizing_on_the_fly(sources, cache_dir, tok_path):
    fly = pretrain(sources, tokenizer=tok_path, num_workers=2, **ARGS)
    cached = pretrain(sources, tokenizer=tok_path, num_workers=2, cache=cache_dir, **ARGS)
    assert cached.config == fly.config  # nothing in what a resume checks mentions the cache
    a, b = _take(fly, 500), _take(cached, 500)
    for j, (x, y) in enumerate(zip(a, b)):
        assert items_equal(x, y), f"batch {j} from the cache differs from tokenizing on the fly"
    sa, sb = fly.stats(), cached.stats()
    for name in sources:
        assert sa["sources"][name]["tokenized"] > 0  # on the fly every document is encoded
        assert sb["sources"][name]["tokenized"] == 0, f"source {name!r}: the cache is complete, nothing to encode"
        assert {k: v for k, v in sa["sources"][name].items() if k != "tokenized"} == \
               {k: v for k, v in sb["sources"][name].items() if k != "tokenized"}
    # the same positions, node for node: only the count of documents encoded from text differs
    positions = [_positions(decode_state(x.state_dict())["loader"]) for x in (fly, cached)]
    assert positions[0] == positions[1]


@pytest.mark.parametrize("first", ["on_the_fly", "cache"])
def test_a_state_saved_by_one_resumes_exactly_on_the_other(sources, cache_dir, tok_path, first):
    def build(use_cache):
        return pretrain(sources, tokenizer=tok_path, num_workers=2, cache=cache_dir if use_cache else None, **ARGS)

    saver = build(first == "cache")
    it = iter(saver)
    for _ in range(41):
        next(it)
    state = torch_roundtrip(saver.state_dict())
    reference = [next(it) for _ in range(80)]
    del it, saver
    resumed = build(first != "cache")
    resumed.load_state_dict(state)
    it = iter(resumed)
    got = [next(it), next(it)]  # a batch of each worker: both counters are the restored graphs' now
    start = {n: s["tokenized"] for n, s in resumed.stats()["sources"].items()}
    got += [next(it) for _ in range(78)]
    for j, (want, have) in enumerate(zip(reference, got)):
        assert items_equal(want, have), f"batch {41 + j} after moving the state ({first} first) differs"
    end = {n: s["tokenized"] for n, s in resumed.stats()["sources"].items()}
    # documents encoded from text: on the fly they go on, on the cache they stand
    assert sum(end.values()) > sum(start.values()) if first == "cache" else end == start, (start, end)


def test_cached_loader_resumes_through_the_shared_helper(sources, cache_dir, tok_path):
    check_loader_resume(lambda: pretrain(sources, tokenizer=tok_path, num_workers=2, cache=cache_dir, **ARGS),
                        steps=[1, 33, 70], total=90)


def test_elastic_resume_carries_the_tokenized_count(sources, cache_dir, tok_path):
    old = pretrain(sources, tokenizer=tok_path, num_workers=2, **ARGS)
    _take(old, 300)
    state, before = old.state_dict(), old.stats()["sources"]
    new = pretrain(sources, tokenizer=tok_path, num_workers=1, cache=cache_dir, **ARGS)
    new.load_state_dict([state])
    carried = {n: s["tokenized"] for n, s in new.stats()["sources"].items()}
    # as of the old shards' restore points (what their states hold), so at most what the loop had seen
    assert sum(carried.values()) > 0 and all(carried[n] <= before[n]["tokenized"] for n in sources), (carried, before)
    _take(new, 20)
    assert {n: s["tokenized"] for n, s in new.stats()["sources"].items()} == carried  # the cache encodes nothing


# --- partial caches, refusals -------------------------------------------------------

def test_partial_cache_falls_back_counted_or_is_refused_when_strict(sources, tok_path, tmp_path):
    out = str(tmp_path / "half")
    done = build_cache(sources, tok_path, out, rank=1, world_size=3, processes=1)  # some code files, no prose
    assert not done["complete"]
    built = {n: s["built"] for n, s in done["sources"].items()}
    assert 0 < sum(built.values()) < sum(len(os.listdir(d)) for d in sources.values())
    with pytest.raises(ValueError, match=r"cache_strict=True, but .* not in the token cache"):
        pretrain(sources, tokenizer=tok_path, cache=out, cache_strict=True, **ARGS)
    with pytest.warns(UserWarning, match="tokenized on the fly"):
        cached = pretrain(sources, tokenizer=tok_path, num_workers=2, cache=out, **ARGS)
    fly = pretrain(sources, tokenizer=tok_path, num_workers=2, **ARGS)
    a, b = _take(fly, 150), _take(cached, 150)
    for j, (x, y) in enumerate(zip(a, b)):
        assert items_equal(x, y), f"batch {j} from a partial cache differs from tokenizing on the fly"
    counted = {n: s["tokenized"] for n, s in cached.stats()["sources"].items()}
    fly_counted = {n: s["tokenized"] for n, s in fly.stats()["sources"].items()}
    for name in sources:  # a source with no file cached is tokenized as on the fly; a fully cached one not at all
        if built[name] == 0:
            assert counted[name] == fly_counted[name] > 0
        else:
            assert counted[name] < fly_counted[name]
    assert sum(counted.values()) > 0


def test_cache_of_another_tokenizer_is_refused_naming_it(sources, cache_dir, tmp_path):
    other = tmp_path / "other.json"
    train_tokenizer(synthetic_texts(300), vocab_size=400).save(str(other))
    with pytest.raises(ValueError, match="built with another tokenizer"):
        pretrain(sources, tokenizer=str(other), cache=cache_dir, **ARGS)
    with pytest.raises(ValueError, match="tokenizer"):  # and a build into it with another tokenizer
        build_cache(sources, str(other), cache_dir, processes=1)


def test_cache_of_an_older_format_is_refused_saying_rebuild(sources, cache_dir, tok_path, tmp_path):
    old = str(tmp_path / "old")
    shutil.copytree(cache_dir, old)
    folder = os.path.join(old, "code")
    part = next(os.path.join(folder, p) for p in os.listdir(folder) if p.startswith("manifest-"))
    doc = json.load(open(part))
    doc["version"] = 1  # ids as list<uint16>, before they were stored as bytes
    json.dump(doc, open(part, "w"))
    with pytest.raises(ValueError, match=r"manifest of version 2 \(format and version \('tokenloom.cache', 1\)\).*"
                                         r"build the cache again"):
        pretrain(sources, tokenizer=tok_path, cache=old, **ARGS)


def test_a_cache_file_whose_ids_are_not_bytes_is_refused_naming_it(sources, cache_dir, tok_path, tmp_path):
    """A cache file rewritten with ids as list<uint16> (the manifest updated to its size) fails at its first
    read, naming the file and row group, instead of being read as bytes."""
    bad = str(tmp_path / "bad")
    shutil.copytree(cache_dir, bad)
    folder = os.path.join(bad, "code")
    part = next(os.path.join(folder, p) for p in os.listdir(folder) if p.startswith("manifest-"))
    doc = json.load(open(part))
    for entry in doc["files"].values():
        path = os.path.join(folder, entry["cache"])
        pf = pq.ParquetFile(path)
        groups = [pf.read_row_group(g) for g in range(pf.metadata.num_row_groups)]
        with pq.ParquetWriter(path + ".new", pa.schema([("ids", pa.list_(pa.uint16())), ("chars", pa.uint32())])) as w:
            for t in groups:
                values, offsets, _ = read_ids(t.column("ids"), "uint16")
                ids = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))
                w.write_table(pa.table({"ids": ids, "chars": t.column("chars")}), row_group_size=t.num_rows)
        os.replace(path + ".new", path)
        entry["cache_bytes"] = os.path.getsize(path)
    json.dump(doc, open(part, "w"))
    loader = pretrain(sources, tokenizer=tok_path, cache=bad, **ARGS)
    with pytest.raises(RuntimeError, match=r"cannot read cache file .*/code/tokens/\w+\.parquet, row group \d+ .*"
                                           r"'ids' column is list<\w+: uint16>, not binary"):
        _take(loader, 50)


def test_ids_of_a_part_of_a_token_are_refused():
    with pytest.raises(ValueError, match="not a whole number of uint16 ids"):
        read_ids(pa.array([b"\x01\x00", b"\x01\x00\x02"], pa.binary()), "uint16")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_ids_column_round_trips_through_parquet(tmp_path_factory, dtype, data):
    """What the build writes, the reader reads back: every row's ids, nulls, empty rows, any dtype
    (here through a parquet file written with the cache's settings, and a sliced column)."""
    top = np.iinfo(dtype).max
    rows = data.draw(st.lists(st.one_of(st.none(), st.lists(st.integers(0, top), max_size=40)), max_size=30))
    lengths = [0 if r is None else len(r) for r in rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.array([x for r in rows if r is not None for x in r], dtype=dtype)
    valid = np.array([r is not None for r in rows], bool)
    column = ids_array(values, offsets, None if valid.all() else valid, dtype)
    path = str(tmp_path_factory.mktemp("ids") / "u.parquet")
    pq.write_table(pa.table({"ids": column, "chars": pa.array(lengths, pa.uint32())}), path, **WRITER_OPTIONS)
    read = pq.read_table(path).column("ids")
    lo = data.draw(st.integers(0, len(rows)))
    for col, want in ((read, rows), (read.slice(lo), rows[lo:]), (column.slice(lo), rows[lo:])):
        got_values, got_offsets, got_valid = read_ids(col, dtype)
        got = [None if got_valid is not None and not got_valid[i] else
               got_values[got_offsets[i]:got_offsets[i + 1]].tolist() for i in range(len(want))]
        assert got == want and len(got_offsets) == len(want) + 1
    chars = pq.read_table(path).column("chars")
    for col, want_chars in ((chars, lengths), (chars.slice(lo), lengths[lo:])):
        assert read_chars(col).tolist() == want_chars


READS_ALONE = r'''
import json, sys
import pyarrow.parquet as pq
from tokenloom.pipes.sources.cache_format import read_chars, read_ids
from tokenloom.recipes import pretrain
sources, tok, cache, nulls = json.loads(sys.argv[1])
batch = next(iter(pretrain(sources, tokenizer=tok, cache=cache, num_workers=0, seq_len=95, batch_size=2)))
table = pq.ParquetFile(nulls).read_row_group(0)
read_ids(table.column("ids"), "uint16"), read_chars(table.column("chars"))
print(json.dumps(sorted(m for m in ("pandas", "pyarrow.compute") if m in sys.modules)))
'''


def test_reading_a_cache_imports_neither_pandas_nor_pyarrow_compute(sources, cache_dir, tok_path, tmp_path):
    """The cache is read from its arrays' buffers: pyarrow's ``to_numpy`` imports pandas on its first
    call in a process (0.2-0.45 s in each freshly forked loader worker: most of the first batch read
    from a cache), ``is_valid`` imports ``pyarrow.compute``. Checked in a fresh interpreter, with a
    unit holding null rows too."""
    nulls = str(tmp_path / "nulls.parquet")
    column = ids_array(np.array([1, 2, 3], np.uint16), np.array([0, 1, 1, 3]), np.array([True, False, True]), "uint16")
    pq.write_table(pa.table({"ids": column, "chars": pa.array([1, 0, 2], pa.uint32())}), nulls, **WRITER_OPTIONS)
    out = subprocess.run([sys.executable, "-c", READS_ALONE, json.dumps([sources, tok_path, cache_dir, nulls])],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_cache_of_changed_files_is_refused_naming_them(sources, tok_path, tmp_path):
    local = {n: str(tmp_path / n) for n in sources}
    for n, d in sources.items():
        shutil.copytree(d, local[n])
    out = str(tmp_path / "cache")
    build_cache(local, tok_path, out, processes=1)
    victim = sorted(f for f in os.listdir(local["code"]) if f.endswith(".parquet"))[1]
    table = pq.read_table(os.path.join(local["code"], victim))
    texts = table.column("text").to_pylist()
    pq.write_table(pa.table({"text": texts[:-3]}), os.path.join(local["code"], victim), row_group_size=25)
    with pytest.raises(ValueError, match=rf"built from other contents of {victim} resized"):
        pretrain(local, tokenizer=tok_path, cache=out, **ARGS)
    done = build_cache(local, tok_path, out, processes=1)  # only that file is built again
    assert done["sources"]["code"]["built"] == 1 and done["sources"]["prose"]["built"] == 0 and done["complete"]
    a = _take(pretrain(local, tokenizer=tok_path, **ARGS), 60)
    b = _take(pretrain(local, tokenizer=tok_path, cache=out, cache_strict=True, **ARGS), 60)
    assert all(items_equal(x, y) for x, y in zip(a, b))


# --- interrupted builds ------------------------------------------------------------------

JOB = textwrap.dedent("""
    import sys, time
    from tokenloom.pipes.sources.cache import build_cache
    # paced so the kill lands mid-way: 40 ms after each unit is written (the parent writes, 2 processes encode)
    build_cache(sys.argv[1], sys.argv[2], sys.argv[3], processes=2, progress=lambda c: time.sleep(0.04))
""")


def _unit_ids_match_texts(glob, tok_path, folder):
    """Every unit of every cache file holds the ids of its texts, row for row (nulls where null)."""
    plan = plan_source("default", glob)
    enc = load_encoder(tok_path)
    texts = UnitTexts(plan)
    manifest = {}
    for name in os.listdir(folder):
        if name.startswith("manifest-"):
            manifest.update(json.load(open(os.path.join(folder, name)))["files"])
    assert len(manifest) == len(plan.units.files)
    for i, units in file_units(plan).items():
        entry = manifest[plan.units.files[i].name]
        pf = pq.ParquetFile(os.path.join(folder, entry["cache"]))
        assert pf.metadata.num_row_groups == len(units)
        for g, u in enumerate(units):
            docs = texts(int(u))
            values, offsets, valid = read_ids(pf.read_row_group(g).column("ids"), dtype_for(enc.vocab_size))
            got = [None if valid is not None and not valid[i] else values[offsets[i]:offsets[i + 1]].tolist()
                   for i in range(len(offsets) - 1)]
            want = [None if t is None else ids.tolist() for t, ids in zip(docs, enc.encode_batch(
                [t if t is not None else "" for t in docs]))]
            assert got == want, f"unit {u} (row group {g} of {entry['cache']}) is not the ids of its texts"


def test_build_killed_mid_way_resumes_and_every_unit_is_whole(tmp_path, tok_path):
    texts = synthetic_texts(1200, seed=3)
    write_corpus(str(tmp_path / "data"), texts, files=8, row_group_size=25)
    glob, out = str(tmp_path / "data" / "*.parquet"), str(tmp_path / "cache")
    folder = os.path.join(out, "default")
    proc = subprocess.Popen([sys.executable, "-c", JOB, glob, tok_path, out], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    listed, tmp_files = 0, []
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            parts = [p for p in os.listdir(folder) if p.startswith("manifest-") and p.endswith(".json")] \
                if os.path.isdir(folder) else []  # not a part being written (".json.tmp-..."), renamed any moment
            tokens = os.path.join(folder, TOKENS_DIR)
            tmp_files = [f for f in os.listdir(tokens) if ".tmp-" in f] if os.path.isdir(tokens) else []
            try:
                listed = len(json.load(open(os.path.join(folder, parts[0])))["files"]) if parts else 0
            except (ValueError, FileNotFoundError):  # replaced between the listing and the open
                listed = 0
            if listed >= 2 and tmp_files:
                break
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert 2 <= listed < 8 and tmp_files, f"the kill did not land mid-way ({listed} files done, {tmp_files})"
    # what the killed build left: whole cache files (the ones listed), a temporary one, no half unit in place
    entries = json.load(open(os.path.join(folder, [p for p in os.listdir(folder) if p.startswith("manifest-")][0])))
    for entry in entries["files"].values():
        pf = pq.ParquetFile(os.path.join(folder, entry["cache"]))
        assert [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)] == entry["units"]

    done = build_cache(glob, tok_path, out, processes=2)
    assert done["complete"] and done["sources"]["default"]["reused"] == listed
    assert done["sources"]["default"]["built"] == 8 - listed
    assert not [f for f in os.listdir(os.path.join(folder, TOKENS_DIR)) if ".tmp-" in f]
    _unit_ids_match_texts(glob, tok_path, folder)
    args = dict(seq_len=63, batch_size=4, buffer_size=40, epochs=1)
    a = list(pretrain(glob, tokenizer=tok_path, num_workers=2, **args))
    b = list(pretrain(glob, tokenizer=tok_path, num_workers=2, cache=out, cache_strict=True, **args))
    assert len(a) == len(b) > 10 and all(items_equal(x, y) for x, y in zip(a, b))


# --- other formats, remote storage, the command line ----------------------------------------

def test_jsonl_with_nulls_and_text_paragraphs(tmp_path, tok_path):
    texts = synthetic_texts(400, seed=5)
    with open(tmp_path / "a.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": None if i % 37 == 5 else t}) + "\n")
    (tmp_path / "notes").mkdir()
    for k in range(3):
        (tmp_path / "notes" / f"n{k}.txt").write_text("\n\n".join(texts[k * 50:(k + 1) * 50]) + "\n")
    src = {"web": str(tmp_path / "a.jsonl"), "notes": str(tmp_path / "notes")}
    out = str(tmp_path / "cache")
    build_cache(src, tok_path, out, text_mode="paragraphs", processes=2)
    args = dict(seq_len=63, batch_size=3, buffer_size=30, epochs=1, text_mode="paragraphs")

    def build(use_cache):
        return pretrain(src, tokenizer=tok_path, cache=out if use_cache else None, **args)

    a, b = list(build(False)), list(build(True))
    assert len(a) == len(b) > 20 and all(items_equal(x, y) for x, y in zip(a, b))
    cached = build(True)
    list(cached)
    assert cached.stats()["sources"]["web"]["skipped"] == sum(1 for i in range(400) if i % 37 == 5)
    check_loader_resume(lambda: build(True), steps=[3, 17], reference=a)
    with pytest.raises(ValueError, match="text_mode 'paragraphs'"):  # built per paragraph, read per file
        pretrain(src, tokenizer=tok_path, cache=out, seq_len=63)


def test_cache_on_s3(s3, creds, tok_path):
    endpoint, _, _, local, _ = s3
    query = f"?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    src = f"s3://{BUCKET}/web/2024/*.parquet{query}"
    out = f"s3://{BUCKET}/cache/run1{query}"
    done = build_cache({"web": src}, tok_path, out, processes=2)
    assert done["complete"] and done["sources"]["web"]["built"] == 3
    again = build_cache({"web": src}, tok_path, out, processes=2)
    assert again["sources"]["web"]["reused"] == 3 and again["sources"]["web"]["built"] == 0
    args = dict(seq_len=127, batch_size=4, buffer_size=24, epochs=1, num_workers=2)
    a = list(pretrain({"web": src}, tokenizer=tok_path, **args))
    cached = pretrain({"web": src}, tokenizer=tok_path, cache=out, cache_strict=True, **args)
    b = list(cached)
    assert len(a) == len(b) > 5 and all(items_equal(x, y) for x, y in zip(a, b))
    assert cached.stats()["sources"]["web"]["tokenized"] == 0


def test_command_line_builds_and_run_reads_it(sources, tok_path, tmp_path, capsys):
    out = str(tmp_path / "cache")
    named = [f"{n}={d}" for n, d in sources.items()]
    assert main(["tokenize", *named, "--tokenizer", tok_path, "--out", out, "--processes", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "(complete)" in printed and "bytes/token" in printed
    run = ["run", *named, "--tokenizer", tok_path, "--seq-len", "95", "--batch-size", "2", "--steps", "30", "--quiet"]
    assert main([*run, "--dump-batches", str(tmp_path / "a.pt")]) == 0
    assert main([*run, "--cache", out, "--cache-strict", "--dump-batches", str(tmp_path / "b.pt")]) == 0
    import torch

    a, b = torch.load(tmp_path / "a.pt", weights_only=True), torch.load(tmp_path / "b.pt", weights_only=True)
    assert len(a) == len(b) == 30 and all(items_equal(x, y) for x, y in zip(a, b))
    other = tmp_path / "other.json"
    train_tokenizer(synthetic_texts(300), vocab_size=400).save(str(other))
    capsys.readouterr()
    assert main(["tokenize", *named, "--tokenizer", str(other), "--out", out, "--quiet"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["tokenize", *named, "--tokenizer", tok_path, "--out", out, "--processes", "0"]) == 2
