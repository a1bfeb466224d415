"""JSON arrays and compressed JSON lines as sources (issue 17, items 1 and 2).

The corpora are written here: TinyStories-shaped ``.json`` files (one array of objects
per file, the text under ``story``, nested objects and lists beside it) whose strings
hold brackets, braces, escaped quotes, backslash runs, escaped newlines and non-ASCII
text, laid out compact, pretty-printed, ASCII-escaped and with a byte order mark; and
JSON lines compressed with gzip, zstd and bz2 through pyarrow. Every check compares
with ``json.loads`` of the whole file, and through ``pretrain`` the batches are taken
apart into segments and matched, token for token, with the documents: each exactly
once per epoch, with exact resume at 0 and 2 workers.
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import random

import numpy as np
import pyarrow as pa
import pytest

from tokenloom.pipes import ShardUnits, load_encoder, resolve_files
from tokenloom.pipes.sources import json_array, readers
from tokenloom.pipes.sources.jsonl import ReadJsonl, list_jsonl_units
from tokenloom.pipes.sources.readers import detect_format
from tokenloom.recipes import pretrain

from .resume import check_loader_resume, check_node_resume

SEQ_LEN = 63
BOS = 0  # the demo tokenizer's <|bos|>
#: Strings that trip a scanner that does not know JSON strings.
NASTY = ['she said "stop [now]" {twice}', "a ] and a } and a , outside? no: inside", "back\\slash", "ends with \\",
         'quote after backslashes \\\\"', "naïve café 東京の天気 😀 Ω≈∑", "line\nbreak and\ttab", '],[{"story": "fake"}',
         "{", "]", '\\"', "\\\\", "\u2028 separator", ""]
WORDS = "once upon a time there was a little dog named Max who liked to run in the park".split()
CODECS = {"gz": "gzip", "zst": "zstd", "bz2": "bz2"}


def stories(tag: str, n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [f"{tag}{i:04d} " + " ".join(rng.choices(WORDS, k=rng.randint(2, 10))) + " " + NASTY[i % len(NASTY)]
            for i in range(n)]


def record(text: str, i: int) -> dict:
    """A TinyStories record: the story, and nested fields full of brackets around it."""
    return {"story": text, "instruction": {"prompt:": "Write a story [short] {simple}", "words": ["dog", "]"],
                                           "features": [] if i % 2 else ["Dialogue", {"x": [1, {"y": "}"}]}]},
            "summary": f"summary {i} \"quoted\" [x]", "source": "GPT-4"}


LAYOUTS = {
    "compact": lambda recs: json.dumps(recs, ensure_ascii=False).encode(),
    "pretty": lambda recs: json.dumps(recs, indent=2).encode(),  # ASCII with \\u escapes, one line per field
    "tight_bom": lambda recs: b"\xef\xbb\xbf" + json.dumps(recs, separators=(",", ":"), ensure_ascii=False).encode(),
}


def write_tinystories(root) -> list:
    """Three array files (one per layout) and an empty array; returns the stories in file order."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for f, (layout, dump) in enumerate(LAYOUTS.items()):
        texts = stories(f"t{f}", 40 + 7 * f, seed=f)
        (root / f"data{f:02d}.json").write_bytes(dump([record(t, i) for i, t in enumerate(texts)]))
        out += texts
    (root / "data03.json").write_bytes(b" [ \n ] \n")
    return out


def write_compressed(path, texts, codec: str, *, array: bool = False) -> None:
    if array:
        data = json.dumps([record(t, i) for i, t in enumerate(texts)], ensure_ascii=False).encode()
    else:
        data = "".join(json.dumps(record(t, i), ensure_ascii=False) + "\n" for i, t in enumerate(texts)).encode()
    with pa.output_stream(str(path), compression=codec) as out:
        out.write(data)


def read_in_order(units, field="story", **kw) -> list:
    node = ReadJsonl(ShardUnits(units.rows, shard=0, num_shards=1, seed=0, epochs=1, shuffle=False), units,
                     field=field, shuffle_rows=False, **kw)
    node.reset(None)
    return [d.text for d in node]


@pytest.fixture
def small_units(monkeypatch):
    """Sources listed in units of 8 records, so a small file has many (a compressed one: merged)."""
    monkeypatch.setattr(readers, "list_jsonl_units", functools.partial(list_jsonl_units, rows_per_unit=8))


# --- pretrain: every story once per epoch, exact resume ------------------------------------

