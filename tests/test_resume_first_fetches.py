"""A resume from a slow store starts like a fresh run: the process that loads the state fetches the
row groups its workers read first from the loaded positions (first_fetches.py's `fetch_first_from`,
through `PackedGraph.fetch_first`), and a worker's graph is not started from nothing before its
state is loaded (which fetched the fresh positions' units, then dropped them at the restore).

The oracle does not share the planning code: the worker itself records which row groups it loads
(`ReadParquet._load`, patched before the fork), and the store's log says when each byte range was
asked for. Every batch is also compared with the uninterrupted run.
"""

from __future__ import annotations

import functools
import json
import os
import time

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.pipes import ReadParquet
from tokenloom.pipes.sources import first_fetches
from tokenloom.pipes.sources.cache import ReadCached
from tokenloom.pipes.sources.readahead import RowGroupReadAhead
from tokenloom.pipes.sources.text_files import UnitBytes
from tokenloom.pipes.sources.unit_readahead import UnitReadAhead
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .resume import items_equal
from .test_readahead import LATENCY, _load_remote_benchmark
from .test_s3 import BUCKET, _uri, creds, s3  # noqa: F401 (fixtures)

ARGS = dict(seq_len=127, batch_size=4, buffer_size=16, seed=5, num_workers=1)
SAVE_AT = 40


@pytest.fixture(scope="module")
def many_units(s3, tmp_path_factory):
    """1,500 short documents in 3 files of 20-row row groups (75 units: more than a worker's first
    fetches), as parquet and as jsonl (listed in units of 20 lines: `_jsonl_units_of_20`), on local disk and
    in the bucket under ``many/``. Returns the local directory."""
    endpoint, access, secret, _, _ = s3
    local = tmp_path_factory.mktemp("many_units")
    texts = [" ".join(t.split()[:30]) for t in synthetic_texts(1500, seed=31)]
    for path in write_corpus(str(local), texts, files=3, row_group_size=20):
        rows = pq.read_table(path)["text"].to_pylist()
        with open(path[:-len(".parquet")] + ".jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in rows)
        with open(path[:-len(".parquet")] + ".txt", "w") as f:
            f.write("\n\n".join(rows) + "\n")
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    for name in sorted(os.listdir(local)):
        client.put_object(Bucket=BUCKET, Key=f"many/{name}", Body=(local / name).read_bytes())
    return str(local)


def _jsonl_units_of_20(monkeypatch):
    """jsonl and text sources list in units of 20 rows (1,000 by default: one unit per file here)."""
    from tokenloom.pipes.sources import readers
    from tokenloom.pipes.sources.jsonl import list_jsonl_units
    from tokenloom.pipes.sources.line_listing import list_text_units

    monkeypatch.setattr(readers, "list_jsonl_units", functools.partial(list_jsonl_units, rows_per_unit=20))
    monkeypatch.setattr(readers, "list_text_units", functools.partial(list_text_units, rows_per_unit=20))


def _record_the_worker(monkeypatch, events):
    """Patches (inherited by a forked worker) with which the worker writes to ``events`` what it does: the
    units it loads (``load``), takes from the building process's first fetches (``took``) and fetches itself
    (``fetched``), each as its key (parquet: file, row group; a line unit: file, start; a token cache's unit:
    cache file, row group)."""
    parent = os.getpid()

    def record(kind, file, at):
        if os.getpid() != parent:
            with open(events, "a") as f:
                f.write(json.dumps([kind, int(file), int(at)]) + "\n")

    load, load_cached, fetch = ReadParquet._load, ReadCached._load, RowGroupReadAhead._fetch_part
    monkeypatch.setattr(ReadParquet, "_load", lambda self, s: (
        record("load", self.units.file[s.unit], self.units.row_group[s.unit]), load(self, s))[1])
    monkeypatch.setattr(ReadCached, "_load", lambda self, s: (
        record("load", self.cache.file[s.unit], self.cache.group[s.unit]), load_cached(self, s))[1])
    monkeypatch.setattr(RowGroupReadAhead, "_fetch_part", lambda self, f, *a: (
        record("fetched", *f.key), fetch(self, f, *a))[1])
    read, fetch_whole, fetch_part = UnitBytes.read, UnitReadAhead._fetch, UnitReadAhead._fetch_part
    monkeypatch.setattr(UnitBytes, "read", lambda self, u: (
        record("load", self.units.file[u], self.units.start[u]), read(self, u))[1])
    monkeypatch.setattr(UnitReadAhead, "_fetch", lambda self, fut, file, start, size: (
        record("fetched", file, start), fetch_whole(self, fut, file, start, size))[1])
    monkeypatch.setattr(UnitReadAhead, "_fetch_part", lambda self, whole, file, at, off, n: (
        record("fetched", file, off - at), fetch_part(self, whole, file, at, off, n))[1])
    record_takes(monkeypatch, record)


def record_takes(monkeypatch, record):
    """``record("took", *key)`` for each unit a reader takes from the building process's first fetches."""
    take = first_fetches.FirstFetches.take

    def took(self, key):
        got = take(self, key)
        if got is not None:
            record("took", *key)
        return got

    monkeypatch.setattr(first_fetches.FirstFetches, "take", took)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "txt"])
