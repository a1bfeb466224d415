"""jsonl and plain-text sources: listing, reading, bad input, and exact resume.

Every corpus here is written by the test into a tmp dir, with the awkward cases
real files have: blank and whitespace-only lines, CRLF line endings, no newline
at the end, a byte order mark, empty files, non-ASCII text. The expected
documents are computed by a separate, line-by-line Python reference, and the
fuzz test cuts files at every chunk boundary the listing could meet.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from tokenloom.pipes import (Batch, BestFitPack, ShardContext, ShardUnits, Tokenize, TokenLoomLoader,
                             load_encoder, resolve_files)
from tokenloom.pipes.sources import line_listing
from tokenloom.pipes.sources.jsonl import ReadJsonl, list_jsonl_units
from tokenloom.pipes.sources.line_listing import list_text_units
from tokenloom.pipes.sources.text_files import ReadText

from .conftest import synthetic_texts
from .resume import check_loader_resume, check_node_resume

WS = " \t\n\r\x0b\x0c"
UNICODE = ["naïve café", "東京の天気は晴れ", "emoji 😀 and a ZWJ 👩‍👩‍👧", "combining é and ́", "Ω ≈ ∑ — “quotes”",
           "tab\tinside", "line\nbreak inside a json string"]


# --- corpora ---------------------------------------------------------------------------

def _texts(tag: str, n: int):
    return [f"{tag}{i:03d} {UNICODE[i % len(UNICODE)]}" for i in range(n)]


def write_jsonl_corpus(root) -> list:
    """Five files (sorted by name) and the documents they hold, in file order."""
    os.makedirs(root, exist_ok=True)
    a, b, e = _texts("a", 40), _texts("b", 25), _texts("e", 10)
    lines = []
    for i, t in enumerate(a):  # LF, blank and whitespace-only lines sprinkled in, raw and escaped unicode
        lines.append(json.dumps({"id": i, "text": t}, ensure_ascii=i % 2 == 0))
        if i % 7 == 3:
            lines.append("")
        if i % 11 == 5:
            lines.append("  \t ")
    (root / "a.jsonl").write_bytes(("\n".join(lines) + "\n").encode())
    crlf = "\r\n".join(json.dumps({"text": t, "n": [1, 2]}, ensure_ascii=False) for t in b)
    (root / "b.jsonl").write_bytes(crlf.encode())  # CRLF, and no newline at the end
    (root / "c.jsonl").write_bytes(b"")  # 0 lines
    (root / "d.jsonl").write_bytes(b"\n  \n\t\r\n")  # only blank lines
    (root / "e.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": t}) + "\n" for t in e).encode())
    return a + b + e


def reference_paragraphs(data: bytes) -> list:
    """Paragraphs by the definition, one line at a time: maximal runs of lines that are not
    all ASCII whitespace, joined, stripped, CRLF -> LF."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    out, run = [], []
    for line in data.split(b"\n") + [b""]:
        if line.strip(WS.encode()):
            run.append(line)
        elif run:
            out.append(b"\n".join(run).decode().strip(WS).replace("\r\n", "\n"))
            run = []
    return out


def reference_lines(data: bytes) -> list:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    return [line for line in data.split(b"\n") if line.strip(WS.encode())]


def write_paragraph_corpus(root) -> list:
    os.makedirs(root, exist_ok=True)
    files = {
        # tutorial-style: double newlines, plus triple and whitespace-only separators, indented lines
        "p1.txt": "\n\n".join(f"{t}\nsecond line of {i}\n    indented" for i, t in enumerate(_texts("p", 30)))
                  + "\n\n\n" + "q1 after a triple\n \t \nq2 after a whitespace-only line\n",
        # CRLF throughout, no newline at the end
        "p2.txt": "\r\n\r\n".join(f"{t}\r\ncrlf {i}" for i, t in enumerate(_texts("c", 20))),
        "p3.txt": "",  # empty
        "p4.txt": "\n\n  \n",  # only blank lines
        # leading blank lines, one paragraph, no trailing newline
        "p5.md": "\n\n\nlonely " + UNICODE[2],
    }
    docs = []
    for name in sorted(files):
        data = files[name].encode()
        (root / name).write_bytes(data)
        docs += reference_paragraphs(data)
    return docs