def documents_once(batches, texts, tok_path) -> None:
    """Every segment of the batches is a whole document (BOS + its tokens; the last token may sit
    in the row's last label), and every document appears exactly once."""
    ids = load_encoder(tok_path).encode_batch(texts)
    want = {tuple([BOS] + x.tolist()): i for i, x in enumerate(ids)}
    assert len(want) == len(texts), "documents must differ"
    assert max(map(len, want)) < SEQ_LEN, "a document longer than a row would be cut"
    seen = collections.Counter()
    for b in batches:
        inp, lab, seg = b["input_ids"].numpy(), b["labels"].numpy(), b["segment_ids"].numpy()
        for r in range(len(inp)):
            for k in set(seg[r].tolist()) - {0}:
                toks = inp[r][seg[r] == k].tolist()
                if seg[r, -1] == k and lab[r, -1] not in (BOS, -100):
                    toks.append(int(lab[r, -1]))  # the document's last token is the row's last label
                assert tuple(toks) in want, f"a segment that is no document: {toks[:12]}..."
                seen[want[tuple(toks)]] += 1
    assert sorted(seen) == list(range(len(texts))), f"documents never seen: {sorted(set(range(len(texts))) - set(seen))[:10]}"
    assert set(seen.values()) == {1}, f"documents seen twice: {[i for i, c in seen.items() if c > 1][:10]}"


def check_pretrain(source, texts, tok_path, num_workers: int) -> None:
    def build():
        return pretrain(source, tokenizer=tok_path, text_column="story", seq_len=SEQ_LEN, batch_size=2, bos=BOS,
                        buffer_size=16, epochs=1, num_workers=num_workers, seed=3)

    ref = check_loader_resume(build, steps=[1, 8, 21], total=None)
    assert len(ref) > 21
    documents_once(ref, texts, tok_path)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tinystories_arrays_train_with_exact_resume(tmp_path, tok_path, small_units, num_workers):
    texts = write_tinystories(tmp_path / "tinystories")
    check_pretrain(str(tmp_path / "tinystories"), texts, tok_path, num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("ext", ["jsonl.gz", "jsonl.zst"])
def test_compressed_jsonl_trains_with_exact_resume(tmp_path, tok_path, small_units, ext, num_workers):
    texts = stories("c", 150, seed=9)
    write_compressed(tmp_path / f"part-0.{ext}", texts[:90], CODECS[ext.rsplit(".", 1)[1]])
    write_compressed(tmp_path / f"part-1.{ext}", texts[90:], CODECS[ext.rsplit(".", 1)[1]])
    check_pretrain(str(tmp_path), texts, tok_path, num_workers)


# --- listing and reading ----------------------------------------------------------------------

def test_arrays_read_every_story_in_file_order(tmp_path):
    texts = write_tinystories(tmp_path)
    for rows_per_unit, max_unit_bytes in [(1000, 64 << 20), (3, 64 << 20), (1000, 500), (1, 1)]:
        units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story", rows_per_unit=rows_per_unit,
                                 max_unit_bytes=max_unit_bytes)
        assert read_in_order(units) == texts, (rows_per_unit, max_unit_bytes)
        assert units.blank_lines == 0 and units.rows.max() <= rows_per_unit


def test_pretty_array_units_start_at_their_lines(tmp_path):
    recs = [record(t, i) for i, t in enumerate(stories("p", 30, seed=1))]
    data = json.dumps(recs, indent=2)
    (tmp_path / "p.json").write_text(data)
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story", rows_per_unit=4)
    for u in range(len(units.rows)):
        start = int(units.start[u])
        assert data[:start].count("\n") + 1 == int(units.first_line[u])
        assert data[start:int(units.end[u])].strip()[0] == "{"  # a unit starts at its first element
        first = units.rows[:u].sum()
        assert json.loads("[" + data[start:int(units.end[u])] + "]") == recs[first:first + int(units.rows[u])]


def nasty_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(NASTY) + "\\" * rng.randrange(4) + '"' * rng.randrange(2)
    if kind == 1:
        return rng.choice([0, -1.5, 1e300, True, False, None])
    if kind == 2:
        return "".join(rng.choice('ab"\\[]{},: \n\u00e9\U0001F600') for _ in range(rng.randrange(12)))
    if kind == 3:
        return ""
    if kind == 4:
        return [nasty_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["k", "[", "}", '"', "\\"]) + str(j): nasty_value(rng, depth + 1) for j in range(rng.randrange(4))}


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64, 4096])
def test_array_scan_fuzz_against_json_loads(tmp_path, monkeypatch, chunk):
    """Random arrays of objects full of strings with brackets and backslash runs, every block size
    (runs of backslashes and strings cut at every boundary): the elements are json.loads' elements."""
    monkeypatch.setattr(json_array, "CHUNK_BYTES", chunk)
    rng = random.Random(chunk)
    for trial in range(12):
        recs = [{"story": nasty_value(rng), **{f"f{j}": nasty_value(rng) for j in range(rng.randrange(3))}}
                for _ in range(rng.randrange(0, 25))]
        dump = rng.choice([dict(), dict(indent=1), dict(separators=(",", ":")), dict(ensure_ascii=False)])
        path = tmp_path / f"{chunk}-{trial}.json"
        text = " \n" * rng.randrange(2) + json.dumps(recs, **dump) + "\n" * rng.randrange(3)
        path.write_bytes(text.encode())
        units = list_jsonl_units(resolve_files(str(path), "jsonl"), field=None, rows_per_unit=rng.randint(1, 6),
                                 max_unit_bytes=rng.choice([1, 200, 1 << 20]))
        assert units.total_rows == len(recs), (trial, text[:200])
        got = []
        data = path.read_bytes()
        for u in range(len(units.rows)):
            unit = data[int(units.start[u]):int(units.end[u])]
            starts, ends = json_array.split_elements(unit)
            assert len(starts) == units.rows[u]
            got += [json.loads(unit[a:b]) for a, b in zip(starts, ends)]
        assert got == recs, (trial, text[:200])