@pytest.mark.parametrize("start", ["fresh", "resume", "elastic"])  # elastic: the plan hands over old shards' rows
def test_the_first_units_come_before_the_workers_start(s3, creds, tok_path, many_units, tmp_path, monkeypatch,
                                                      fmt, start):
    """A fresh start, a resume and an elastic resume from a slow store: the units a worker reads first were
    fetched by the process that built the loader (and loaded the state), not by the worker; none twice."""
    endpoint = s3[0]
    args = dict(ARGS, text_mode="paragraphs") if fmt == "txt" else ARGS
    if fmt != "parquet":
        _jsonl_units_of_20(monkeypatch)
    bench = _load_remote_benchmark()
    port = bench._free_port()
    proxy = bench.slow_proxy(port, int(endpoint.split(":")[1]), LATENCY, 50e6)
    try:
        uri = _uri(s3, f"{BUCKET}/many/*.{fmt}").replace(endpoint, f"127.0.0.1:{port}")
        state = want = None
        if start != "fresh":  # saved on local disk (a corpus moved to a bucket resumes), past the first fetches
            loader = pretrain(os.path.join(many_units, f"*.{fmt}"), tokenizer=tok_path,
                              **dict(args, num_workers=2 if start == "elastic" else 1))
            it = iter(loader)
            for _ in range(SAVE_AT):
                next(it)
            state = loader.state_dict()
            if start == "elastic":
                state = [state]  # every old rank's state: an elastic resume onto one worker
            else:
                want = next(it)
            del it, loader
        events = tmp_path / "events.jsonl"
        _record_the_worker(monkeypatch, events)
        loader = pretrain(uri, tokenizer=tok_path, **args)
        if state is not None and fmt != "parquet":  # the bucket's copies are newer: no content hash to tell
            with pytest.warns(UserWarning, match="other modification times"):
                loader.load_state_dict(state)
        elif state is not None:
            loader.load_state_dict(state)
        got = next(iter(loader))
        del loader
    finally:
        proxy.shutdown()
    assert want is None or items_equal(want, got), "the resumed run is not the uninterrupted one"

    seen = [json.loads(line) for line in events.read_text().splitlines()]
    loaded = [tuple(e[1:]) for e in seen if e[0] == "load"]
    took = [tuple(e[1:]) for e in seen if e[0] == "took"]
    fetched = {tuple(e[1:]) for e in seen if e[0] == "fetched"}
    assert len(loaded) >= 3, seen
    first = loaded[:3]  # the units the worker reads first
    assert not fetched & set(first), (f"the worker fetched {sorted(fetched & set(first))} itself, among the first "
                                     f"units it read {first}: the process that built the loader did not")
    assert set(first) <= set(took), (first, took)