def write_file_corpus(root) -> list:
    os.makedirs(root, exist_ok=True)
    texts = {f"f{i:02d}.txt": f"{t}\nmore\r\nlines\n" for i, t in enumerate(_texts("f", 12))}
    texts["f99.txt"] = ""  # an empty file is no document
    for name, t in texts.items():
        (root / name).write_bytes(t.encode())
    return [texts[k].replace("\r\n", "\n") for k in sorted(texts) if texts[k]]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    root = tmp_path_factory.mktemp("jsonl")
    docs = write_jsonl_corpus(root)
    return resolve_files(str(root), "jsonl"), docs


@pytest.fixture(scope="module")
def paragraphs(tmp_path_factory):
    root = tmp_path_factory.mktemp("paragraphs")
    docs = write_paragraph_corpus(root)
    return resolve_files(str(root), "txt"), docs


@pytest.fixture(scope="module")
def whole_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    docs = write_file_corpus(root)
    return resolve_files(str(root), "txt"), docs


def units_of(kind: str, files, rows_per_unit: int = 7):
    if kind == "jsonl":
        return list_jsonl_units(files, rows_per_unit=rows_per_unit)
    return list_text_units(files, mode=kind, rows_per_unit=rows_per_unit)


def reader(kind: str, units, *, shard=0, num_shards=1, epochs=1, shuffle=True, seed=3, **kw):
    parent = ShardUnits(units.rows, shard=shard, num_shards=num_shards, seed=seed, epochs=epochs, shuffle=shuffle)
    if kind == "jsonl":
        return ReadJsonl(parent, units, seed=seed, shuffle_rows=shuffle, **kw)
    return ReadText(parent, units, seed=seed, shuffle_rows=shuffle, **kw)


def read_all(node) -> list:
    node.reset(None)
    return list(node)


KINDS = ["jsonl", "paragraphs", "file"]


@pytest.fixture
def corpus_of(jsonl, paragraphs, whole_files):
    return {"jsonl": jsonl, "paragraphs": paragraphs, "file": whole_files}.__getitem__


# --- listing and reading ------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_reads_every_document_in_file_order(corpus_of, kind):
    files, docs = corpus_of(kind)
    units = units_of(kind, files)
    got = read_all(reader(kind, units, shuffle=False))
    assert [d.text for d in got] == docs
    assert units.total_rows == len(docs)
    assert (units.rows > 0).all() and (units.rows <= 7).all()


def test_jsonl_listing_records_lines_offsets_and_blanks(jsonl):
    files, docs = jsonl
    units = list_jsonl_units(files, rows_per_unit=7)
    # 40 + 25 + 10 rows in units of 7; the empty and blank-only files give no unit
    assert units.rows.tolist() == [7] * 5 + [5] + [7] * 3 + [4] + [7, 3]
    assert sorted(set(units.file.tolist())) == [0, 1, 4]
    assert units.blank_lines == 6 + 4 + 3  # a.jsonl: 6 empty + 4 whitespace-only; d.jsonl: 3
    for u in range(len(units.rows)):
        f = units.files[int(units.file[u])]
        data = open(f.path, "rb").read()
        start = int(units.start[u])
        # a unit starts at the start of a record, on the line it claims
        assert data[start:start + 1] == b"{" and (start in (0, 3) or data[start - 1:start] == b"\n")
        assert data[:start].count(b"\n") + 1 == int(units.first_line[u])
    assert units.start[-2] == 3  # e.jsonl: the byte order mark is not part of the first unit


def test_units_respect_the_byte_cap(tmp_path):
    lines = [json.dumps({"text": "x" * (10 + 37 * (i % 5))}) for i in range(200)]
    (tmp_path / "x.jsonl").write_text("\n".join(lines) + "\n")
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), rows_per_unit=50, max_unit_bytes=1000)
    ends = np.cumsum([len(x) + 1 for x in lines])  # byte offset after each line
    starts = ends - [len(x) + 1 for x in lines]
    assert units.total_rows == 200 and len(units.rows) > 4  # more units than the row limit alone makes
    for u in range(len(units.rows)):
        start, end, rows = int(units.start[u]), int(units.end[u]), int(units.rows[u])
        last_row_start = starts[np.searchsorted(starts, end) - 1]
        assert last_row_start < start + 1000  # no row starts past the cap (a row may end past it)
        if u + 1 < len(units.rows):  # and units are as large as allowed
            assert rows == 50 or end >= start + 1000
    assert [d.text for d in read_all(reader("jsonl", units, shuffle=False))] == [json.loads(x)["text"] for x in lines]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_shards_are_disjoint_and_cover_every_document(corpus_of, kind, num_shards):
    files, docs = corpus_of(kind)
    units = units_of(kind, files, rows_per_unit=5)
    for epoch_docs in range(2):  # each epoch: every document exactly once over all shards
        seen = []
        for shard in range(num_shards):
            node = reader(kind, units, shard=shard, num_shards=num_shards, epochs=1, seed=10 + epoch_docs)
            seen += [d.text for d in read_all(node)]
        assert Counter(seen) == Counter(docs)