@pytest.mark.parametrize("codec", ["gzip", "zstd", "bz2"])
@pytest.mark.parametrize("array", [False, True], ids=["lines", "array"])
def test_compressed_files_read_every_record(tmp_path, codec, array):
    assert pa.Codec.is_available(codec), f"this pyarrow lacks {codec}: compressed sources need it"
    texts = stories("z", 200, seed=2)
    ext = {"gzip": "gz", "zstd": "zst", "bz2": "bz2"}[codec]
    path = tmp_path / f"x.{'json' if array else 'jsonl'}.{ext}"
    write_compressed(path, texts, codec, array=array)
    for rows_per_unit in (1000, 7):
        units = list_jsonl_units(resolve_files(str(path), "jsonl"), field="story", rows_per_unit=rows_per_unit)
        assert read_in_order(units) == texts
        assert len(units.rows) <= (1 if rows_per_unit == 1000 else 8)  # merged: a few units per compressed file
        assert units.files[0].key and units.files[0].mtime_ns is None


@pytest.mark.parametrize("name", ["x.jsonl.gz", "x.json.zst", "big.json"])
def test_resume_at_every_step_over_units_out_of_order(tmp_path, name):
    """Shuffled units over two shards and two epochs: a compressed unit behind the open stream
    starts the file over, one ahead continues it; a restore reads its unit again."""
    texts = stories("r", 90, seed=5)
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps([record(t, i) for i, t in enumerate(texts)]))
    else:
        write_compressed(path, texts, CODECS[name.rsplit(".", 1)[1]])
    units = list_jsonl_units(resolve_files(str(path), "jsonl"), field="story", rows_per_unit=4)
    assert len(units.rows) >= 8

    def build():
        return ReadJsonl(ShardUnits(units.rows, shard=1, num_shards=2, seed=4, epochs=2), units, field="story", seed=4)

    node = build()
    node.reset(None)
    got = [d.text for d in node]
    assert len(got) == 90 and set(got) <= set(texts)  # two epochs of this shard's half
    assert check_node_resume(build) == 90


# --- what the user is told ----------------------------------------------------------------

def test_a_cut_off_array_names_the_file_byte_and_line(tmp_path, tok_path):
    data = json.dumps([record(t, i) for i, t in enumerate(stories("m", 20, seed=1))], indent=2).encode()
    cut = data[:data.rindex(b'"story"') + 12]  # inside the last story's string
    (tmp_path / "cut.json").write_bytes(cut)
    with pytest.raises(ValueError) as e:
        pretrain(str(tmp_path / "cut.json"), tokenizer=tok_path, text_column="story", seq_len=SEQ_LEN, batch_size=2)
    message = str(e.value)
    assert "\n" not in message
    line = cut.count(b"\n") + 1
    assert (f"cut.json: the file ends inside a string: the array opened at byte 0 is cut off at byte {len(cut)} "
            f"(line {line})") in message


@pytest.mark.parametrize("bad,what", [
    (b'[{"story": "a"}] {"story": "b"}', "more follows the array that closed at byte 15 (b'{\"story\": \"b\"}') at byte 17"),
    (b'[{"story": "a"}, {"story": "b"}}', "'}' closes the array opened at byte 0 at byte 31"),
])
def test_an_array_closed_wrong_or_followed_by_more_is_refused(tmp_path, bad, what):
    (tmp_path / "bad.json").write_bytes(bad)
    with pytest.raises(ValueError) as e:
        list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story")
    assert f"bad.json: {what} (line 1); a JSON-array source holds one array" in str(e.value)