def test_a_resumed_worker_starts_its_graph_once_from_the_state(tok_path, many_units, tmp_path, monkeypatch):
    """torchdata's worker calls iter() on the dataset and then loads the state: the graph is started
    from the state only (it was reset from nothing first, and a remote source's first fetches went
    to the fresh positions, then were dropped); a worker with no state starts at its first batch."""
    files = os.path.join(many_units, "*.parquet")
    loader = pretrain(files, tokenizer=tok_path, **ARGS)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    want = next(it)
    del it, loader

    calls = tmp_path / "resets.jsonl"
    parent, reset = os.getpid(), ReadParquet.reset

    def recorded(self, initial_state=None):
        if os.getpid() != parent:
            with open(calls, "a") as f:
                f.write(json.dumps(initial_state is not None) + "\n")
        return reset(self, initial_state)

    monkeypatch.setattr(ReadParquet, "reset", recorded)
    resumed = pretrain(files, tokenizer=tok_path, **ARGS)
    resumed.load_state_dict(state)
    assert items_equal(next(iter(resumed)), want)
    del resumed
    resets = [json.loads(x) for x in calls.read_text().splitlines()]
    assert resets == [True], f"the worker's reader was reset from nothing before its state: {resets}"
    calls.unlink()
    fresh = pretrain(files, tokenizer=tok_path, **ARGS)
    next(iter(fresh))
    del fresh
    assert [json.loads(x) for x in calls.read_text().splitlines()] == [False]


@pytest.mark.filterwarnings("ignore:sources 'a' and 'b' both read")  # on purpose: two sources, one graph shape
@pytest.mark.parametrize("packing", ["flat", "bestfit", "bestfit-crop"])
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_readers_states_are_found_in_a_saved_state(tok_path, many_units, monkeypatch, packing, fmt):
    """`reader_states` walks a worker's saved graph state down to each reader's (what a resume's first
    fetches plan from), whatever the packer and with one or two sources; a sharder restored from it
    emits next what the restored reader then loads."""
    from tokenloom.pipes.loader.elastic import worker_trees
    from tokenloom.pipes.loader.bridge import ShardContext, decode_state
    from tokenloom.pipes.pack.savepoint import reader_states

    if fmt == "jsonl":
        _jsonl_units_of_20(monkeypatch)
    files = os.path.join(many_units, f"*.{fmt}")
    for sources in (files, {"a": files, "b": files}):
        loader = pretrain(sources, tokenizer=tok_path, packing=packing, **dict(ARGS, num_workers=0))
        it = iter(loader)
        for _ in range(7):
            next(it)
        tree = worker_trees(decode_state(loader.state_dict())["loader"])[0]
        factory = loader.dataset.factory
        found = list(reader_states(factory(ShardContext(0, 1, 0, 0, tree["round"])), tree["node"]))
        assert len(found) == (1 if isinstance(sources, str) else 2)
        for reader, saved in found:
            assert set(saved) == set(type(reader).STATE_KEYS), (packing, saved)
            sharder = reader.sharder
            sharder.reset(saved[type(reader).PARENT])
            next_units = [s.unit for s, _ in zip(sharder.ahead(), range(3))]
            # the reader restored from the same state loads these next
            reader.reset(saved)
            loads = []
            real = reader._cursor.load
            reader._cursor.load = lambda s: (loads.append(s.unit), real(s))[1]
            while len(loads) < 3:
                next(reader)
            assert loads == next_units, (packing, fmt, sources)
        del it, loader