@pytest.mark.parametrize("kind", KINDS)
def test_epochs_reshuffle(corpus_of, kind):
    files, docs = corpus_of(kind)
    units = units_of(kind, files, rows_per_unit=5)
    got = [d.text for d in read_all(reader(kind, units, epochs=2))]
    first, second = got[:len(docs)], got[len(docs):]
    assert Counter(first) == Counter(second) == Counter(docs)
    assert first != second


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shard", [0, 1, 2])
def test_resume_at_every_step(corpus_of, kind, shard):
    files, docs = corpus_of(kind)
    units = units_of(kind, files, rows_per_unit=4)
    n = check_node_resume(lambda: reader(kind, units, shard=shard, num_shards=3, epochs=2), max_steps=400,
                          horizon=3)
    share = (shard + 1) * len(docs) // 3 - shard * len(docs) // 3
    assert n == 2 * share  # both epochs, to the end


def test_conversations_keep_the_parsed_value(tmp_path):
    convs = [[{"role": "user", "content": f"q{i} 東京"}, {"role": "assistant", "content": f"a{i}"}] for i in range(9)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="messages", rows_per_unit=4)
    got = read_all(reader("jsonl", units, shuffle=False, field="messages", require_type=list))
    assert [d.text for d in got] == convs


def test_paragraphs_match_the_tutorial_split(tmp_path):
    """The seed tutorial's `[t.strip() for t in text.split('\\n\\n') if t.strip()]`, read in text mode."""
    rng = np.random.default_rng(1)
    paras = [" ".join(rng.choice(["alpha", "beta", "γ", "δέλτα", "x\ny", "  lead", "trail  "], rng.integers(1, 8)))
             for _ in range(60)]
    text = "".join(p + "\n" * int(rng.integers(2, 5)) for p in paras)
    (tmp_path / "t.txt").write_bytes(text.replace("\n", "\r\n").encode())
    with open(tmp_path / "t.txt", encoding="utf-8") as f:  # the tutorial's reading, universal newlines
        tutorial = [t.strip() for t in f.read().split("\n\n") if t.strip()]
    units = list_text_units(resolve_files(str(tmp_path), "txt"), mode="paragraphs", rows_per_unit=9)
    assert [d.text for d in read_all(reader("paragraphs", units, shuffle=False))] == tutorial
    # where the tutorial keeps a whitespace-only line inside a document, it separates two here
    (tmp_path / "t.txt").write_bytes(b"one\n   \ntwo\n")
    units = list_text_units(resolve_files(str(tmp_path), "txt"), mode="paragraphs")
    assert [d.text for d in read_all(reader("paragraphs", units, shuffle=False))] == ["one", "two"]