def test_a_malformed_element_names_the_file_element_byte_and_line(tmp_path, tok_path):
    good = [{"story": f"s{i}"} for i in range(6)]
    lines = json.dumps(good, indent=1).split("\n")
    bad_line = next(i for i, line in enumerate(lines) if '"s4"' in line)
    lines[bad_line] = lines[bad_line].replace('"story": "s4"', '"story" "s4"')  # no colon
    data = "\n".join(lines)
    (tmp_path / "bad.json").write_text(data)
    byte = data[:data.index('"story" "s4"')].rindex("{")  # where the element starts
    loader = pretrain(str(tmp_path / "bad.json"), tokenizer=tok_path, text_column="story", seq_len=SEQ_LEN,
                      batch_size=2, epochs=1)
    with pytest.raises(ValueError) as e:
        list(loader)
    assert f"bad.json, element 4 (byte {byte}, line {data[:byte].count(chr(10)) + 1}): malformed JSON: Expecting ':' " \
           "delimiter at line 2 column" in str(e.value)
    skipped = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story")
    assert read_in_order(skipped, on_error="skip") == ["s0", "s1", "s2", "s3", "s5"]


@pytest.mark.parametrize("content,why", [
    ('{\n  "data": [{"story": "a"}]\n}\n', "its first line '{' ends before the JSON value it starts does"),
    ('"a story"\n"another"\n', "its first record is a JSON str ('\"a story\"'), not an object"),
])
def test_a_json_file_that_is_neither_says_so(tmp_path, tok_path, content, why):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError) as e:
        pretrain(str(tmp_path / "config.json"), tokenizer=tok_path, text_column="story", seq_len=SEQ_LEN, batch_size=2)
    message = str(e.value)
    assert "\n" not in message and "malformed" not in message
    assert f"config.json is neither JSON lines nor a JSON array: {why}" in message


def test_a_missing_field_in_an_array_is_named_at_listing(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "x", "id": 1}, {"story": "y"}]))
    with pytest.raises(ValueError, match=r"a\.json, first record: no field 'story'; the element has keys \['id', 'text'\]"):
        list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story")


def test_compound_endings_are_detected(tmp_path, tok_path):
    for ext, codec in [("jsonl.gz", "gzip"), ("json.zst", "zstd"), ("ndjson.bz2", "bz2")]:
        write_compressed(tmp_path / f"a.{ext}", ["x"], codec)
        assert detect_format(str(tmp_path / f"a.{ext}")) == "jsonl"
    assert detect_format(str(tmp_path)) == "jsonl"
    assert [f.name for f in resolve_files(str(tmp_path), "jsonl")] == ["a.json.zst", "a.jsonl.gz", "a.ndjson.bz2"]
    (tmp_path / "b.csv.gz").write_bytes(gzip.compress(b"a,b\n"))
    with pytest.raises(ValueError, match=r"b\.csv\.gz' has none of them"):
        detect_format(str(tmp_path / "b.*"))


def test_a_missing_codec_is_named(tmp_path, monkeypatch):
    write_compressed(tmp_path / "a.jsonl.zst", ["x"], "zstd")
    class Codec:  # a pyarrow built without zstd
        is_available = staticmethod(lambda name: name != "zstd")

    monkeypatch.setattr(pa, "Codec", Codec)
    with pytest.raises(ValueError, match=r"a\.jsonl\.zst is zstd-compressed, but this pyarrow .* without the zstd "
                                         r"codec"):
        list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story")


def test_a_compressed_file_rewritten_to_the_same_size_is_refused(tmp_path, tok_path):
    """Stored (level 0) gzip: same-length content, same compressed size; the CRC in the tail differs."""
    def write(tag):
        lines = "".join(json.dumps({"story": f"{tag}{i:03d} " + " ".join(WORDS)}) + "\n" for i in range(60))
        (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(lines.encode(), compresslevel=0, mtime=0))

    def build():
        return pretrain(str(tmp_path), tokenizer=tok_path, text_column="story", seq_len=SEQ_LEN, batch_size=2)

    write("a")
    size = (tmp_path / "d.jsonl.gz").stat().st_size
    loader = build()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    build().load_state_dict(state)  # the same file: resumes
    write("b")
    assert (tmp_path / "d.jsonl.gz").stat().st_size == size
    with pytest.raises(ValueError, match=r"d\.jsonl\.gz rewritten \(same size"):
        build().load_state_dict(state)


def test_a_truncated_compressed_file_names_the_file(tmp_path):
    write_compressed(tmp_path / "a.jsonl.gz", stories("g", 400, seed=3), "gzip")
    data = (tmp_path / "a.jsonl.gz").read_bytes()
    (tmp_path / "a.jsonl.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read .*a\.jsonl\.gz: .*[Tt]runcated"):
        list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="story")