def test_a_long_line_unit_is_fetched_first_in_parts_at_once(tmp_path, monkeypatch):
    """The building process fetches a line unit of a few MB as `unit_readahead.PART_BYTES` parts at once
    (one request of 3.7 MB took ~0.3 s behind 100 ms and 20 MB/s, longer than a worker's own fetch), and
    the bytes a worker takes, joined, are the unit's."""
    from tokenloom.pipes.sources import readahead as readahead_mod
    from tokenloom.pipes.sources import unit_readahead
    from tokenloom.pipes.sources.files import resolve_files
    from tokenloom.pipes.sources.jsonl import list_jsonl_units

    monkeypatch.setenv(readahead_mod.ENV, "all")  # a local file gets the remote file's budget
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": f"document {i} " + "word " * 600}) + "\n" for i in range(1500))
    units = list_jsonl_units(resolve_files(str(path), "jsonl"), rows_per_unit=1000)
    assert len(units.rows) == 2 and min(units.end - units.start) > unit_readahead.PART_BYTES
    units.handles = {0: units.files[0].open()}  # as a remote listing keeps them
    asked, real = [], first_fetches.read_range
    monkeypatch.setattr(first_fetches, "read_range", lambda h, off, n: (asked.append(n), real(h, off, n))[1])
    first = first_fetches.start_first_fetches(units, "text", shards=[0], num_shards=1, seed=0, epochs=1)
    assert first is not None and first.wait(30) and first.errors == 0
    assert max(asked) <= unit_readahead.PART_BYTES and len(asked) >= 2, asked
    data = path.read_bytes()
    for u in range(len(units.rows)):
        key = (0, int(units.start[u]))
        if first.size(key) is not None:
            _, chunks = first.take(key)
            assert b"".join(d for _, d in sorted(chunks, key=lambda c: c[0])) == \
                data[int(units.start[u]):int(units.end[u])]


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_remote_sources_with_first_fetches_resume_exactly(s3, creds, tok_path, many_units, monkeypatch, workers):
    """The shared resume helper over remote parquet, jsonl and text sources at once, whose first units the
    building process fetches (and, resuming, those of the loaded positions): 0, 1 and 3 workers."""
    from .resume import check_loader_resume

    _jsonl_units_of_20(monkeypatch)
    sources = {fmt: _uri(s3, f"{BUCKET}/many/*.{fmt}") for fmt in ("parquet", "jsonl", "txt")}
    args = dict(ARGS, num_workers=workers, text_mode={"parquet": "file", "jsonl": "file", "txt": "paragraphs"})
    check_loader_resume(lambda: pretrain(sources, tokenizer=tok_path, **args), steps=[1, 6], total=10)