@pytest.mark.parametrize("chunk", [4, 5, 7, 16, 61])
@pytest.mark.parametrize("vector_steps", [0, 2, 32])
def test_fuzz_against_the_line_by_line_reference(tmp_path, monkeypatch, chunk, vector_steps):
    """Random bytes of whitespace, text, CR and LF, listed with tiny read chunks (so lines
    and BOMs straddle chunk edges) through both blank-line checks, must give exactly the
    reference's documents."""
    monkeypatch.setattr(line_listing, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(line_listing, "_VECTOR_STEPS", vector_steps)
    rng = np.random.default_rng(chunk * 7 + vector_steps)
    alphabet = [" ", "\t", "\r", "\n", "\n", "\n", "x", "é", "😀", "\x0b", "ab"]
    for case in range(25):
        text = "".join(rng.choice(alphabet, int(rng.integers(0, 120))))
        data = (b"\xef\xbb\xbf" if case % 5 == 0 else b"") + text.encode()
        (tmp_path / "f.txt").write_bytes(data)
        (tmp_path / "f.jsonl").write_bytes(data)
        rpu = int(rng.integers(1, 5))
        paras = list_text_units(resolve_files(str(tmp_path / "f.txt"), "txt"), mode="paragraphs",
                                rows_per_unit=rpu, max_unit_bytes=int(rng.integers(1, 50)))
        want = reference_paragraphs(data)
        assert paras.total_rows == len(want), (case, data)
        if want:
            assert [d.text for d in read_all(reader("paragraphs", paras, shuffle=False))] == want, (case, data)
        lines = list_jsonl_units(resolve_files(str(tmp_path / "f.jsonl"), "jsonl"), field=None, rows_per_unit=rpu)
        ref = reference_lines(data)
        assert lines.total_rows == len(ref), (case, data)
        if ref:  # every non-blank line reaches the reader (as a malformed line here), in order
            node = reader("jsonl", lines, shuffle=False, on_error="skip")
            assert read_all(node) == [] and node.state_dict()["skipped"] == len(ref)


# --- bad input -------------------------------------------------------------------------

def write_bad_jsonl(path):
    """Line numbers (1-based) of the bad lines: 3 null, 6 malformed, 8 not an object, 11 no field."""
    lines = [json.dumps({"text": "ok 1"}), "", json.dumps({"text": None}), json.dumps({"text": "ok 4"}),
             "   ", '{"text": "broken', json.dumps({"text": "ok 7"}), "[1, 2]", json.dumps({"text": "ok 9"}),
             json.dumps({"text": "ok 10"}), json.dumps({"body": "x"}), json.dumps({"text": "ok 12"})]
    path.write_text("\n".join(lines) + "\n")
    return ["ok 1", "ok 4", "ok 7", "ok 9", "ok 10", "ok 12"]


@pytest.mark.parametrize("shuffle", [False, True])
def test_malformed_line_names_file_and_line(tmp_path, shuffle):
    write_bad_jsonl(tmp_path / "bad.jsonl")
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), rows_per_unit=3)
    with pytest.raises(ValueError, match=r"bad\.jsonl, line (6: malformed JSON|8: .*JSON list, not an object|"
                                         r"11: no field 'text'; the line has keys \['body'\])") as e:
        read_all(reader("jsonl", units, shuffle=shuffle))
    assert "on_error='skip'" in str(e.value)
    if not shuffle:  # in file order the first bad line met is line 6 (the null on line 3 is skipped)
        assert "line 6: malformed JSON" in str(e.value)


def test_null_raises_when_asked(tmp_path):
    write_bad_jsonl(tmp_path / "bad.jsonl")
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), rows_per_unit=3)
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: field 'text' is null"):
        read_all(reader("jsonl", units, shuffle=False, on_null="raise"))


def test_skip_mode_counts_warns_once_and_resumes(tmp_path, caplog):
    good = write_bad_jsonl(tmp_path / "bad.jsonl")
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), rows_per_unit=3)
    node = reader("jsonl", units, shuffle=False, on_error="skip")
    with caplog.at_level(logging.WARNING):
        assert [d.text for d in read_all(node)] == good
    assert node.state_dict()["skipped"] == 4
    warned = [r.getMessage() for r in caplog.records if "skipping line" in r.getMessage()]
    assert len(warned) == 4  # once per kind: null, malformed, not an object, missing field
    assert any("bad.jsonl, line 6" in m for m in warned) and any("bad.jsonl, line 3" in m for m in warned)
    build = lambda: reader("jsonl", units, shard=1, num_shards=2, epochs=2, on_error="skip")  # noqa: E731
    node = build()
    want = len(read_all(node))
    final_skipped = node.state_dict()["skipped"]
    assert final_skipped > 0
    assert check_node_resume(build) == want
    # the count survives a restore at every step (the items alone would not show a lost count)
    node.reset(None)
    states = [node.state_dict()] + [node.state_dict() for _ in node]
    for k, state in enumerate(states):
        restored = build()
        restored.reset(state)
        list(restored)
        assert restored.state_dict()["skipped"] == final_skipped, f"restored at step {k}"


def test_require_type(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "fine"}\n{"text": ["a", "list"]}\n')
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"))
    with pytest.raises(ValueError, match=r"x\.jsonl, line 2: field 'text' holds a list, expected str"):
        read_all(reader("jsonl", units, shuffle=False, require_type=str))
    assert [d.text for d in read_all(reader("jsonl", units, shuffle=False))] == ["fine", ["a", "list"]]


def test_wrong_field_fails_at_listing_with_the_keys(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"content": "a", "id": 1}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl, first record: no field 'text'; the line has keys "
                                         r"\['content', 'id'\]"):
        list_jsonl_units(resolve_files(str(tmp_path), "jsonl"))
    assert list_jsonl_units(resolve_files(str(tmp_path), "jsonl"), field="content").total_rows == 1


