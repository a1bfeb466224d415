"""Bad files: every one is a clear error naming the file (row group, row), or a counted skip.

Errors found at listing fail in `pretrain(...)`; errors found while reading happen
in a loader worker and must reach the training loop with the location in the
message (torch re-raises them with the worker's traceback). Nothing may hang:
every test that starts workers has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.pipes import Node, TokenLoomLoader
from tokenloom.recipes import pretrain, sft

from .conftest import synthetic_texts, write_corpus

TEXTS = synthetic_texts(600)


def _corpus(root, **write_kwargs):
    """3 files of 200 documents, 64-row row groups."""
    os.makedirs(root, exist_ok=True)
    paths = []
    for f in range(3):
        p = os.path.join(root, f"part-{f:03d}.parquet")
        pq.write_table(pa.table({"text": TEXTS[f * 200:(f + 1) * 200]}), p, row_group_size=64, **write_kwargs)
        paths.append(p)
    return paths


def _overwrite_inside(path, doc: str, junk: bytes) -> None:
    """Overwrite bytes in the middle of document ``doc`` where the file stores it verbatim
    (uncompressed, plain-encoded pages): the footer stays intact."""
    data = bytearray(open(path, "rb").read())
    at = data.find(doc.encode())
    assert at > 0 and data.find(doc.encode(), at + 1) < 0, "the document must be stored once, verbatim"
    at += len(doc) // 2
    data[at:at + len(junk)] = junk
    open(path, "wb").write(bytes(data))


def _loader(spec, tok_path, **kw):
    kw = {"seq_len": 63, "batch_size": 2, "epochs": 1, "packing": "flat", **kw}
    return pretrain(spec, tokenizer=tok_path, **kw)


def _error_of(batches) -> BaseException:
    """The exception iterating ``batches`` raises (its traceback kept, as a user's would be)."""
    try:
        for _ in batches:
            pass
    except Exception as e:
        return e
    raise AssertionError("the loop ended without an error")


def _run_to_error(loader, exc=Exception) -> str:
    e = _error_of(loader)
    assert isinstance(e, exc), f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    return str(e)


# --- listing: fails in the calling process ---------------------------------------------

def test_truncated_file_names_the_file(tmp_path, tok_path):
    paths = _corpus(tmp_path)
    data = open(paths[1], "rb").read()
    open(paths[1], "wb").write(data[:len(data) // 2])  # an interrupted copy: no footer
    with pytest.raises(ValueError, match=r"part-001\.parquet is not a readable parquet file .*truncated"):
        pretrain(str(tmp_path / "*.parquet"), tokenizer=tok_path)


@pytest.mark.parametrize("other, has", [
    ({"body": ["x"] * 10}, r"column 'text' not found in .*part-001\.parquet; it has columns \['body'\]"),
    ({"text": list(range(10))}, r"column 'text' in .*part-001\.parquet has type int64, not text"),
    ({"text": [[{"role": "user", "content": "x"}]] * 10}, r"part-001\.parquet has type list<element: struct<"),
])
def test_schema_that_differs_in_one_file_names_it_and_what_it_has(tmp_path, tok_path, other, has):
    paths = _corpus(tmp_path)
    pq.write_table(pa.table(other), paths[1])
    with pytest.raises(ValueError, match=has):
        pretrain(str(tmp_path / "*.parquet"), tokenizer=tok_path)


def test_text_types_may_differ_between_files(tmp_path, tok_path):
    # string, large_string and dictionary-encoded strings (pandas categoricals) are all text
    columns = [pa.array(TEXTS[:200]), pa.array(TEXTS[200:400], pa.large_string()),
               pa.array(TEXTS[400:]).dictionary_encode()]
    for i, col in enumerate(columns):
        pq.write_table(pa.table({"text": col}), tmp_path / f"part-{i}.parquet", row_group_size=64)
    loader = _loader(str(tmp_path / "*.parquet"), tok_path)
    list(loader)
    assert loader.stats()["documents"] == 600


@pytest.mark.parametrize("typ, kind", [(pa.binary(), "binary"), (pa.float64(), "double")])
def test_non_text_column_in_parquet_names_its_type(tmp_path, tok_path, typ, kind):
    values = [b"a", b"b"] if typ == pa.binary() else [1.0, 2.0]
    pq.write_table(pa.table({"text": pa.array(values, typ)}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=rf"x\.parquet has type {kind}, not text \(string\); pass text_column="):
        pretrain(str(tmp_path / "x.parquet"), tokenizer=tok_path)


def test_conversations_must_be_a_list_column(tmp_path, tok_path):
    pq.write_table(pa.table({"messages": ["not a conversation"] * 4}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"column 'messages' in .*c\.parquet has type string, not a list"):
        sft(str(tmp_path / "c.parquet"), tokenizer=tok_path, seq_len=63, batch_size=2)


def test_zero_row_files_contribute_nothing(tmp_path, tok_path):
    _corpus(tmp_path)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty-a.parquet")
    # an empty export often has no usable schema: not checked, nothing is read from it
    pq.write_table(pa.table({"text": []}), tmp_path / "empty-b.parquet")
    pq.write_table(pa.table({"other": pa.array([], pa.int64())}), tmp_path / "empty-c.parquet")
    loader = _loader(str(tmp_path / "*.parquet"), tok_path, num_workers=2)
    list(loader)
    assert loader.stats()["documents"] == 600


@pytest.mark.parametrize("named", [False, True])
def test_a_source_with_only_zero_row_files_is_refused(tmp_path, tok_path, named):
    (tmp_path / "empty").mkdir()
    for name in ("a", "b"):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty" / f"{name}.parquet")
    spec = str(tmp_path / "empty")
    if named:
        _corpus(tmp_path / "good")
        spec = {"good": str(tmp_path / "good"), "web": spec}
    name = "web" if named else "default"
    with pytest.raises(ValueError, match=rf"source '{name}' has 0 rows: its 2 parquet file\(s\) "
                                         r"\(.*a\.parquet, .*b\.parquet\) hold no documents"):
        pretrain(spec, tokenizer=tok_path)


# --- reading: fails in a loader worker, reaches the training loop ------------------------

@pytest.mark.timeout(60)
def test_corrupt_page_is_caught_by_its_checksum_in_a_worker(tmp_path, tok_path):
    paths = _corpus(tmp_path, compression="none", use_dictionary=False, write_page_checksum=True)
    # garbage that is valid UTF-8: without the checksum this would be read as text
    _overwrite_inside(paths[1], TEXTS[270], b"GARBAGE!")  # file 1, row group 1, row 6
    loader = _loader(str(tmp_path / "*.parquet"), tok_path, num_workers=2)
    msg = _run_to_error(loader, RuntimeError)
    assert "in DataLoader worker process" in msg
    assert re.search(r"cannot read .*part-001\.parquet, row group 1: .*CRC checksum verification failed", msg), msg
    assert "rewrite or remove it, and rebuild the loader" in msg


@pytest.mark.timeout(60)
def test_invalid_utf8_names_the_row_in_a_worker(tmp_path, tok_path):
    paths = _corpus(tmp_path, compression="none", use_dictionary=False)
    _overwrite_inside(paths[1], TEXTS[270], b"\xff\xfe\xff\xfe")
    loader = _loader(str(tmp_path / "*.parquet"), tok_path, num_workers=2)
    msg = _run_to_error(loader, ValueError)
    assert "in DataLoader worker process" in msg
    assert re.search(r"part-001\.parquet, row group 1, row 6: invalid UTF-8 in column 'text'", msg), msg


@pytest.mark.timeout(60)
def test_corrupt_page_header_names_file_and_row_group(tmp_path, tok_path):
    paths = _corpus(tmp_path)  # snappy, dictionary-encoded: the default writer
    meta = pq.read_metadata(paths[2]).row_group(2).column(0)
    data = bytearray(open(paths[2], "rb").read())
    data[meta.data_page_offset:meta.data_page_offset + 16] = b"\xff" * 16
    open(paths[2], "wb").write(bytes(data))
    loader = _loader(str(tmp_path / "*.parquet"), tok_path, num_workers=2)
    msg = _run_to_error(loader, RuntimeError)
    assert re.search(r"cannot read .*part-002\.parquet, row group 2: ", msg), msg


@pytest.mark.timeout(60)
def test_file_deleted_after_the_loader_was_built(tmp_path, tok_path):
    paths = _corpus(tmp_path)
    loader = _loader(str(tmp_path / "*.parquet"), tok_path, num_workers=2)
    os.remove(paths[0])
    msg = _run_to_error(loader, RuntimeError)
    assert re.search(r"cannot read .*part-000\.parquet, row group \d: .*the file is gone", msg), msg


@pytest.mark.timeout(60)
def test_file_rewritten_after_the_loader_was_built(tmp_path, tok_path):
    paths = _corpus(tmp_path)
    size = os.path.getsize(paths[2])
    loader = _loader(str(tmp_path / "*.parquet"), tok_path, num_workers=2)
    pq.write_table(pa.table({"text": TEXTS[:10]}), paths[2])
    msg = _run_to_error(loader, RuntimeError)
    assert re.search(rf"part-002\.parquet is {os.path.getsize(paths[2])} bytes now, it was listed with {size}; "
                     "the file changed after the loader was built", msg), msg


def test_non_string_jsonl_value_names_file_and_line_in_a_worker(tmp_path, tok_path):
    lines = [{"text": f"doc {i} " + "w " * (i % 7)} for i in range(40)]
    lines[17] = {"text": None}    # a record without a document: skipped and counted
    lines[23] = {"text": 12345}   # a number where text belongs: an error
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    loader = _loader(str(tmp_path / "x.jsonl"), tok_path, num_workers=2)
    msg = _run_to_error(loader, ValueError)
    assert "in DataLoader worker process" in msg
    assert re.search(r"x\.jsonl, line 24: field 'text' holds an int, expected str", msg), msg

    del lines[23]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    loader = _loader(str(tmp_path / "x.jsonl"), tok_path, num_workers=2)
    list(loader)
    stats = loader.stats()
    assert stats["documents"] == 38 and stats["skipped"] == 1 and stats["sources"]["default"]["skipped"] == 1


# --- exceptions inside workers ----------------------------------------------------------

class FailAfter(Node):
    """Hands out {"x": n}; raises after ``at`` items in worker ``worker``."""

    N = "n"
    STATE_KEYS = (N,)

    def __init__(self, at: int, worker: int, this_worker: int):
        super().__init__()
        self.at, self.fail, self.n = at, worker == this_worker, 0

    def reset(self, initial_state=None):
        self.n = 0 if initial_state is None else initial_state[self.N]

    def next(self):
        self.n += 1
        if self.fail and self.n > self.at:
            raise KeyError(f"user node gave up at item {self.n}")
        return {"x": self.n}

    def get_state(self):
        return {self.N: self.n}


class FailingFactory:
    def __init__(self, at: int, in_build: bool = False):
        self.at, self.in_build = at, in_build

    def __call__(self, ctx):
        if self.in_build and ctx.worker == 1:
            raise OSError("cannot open the user's lookup table in worker 1")
        return FailAfter(self.at, 1, ctx.worker)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"persistent_workers": True, "snapshot_every_n_steps": 3}])
def test_user_node_error_reaches_the_loop_with_its_message(options):
    loader = TokenLoomLoader(FailingFactory(5), config={}, num_workers=2, **options)
    seen = []
    t0 = time.perf_counter()
    e = _error_of(seen.append(b) for b in loader)
    assert isinstance(e, KeyError) and "user node gave up at item 6" in str(e), repr(e)
    assert "in DataLoader worker process 1" in str(e)
    assert len(seen) == 11  # worker 0's 6 and worker 1's 5, round robin, then worker 1 fails
    assert time.perf_counter() - t0 < 30
    # a new loop starts again and fails the same way instead of hanging on the failed one
    e = _error_of(loader)
    assert isinstance(e, KeyError) and "user node gave up at item 6" in str(e), repr(e)


@pytest.mark.timeout(60)
def test_error_while_building_the_graph_in_a_worker():
    loader = TokenLoomLoader(FailingFactory(5, in_build=True), config={}, num_workers=2)
    assert "cannot open the user's lookup table in worker 1" in _run_to_error(loader, OSError)


@pytest.mark.timeout(60)
def test_a_failed_loader_does_not_stall_a_later_gc_pass():
    """The traceback holds the loader's iterator in a cycle; if the workers were still up,
    the gc pass that frees it would wait 5 s per worker for them."""
    import gc

    loader = TokenLoomLoader(FailingFactory(5), config={}, num_workers=2)
    e = _error_of(loader)
    assert isinstance(e, KeyError)
    del loader, e
    t0 = time.perf_counter()
    gc.collect()
    assert time.perf_counter() - t0 < 3


class LocalErrorFactory:
    def __call__(self, ctx):
        class UnpicklableError(Exception):  # defined in a function: its class cannot be pickled
            pass

        class Fails(FailAfter):
            def next(self):
                raise UnpicklableError(f"lookup failed in worker {ctx.worker}")

        return Fails(5, 1, ctx.worker)


@pytest.mark.timeout(60)
def test_an_error_whose_class_cannot_be_pickled_still_reaches_the_loop():
    loader = TokenLoomLoader(LocalErrorFactory(), config={}, num_workers=2)
    msg = _run_to_error(loader, RuntimeError)
    assert "UnpicklableError: lookup failed in worker 0" in msg


def test_a_glob_reads_as_in_the_shell(tmp_path):
    """``data/*.parquet`` is the files in data/, not those of its subdirectories (fnmatch let ``*``
    cross ``/``: a source and another on data/sub/ read the same files); ``**/`` spans directories."""
    from tokenloom.pipes.sources.files import resolve_files

    for where in ("", "sub/", "sub/deeper/"):
        os.makedirs(tmp_path / "data" / where, exist_ok=True)
        pq.write_table(pa.table({"text": ["a b c"]}), tmp_path / "data" / where / "part-0.parquet")
    names = lambda spec: [f.name for f in resolve_files(str(tmp_path / spec))]  # noqa: E731
    assert names("data/*.parquet") == ["part-0.parquet"]
    assert names("data/*/*.parquet") == ["sub/part-0.parquet"]
    assert names("data/**/*.parquet") == ["part-0.parquet", "sub/deeper/part-0.parquet", "sub/part-0.parquet"]
    assert names("data/part-[0-9].parquet") == ["part-0.parquet"]
    assert names("data") == names("data/**/*.parquet")  # a directory is searched recursively, as before