def test_a_bad_remote_jsonl_file_is_named_and_no_file_is_left_open(s3, creds, monkeypatch):
    """Listing a remote jsonl source keeps its files open for the first fetches; when one file is bad the
    error names it (as before) and every file listing opened is closed."""
    from tokenloom.pipes.sources.files import SourceFile, resolve_files
    from tokenloom.pipes.sources.jsonl import list_jsonl_units

    endpoint, access, secret, _, _ = s3
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    good = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)).encode()
    for name, body in (("a.jsonl", good), ("b.jsonl", b'"just a string"\n'), ("c.jsonl", good)):
        client.put_object(Bucket=BUCKET, Key=f"bad-jsonl/{name}", Body=body)
    opened, real = [], SourceFile.open
    monkeypatch.setattr(SourceFile, "open", lambda self: (lambda h: (opened.append(h), h)[1])(real(self)))
    files = resolve_files(_uri(s3, f"{BUCKET}/bad-jsonl/*.jsonl"), "jsonl")
    with pytest.raises(ValueError, match=r"b\.jsonl"):
        list_jsonl_units(files)
    assert len(opened) >= 3 and all(h.closed for h in opened), "a file listing opened was left open"
    opened.clear()
    units = list_jsonl_units(files[:1] + files[2:])  # the good ones: kept open for the first fetches
    assert sorted(units.handles) == [0, 1] and not any(h.closed for h in units.handles.values())


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
@pytest.mark.parametrize("kept", [True, False])  # False: over the listing's in-memory budget
def test_a_small_remote_line_source_is_fetched_first_from_the_listing_bytes(s3, creds, many_units, monkeypatch,
                                                                            fmt, kept):
    """Listing read every byte of a remote jsonl or text source: within `KEEP_BYTES` it keeps them, and the
    first fetches take their workers' first units from memory, with no request to the store (one round trip
    and the transfer less before the first batch); over it, they fetch from the store as before. Either
    way the bytes are the file's."""
    from tokenloom.pipes.sources import jsonl, line_listing, listing_at_once
    from tokenloom.pipes.sources.files import resolve_files

    _jsonl_units_of_20(monkeypatch)
    if not kept:
        monkeypatch.setattr(listing_at_once, "KEEP_BYTES", 1000)  # less than a file
    endpoint = s3[0]
    bench = _load_remote_benchmark()
    port, log = bench._free_port(), []
    proxy = bench.slow_proxy(port, int(endpoint.split(":")[1]), 0.02, 50e6, log=log)
    try:
        files = resolve_files(_uri(s3, f"{BUCKET}/many/*.{fmt}").replace(endpoint, f"127.0.0.1:{port}"), fmt)
        units = (functools.partial(jsonl.list_jsonl_units, rows_per_unit=20)(files) if fmt == "jsonl" else
                 line_listing.list_text_units(files, mode="paragraphs", rows_per_unit=20))
        assert units.handles and all(isinstance(h, pa.BufferReader) == kept for h in units.handles.values())
        # by arrival: the proxy logs a request after its answer went out, so listing's last one can be
        # logged after listing returned (seen under a busy core)
        listed = time.monotonic()
        first = first_fetches.start_first_fetches(units, "text", shards=[0, 1], num_shards=2, seed=3, epochs=None)
        assert first is not None and first.wait(30)
        keys = list(first._chunks)
        assert keys
        deadline = time.monotonic() + 5  # the answers have arrived; their log lines follow
        while not kept and not [e for e in log if e[0] > listed] and time.monotonic() < deadline:
            time.sleep(0.01)
        after = [e for e in log if e[0] > listed]
        if kept:
            assert not after, f"{len(after)} requests to the store for units listing had read: {after}"
        else:
            assert after
        for key in keys:
            i, start = key
            u = int(np.flatnonzero((units.file == i) & (units.start == start))[0])
            _, chunks = first.take(key)
            with open(os.path.join(many_units, os.path.basename(files[i].path)), "rb") as f:
                data = f.read()
            assert b"".join(d for _, d in sorted(chunks, key=lambda c: c[0])) == \
                data[int(units.start[u]):int(units.end[u])]
    finally:
        proxy.shutdown()


class _Blocked:
    """A handle whose reads wait until released: a store that does not answer."""

    def __init__(self, fork_safe: bool):
        import threading
        self.release = threading.Event()
        if fork_safe:
            self.FORK_SAFE = True

    def read_at(self, n, off):
        self.release.wait(30)
        return b"x" * n

    def close(self):
        pass


@pytest.mark.parametrize("fork_safe", [True, False], ids=["http-client", "other-client"])
def test_a_fork_waits_only_for_first_fetches_a_child_would_wait_for(fork_safe):
    """A loader's fork waits for first fetches still in flight where a forked child's client would
    wait for them (pyarrow's S3), not over tokenloom's HTTP client: another loader's fetches that are
    still retrying a failing store do not hold up its workers."""
    import time

    from tokenloom.pipes.sources.first_fetches import FirstFetches, wait_before_fork
    handle = _Blocked(fork_safe)
    fetches = FirstFetches([(("f", 0), handle, 1000, [(0, 100)])], handles={0: handle})
    try:
        start = time.monotonic()
        if fork_safe:
            wait_before_fork(timeout=2)
            assert time.monotonic() - start < 1.0, "waited on a fetch a forked child never waits for"
        else:
            with pytest.raises(TimeoutError, match="still being read"):
                wait_before_fork(timeout=0.5)
    finally:
        handle.release.set()
        fetches.wait(5)