def test_invalid_utf8_in_jsonl_is_a_bad_line(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b\xff"}\n')
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"))
    with pytest.raises(ValueError, match=r"x\.jsonl, line 2: invalid UTF-8"):
        read_all(reader("jsonl", units, shuffle=False))


@pytest.mark.parametrize("mode", ["paragraphs", "file"])
def test_invalid_utf8_in_text_names_file_and_byte_offset(tmp_path, mode):
    data = "first paragraph é\n\nsecond\n".encode() + b"bad \xc3( byte\n\nlast\n"
    (tmp_path / "t.txt").write_bytes(data)
    offset = data.index(b"\xc3(")
    units = list_text_units(resolve_files(str(tmp_path), "txt"), mode=mode, rows_per_unit=1)
    with pytest.raises(ValueError, match=rf"t\.txt: invalid UTF-8 at byte offset {offset} \(line 4\)"):
        read_all(reader(mode, units, shuffle=False))
    texts = [d.text for d in read_all(reader(mode, units, shuffle=False, errors="replace"))]
    assert any("bad \ufffd( byte" in t for t in texts)


def test_empty_corpus_is_refused_by_the_sharder(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.jsonl").write_bytes(b"\n\n")
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"))
    assert units.total_rows == 0 and units.blank_lines == 2
    with pytest.raises(ValueError, match="has 0 rows but there are 1 shards"):
        reader("jsonl", units)


def test_a_file_changed_after_listing_is_reported(tmp_path):
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(10)))
    units = list_jsonl_units(resolve_files(str(tmp_path), "jsonl"))
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"text": str(i)}) + "\n\n" for i in range(10)))
    with pytest.raises(RuntimeError, match=r"x\.jsonl.*the file changed after the loader was built"):
        read_all(reader("jsonl", units))


def test_bad_settings_are_named(jsonl, paragraphs):
    units = list_jsonl_units(jsonl[0])
    with pytest.raises(ValueError, match="on_error='ignore'"):
        reader("jsonl", units, on_error="ignore")
    with pytest.raises(ValueError, match="mode='lines'"):
        list_text_units(paragraphs[0], mode="lines")
    with pytest.raises(ValueError, match="rows_per_unit=0"):
        list_jsonl_units(jsonl[0], rows_per_unit=0)
    with pytest.raises(ValueError, match="ReadText reads units listed by list_text_units"):
        ReadText(ShardUnits(units.rows, shard=0, num_shards=1, seed=0), units)


# --- through the loader ------------------------------------------------------------------

@dataclass
class TextGraph:
    """A hand-built pretraining graph over jsonl or text files (the factory runs in each worker)."""

    root: str
    kind: str
    tokenizer: str

    def __call__(self, ctx: ShardContext):
        fmt = "jsonl" if self.kind == "jsonl" else "txt"
        units = units_of(self.kind, resolve_files(self.root, fmt), rows_per_unit=16)
        node = ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=1, epochs=1,
                          first_epoch=ctx.round)
        if self.kind == "jsonl":
            node = ReadJsonl(node, units, seed=1, require_type=str)
        else:
            node = ReadText(node, units, seed=1)
        node = Tokenize(node, load_encoder(self.tokenizer), bos=0, batch_docs=8)
        node = BestFitPack(node, seq_len=63, buffer_size=20)
        return Batch(node, batch_size=2, seq_len=63)


@pytest.fixture(scope="module")
def loader_corpora(tmp_path_factory):
    texts = synthetic_texts(180, seed=4)
    root = tmp_path_factory.mktemp("loader")
    out = {}
    for kind in KINDS:
        d = root / kind
        d.mkdir()
        for f in range(3):
            part = texts[f::3]
            if kind == "jsonl":
                (d / f"{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
            elif kind == "paragraphs":
                (d / f"{f}.txt").write_text("\n\n".join(part))
            else:
                for i, t in enumerate(part):
                    (d / f"{f}-{i:03d}.txt").write_text(t)
        out[kind] = str(d)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_hand_built_graph_through_the_loader(loader_corpora, tok_path, kind, num_workers):
    graph = TextGraph(loader_corpora[kind], kind, tok_path)

    def build():
        return TokenLoomLoader(graph, config={"kind": kind}, num_workers=num_workers)

    ref = check_loader_resume(build, steps=[3, 10], total=None)
    assert len(ref) > 20
    # every document went through exactly once: count the BOS tokens of the round's rows
    # (input_ids, plus the last label, which is the row's last token)
    bos = sum(int(((b["segment_ids"] > 0) & (b["input_ids"] == 0)).sum()) + int((b["labels"][:, -1] == 0).sum())
              for b in ref)
    assert bos == 180
