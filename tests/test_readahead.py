"""Read-ahead of parquet row groups (pipes/sources/readahead.py), and listing remote footers at once.

Read-ahead may change when bytes arrive, never what comes: batches are compared bit for bit
with the synchronous reader (local files with read-ahead forced on, and moto's S3 server, the
fixture of tests/test_s3.py), resumes are exact through the shared helpers, an error while
fetching is raised where the reader reaches that unit naming its file and row group (not a
hang), and the bytes held stay within the budget. Also: the sharder's look-ahead is what it
then emits, parallel footer reads give the same units and the same first error as one by one,
and a forked process reads S3 through its own connections.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import time
from itertools import islice

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tokenloom.pipes import ReadParquet, ShardUnits, list_parquet_units, resolve_files
from tokenloom.pipes.shard import WorkSlice
from tokenloom.pipes.sources import parquet as parquet_mod
from tokenloom.pipes.sources import first_fetches, listing_at_once, readahead
from tokenloom.pipes.sources.cache import build_cache
from tokenloom.pipes.sources.files import process_fs
from tokenloom.pipes.stats import format_stats
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .resume import check_loader_resume, check_node_resume, items_equal
from .test_s3 import ARGS, BUCKET, PREFIX, _raises_without_hanging, _uri, creds, s3  # noqa: F401 (fixtures)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """1200 documents in 4 files of 40-row row groups (30 units); returns (glob, units)."""
    root = tmp_path_factory.mktemp("readahead")
    write_corpus(str(root), synthetic_texts(1200, seed=26), files=4, row_group_size=40)
    glob = str(root / "*.parquet")
    return glob, list_parquet_units(resolve_files(glob), "text")


def _reader(units, readahead_bytes, *, shard=0, num_shards=2, epochs=2, seed=3):
    node = ShardUnits(units.rows, shard=shard, num_shards=num_shards, seed=seed, epochs=epochs)
    return ReadParquet(node, units, column="text", seed=seed, readahead=readahead_bytes)


def _docs(reader):
    reader.reset(None)
    return list(reader)


def _unit_bytes(units, u):
    meta = pq.ParquetFile(units.files[int(units.file[u])].path).metadata
    return sum(n for _, n in readahead.chunk_ranges(meta, int(units.row_group[u]), ["text"],
                                                     units.files[int(units.file[u])].size))


# --- the sharder's look-ahead ---------------------------------------------------------------------

def test_ahead_is_what_the_sharder_emits_next_from_any_position():
    rows = np.array([5, 3, 8, 1, 6, 2, 7], np.int64)
    prefix = [WorkSlice(0, 2, 0, 4, 0), WorkSlice(0, 5, 1, 2, 0)]
    for kw in ({"epochs": 3}, {"epochs": None}, {"epochs": 2, "prefix": prefix, "resume_epoch": 1}):
        node = ShardUnits(rows, shard=1, num_shards=3, seed=7, **kw)
        node.reset(None)
        for step in range(12):
            state = node.state_dict()
            ahead = list(islice(node.ahead(), 10))
            fresh = ShardUnits(rows, shard=1, num_shards=3, seed=7, **kw)
            fresh.reset(state)
            assert ahead == list(islice(fresh, 10)), f"{kw}, step {step}"
            try:
                next(node)
            except StopIteration:
                assert ahead == []
                break


# --- the same documents and batches ------------------------------------------------------------------

def test_reader_documents_equal_and_fetched_ahead(local):
    _, units = local
    want = _docs(_reader(units, 0))
    reader = _reader(units, 1 << 20)
    got = _docs(reader)
    assert len(got) == len(want) > 500 and got == want
    stats = reader.readahead_stats()
    assert stats["ready"] + stats["waited"] > 10 and stats["misses"] == 0, stats
    assert _reader(units, 0).readahead_stats() is None


def test_reader_resumes_exactly_at_every_step_with_readahead(local):
    _, units = local
    assert check_node_resume(lambda: _reader(units, 64 << 10), max_steps=150) == 150


def test_local_loader_batches_equal_with_readahead_forced_on(local, tok_path, monkeypatch):
    glob, _ = local
    args = dict(seq_len=127, batch_size=4, buffer_size=24, epochs=1, num_workers=2, seed=5)
    monkeypatch.setenv(readahead.ENV, "0")
    want = list(pretrain(glob, tokenizer=tok_path, **args))
    monkeypatch.setenv(readahead.ENV, "all")
    got = list(pretrain(glob, tokenizer=tok_path, **args))
    assert len(got) == len(want) > 10
    for j, (a, b) in enumerate(zip(want, got)):
        assert items_equal(a, b), f"batch {j} differs with read-ahead on"


def test_readahead_memory_is_reported_in_stats(local, tok_path, monkeypatch):
    glob, _ = local
    monkeypatch.setenv(readahead.ENV, "all")
    monkeypatch.setenv(readahead.ENV_BYTES, "30K")
    loader = pretrain({"web": glob}, tokenizer=tok_path, seq_len=127, batch_size=4, buffer_size=24, num_workers=2)
    it = iter(loader)
    for _ in range(6):
        next(it)
    ahead = loader.stats()["sources"]["web"]["readahead"]
    # each worker's peak is within its budget (a unit larger than the budget is fetched alone)
    assert 0 < ahead["peak_bytes"] and 0 <= ahead["bytes"] <= ahead["peak_bytes"]
    assert "read-ahead: web" in format_stats(loader.stats())
    monkeypatch.setenv(readahead.ENV, "0")
    loader = pretrain({"web": glob}, tokenizer=tok_path, seq_len=127, batch_size=4, buffer_size=24, num_workers=0)
    next(iter(loader))
    assert loader.stats()["sources"]["web"]["readahead"] == {"bytes": 0, "peak_bytes": 0}


def test_local_loader_resume_with_readahead_forced_on(local, tok_path, monkeypatch):
    glob, _ = local
    monkeypatch.setenv(readahead.ENV, "all")
    monkeypatch.setenv(readahead.ENV_BYTES, "20K")  # about one row group ahead
    check_loader_resume(lambda: pretrain(glob, tokenizer=tok_path, seq_len=127, batch_size=4, buffer_size=24,
                                         num_workers=2, seed=5), steps=[2, 9], total=16)


@pytest.mark.parametrize("mode", ["auto", "0"])
def test_s3_batches_equal_local_with_and_without_readahead(s3, creds, tok_path, mode):
    """``auto`` reads S3 ahead (the default); ``0`` forces the synchronous reader."""
    _, _, _, local_dir, _ = s3
    creds.setenv(readahead.ENV, mode)
    args = dict(epochs=1, num_workers=2, **ARGS)
    remote = list(pretrain(_uri(s3), tokenizer=tok_path, **args))
    on_disk = list(pretrain(os.path.join(local_dir, "*.parquet"), tokenizer=tok_path, **args))
    assert len(remote) == len(on_disk) > 10
    for j, (a, b) in enumerate(zip(on_disk, remote)):
        assert items_equal(a, b), f"batch {j} read from S3 ({readahead.ENV}={mode}) differs from local disk"


def test_s3_exact_resume_with_readahead_of_one_unit(s3, creds, tok_path):
    creds.setenv(readahead.ENV_BYTES, "1")  # every unit alone: the budget never holds two
    check_loader_resume(lambda: pretrain(_uri(s3), tokenizer=tok_path, num_workers=2, **ARGS), steps=[1, 6], total=12)


def test_s3_reader_in_process_uses_the_shipped_footers(s3, creds):
    units = list_parquet_units(resolve_files(_uri(s3)), "text")
    assert units.footers is not None and len(units.footers) == len(units.files)  # few remote files: shipped
    want = _docs(_reader(units, 0))
    reader = _reader(units, 1 << 20)
    assert _docs(reader) == want
    assert reader.readahead_stats()["misses"] == 0


def test_token_cache_on_s3_read_ahead_equals_synchronous(s3, creds, tok_path):
    endpoint = s3[0]
    query = f"?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    src = f"s3://{BUCKET}/{PREFIX}/*.parquet{query}"
    out = f"s3://{BUCKET}/cache/readahead{query}"
    build_cache({"web": src}, tok_path, out, processes=1)
    args = dict(seq_len=127, batch_size=4, buffer_size=24, epochs=1, num_workers=2)
    runs = {}
    for mode in ("auto", "0"):
        creds.setenv(readahead.ENV, mode)
        loader = pretrain({"web": src}, tokenizer=tok_path, cache=out, cache_strict=True, **args)
        runs[mode] = list(loader)
        assert loader.stats()["sources"]["web"]["tokenized"] == 0
    assert len(runs["auto"]) == len(runs["0"]) > 5
    assert all(items_equal(a, b) for a, b in zip(runs["auto"], runs["0"]))


# --- errors -----------------------------------------------------------------------------------------

def _first_doc_of(docs, unit):
    return next(i for i, d in enumerate(docs) if d.unit == unit)


@pytest.mark.parametrize("where", ["range", "footer"])
def test_fetch_error_is_raised_at_its_unit_naming_file_and_row_group(local, monkeypatch, where):
    _, units = local
    want = _docs(_reader(units, 0))
    bad = want[len(want) // 2].unit  # a unit in the middle of the stream, fetched ahead long before
    bad_file, bad_group = int(units.file[bad]), int(units.row_group[bad])
    assert len({f.size for f in units.files}) == len(units.files)  # a handle's size names its file here
    meta = pq.ParquetFile(units.files[bad_file].path).metadata
    (offset, _), = readahead.chunk_ranges(meta, bad_group, ["text"], units.files[bad_file].size)
    real_range, real_meta = readahead.read_range, readahead._file_meta

    def read_range(handle, off, n):
        if off == offset and handle.size() == units.files[bad_file].size and where == "range":
            raise OSError("injected: connection reset by peer")
        return real_range(handle, off, n)

    def file_meta(handle, raw=None):
        if where == "footer" and handle.size() == units.files[bad_file].size:
            raise OSError("injected: the footer read timed out")
        return real_meta(handle, raw)

    monkeypatch.setattr(readahead, "read_range", read_range)
    monkeypatch.setattr(readahead, "_file_meta", file_meta)
    reader = _reader(units, 1 << 20)
    got = []

    def run():
        reader.reset(None)
        for d in reader:
            got.append(d)

    err = _raises_without_hanging(run, timeout=60)
    # footer errors fail the first unit of that file the reader reaches; range errors that unit only
    first_bad = next(i for i, d in enumerate(want) if int(units.file[d.unit]) == bad_file) if where == "footer" \
        else _first_doc_of(want, bad)
    assert got == want[:first_bad], "documents before the failing unit differ or are missing"
    msg = str(err)
    assert isinstance(err, RuntimeError) and "injected" in msg, msg
    assert msg.startswith(f"cannot read {units.where(want[first_bad].unit)}:"), msg


def test_deleted_object_fails_in_the_worker_as_without_readahead(s3, creds, tok_path):
    endpoint, access, secret, local_dir, _ = s3
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    messages = {}
    for mode in ("auto", "0"):
        prefix = f"readahead-gone-{mode}"
        for name in sorted(os.listdir(local_dir)):
            with open(os.path.join(local_dir, name), "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=f.read())
        creds.setenv(readahead.ENV, mode)
        uri = _uri(s3, f"{BUCKET}/{prefix}/*.parquet")
        loader = pretrain(uri, tokenizer=tok_path, num_workers=2, **ARGS)
        gone = sorted(os.listdir(local_dir))[1]
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{gone}")
        # the first fetches may hold all of this small corpus's first epoch; the next one reads the store
        err = _raises_without_hanging(lambda: list(islice(loader, 2000)), timeout=90)
        msg = str(err).replace(prefix, "PREFIX")
        line = next((x for x in msg.splitlines() if "cannot read" in x), msg)
        assert re.search(rf"cannot read s3://{BUCKET}/PREFIX/{re.escape(gone)}, row group \d+: .*the file is gone",
                         line), msg
        messages[mode] = re.sub(r"row group \d+", "row group N", line)
    assert messages["auto"] == messages["0"]


def test_a_unit_the_plan_brings_back_is_fetched_once(local):
    """A small source's next epoch brings its units back within the plan (here 7-8 units a shard and
    epoch, 16 planned): their bytes serve every read, so 3 epochs fetch each unit once, and read the
    same documents as the synchronous reader."""
    _, units = local
    node = ShardUnits(units.rows, shard=1, num_shards=4, seed=3, epochs=3)
    node.reset(None)
    mine = {int(s.unit) for s in node.ahead()}
    want = _docs(_reader(units, 0, shard=1, num_shards=4, epochs=3))
    reader = _reader(units, 64 << 20, shard=1, num_shards=4, epochs=3)
    assert _docs(reader) == want
    stats = reader.readahead_stats()
    once = sum(_unit_bytes(units, u) for u in mine)
    # in the training process the first unit is read inline (the footers are on their way): once more at most
    assert stats["inline"] <= 1 and once <= stats["fetched_bytes"] <= once + max(_unit_bytes(units, u) for u in mine)
    assert stats["held_bytes"] == 0, stats


def test_first_fetches_join_nearby_ranges_into_few_requests(local, monkeypatch):
    """The building process fetches many small units in a few requests (`first_requests`): here 30 units
    of 4 files in at most a request per file and FIRST_PART bytes; each unit's bytes are the file's."""
    _, units = local
    real, calls = readahead.read_range, []

    def counted(handle, off, n):
        calls.append(n)
        return real(handle, off, n)

    monkeypatch.setattr(first_fetches, "read_range", counted)
    handles = [f.open() for f in units.files]
    items = []
    for u in range(len(units.rows)):
        i, rg = int(units.file[u]), int(units.row_group[u])
        meta = pq.ParquetFile(units.files[i].path).metadata
        items.append(((i, rg), handles[i], units.files[i].size,
                      readahead.chunk_ranges(meta, rg, ["text"], units.files[i].size)))
    total = sum(n for *_, ranges in items for _, n in ranges)
    first = first_fetches.FirstFetches(items)
    assert first.wait(30) and first.errors == 0
    assert len(calls) <= len(units.files) + total // first_fetches.FIRST_PART + 1 < len(items), calls
    for key, _, size, ranges in items:
        got_size, chunks = first.take(key)
        assert got_size == size
        with open(units.files[key[0]].path, "rb") as f:
            for (off, n), (o, data) in zip(ranges, sorted(chunks)):
                f.seek(off)
                assert (o, bytes(data)) == (off, f.read(n))


# --- memory ---------------------------------------------------------------------------------------------

def test_bytes_held_stay_within_the_budget(local, monkeypatch):
    _, units = local
    sizes = [_unit_bytes(units, u) for u in range(len(units.rows))]
    budget = int(2.5 * max(sizes))
    real = readahead.read_range
    fetched = []

    def slow(handle, off, n):  # slower than reading: the read-ahead fills up to its budget
        time.sleep(0.004)
        fetched.append(n)
        return real(handle, off, n)

    monkeypatch.setattr(readahead, "read_range", slow)
    reader = _reader(units, budget)
    reader.reset(None)
    held = []
    for d in reader:
        held.append(reader._ahead.held)
        if d.row % 7 == 0:
            time.sleep(0.001)
    stats = reader.readahead_stats()
    assert max(held) <= budget and stats["peak_bytes"] <= budget, (max(held), stats, budget)
    assert stats["peak_bytes"] >= 2 * min(sizes), "never more than one unit ahead: nothing was read ahead"
    assert sum(fetched) == stats["fetched_bytes"]
    # a budget smaller than a unit: one unit at a time, never two
    small = _reader(units, 1)
    small.reset(None)
    for _ in small:
        pass
    assert small.readahead_stats()["peak_bytes"] <= max(sizes)


def test_reads_outside_the_fetched_ranges_fall_back_to_the_file(local, monkeypatch):
    """A layout pyarrow reads differently from the ranges computed here still decodes: the missing
    bytes are read from the file (and counted)."""
    _, units = local
    want = _docs(_reader(units, 0))
    real = readahead.chunk_ranges
    monkeypatch.setattr(readahead, "chunk_ranges",
                        lambda *a: [(off, max(1, n - 200)) for off, n in real(*a)])
    reader = _reader(units, 1 << 20)
    assert _docs(reader) == want
    assert reader.readahead_stats()["misses"] > 0


def test_decoding_stays_on_the_reading_thread(local, monkeypatch):
    """Row groups fetched ahead are decoded from Python-owned bytes; pyarrow's own threads must not free
    them (that needs the GIL, and aborted the process when it happened while the interpreter exited)."""
    _, units = local
    calls = []
    real = pq.ParquetFile.read_row_group

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("use_threads"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    reader = _reader(units, 1 << 20, epochs=1)
    _docs(reader)
    assert calls and set(calls) == {False}


def test_process_reading_ahead_in_its_training_loop_exits_cleanly(local):
    glob, _ = local
    code = ("import itertools, sys\n"
            "from tokenloom.pipes import ReadParquet, ShardUnits, list_parquet_units, resolve_files\n"
            f"units = list_parquet_units(resolve_files({glob!r}), 'text')\n"
            "for stop in (None, 5):\n"
            "    r = ReadParquet(ShardUnits(units.rows, shard=0, num_shards=1, seed=1, epochs=1), units, readahead=1 << 20)\n"
            "    r.reset(None)\n"
            "    print(sum(1 for _ in itertools.islice(r, stop)))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.split() == ["1200", "5"], (p.returncode, out, err[-2000:])


def test_settings(monkeypatch):
    assert readahead._parse_bytes("64M") == 64 << 20 and readahead._parse_bytes("1.5k") == 1536
    local_fs = pafs.LocalFileSystem()
    for env, want in (({}, 0), ({readahead.ENV: "all"}, readahead.DEFAULT_BYTES), ({readahead.ENV: "0"}, 0),
                      ({readahead.ENV: "all", readahead.ENV_BYTES: "3M"}, 3 << 20)):
        monkeypatch.delenv(readahead.ENV, raising=False)
        monkeypatch.delenv(readahead.ENV_BYTES, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert readahead.budget_for([local_fs]) == want, env
    assert readahead.budget_for([local_fs], 5) == 5
    monkeypatch.setenv(readahead.ENV, "sometimes")
    with pytest.raises(ValueError, match="TOKENLOOM_READAHEAD='sometimes' must be auto"):
        readahead.configured()


# --- listing remote footers at once ------------------------------------------------------------------------

def test_parallel_footers_equal_sequential_and_raise_the_first_bad_file(s3, creds, monkeypatch):
    endpoint, access, secret, local_dir, _ = s3
    files = resolve_files(_uri(s3))
    parallel = parquet_mod.footers_or_errors(files)
    sequential = [parquet_mod.read_footer(f) for f in files]
    assert parallel == sequential and [f.digest for f in parallel] == [f.digest for f in sequential]
    assert all(f.index_listed is False for f in files)  # the glob's listing saw no index: none is asked for

    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    names = sorted(os.listdir(local_dir))
    for i, name in enumerate(names):
        with open(os.path.join(local_dir, name), "rb") as f:
            client.put_object(Bucket=BUCKET, Key=f"readahead-bad/{i}-{name}", Body=f.read())
    client.put_object(Bucket=BUCKET, Key="readahead-bad/1a-broken.parquet", Body=b"PAR1" + b"x" * 100)
    client.put_object(Bucket=BUCKET, Key="readahead-bad/2a-other.parquet", Body=b"not parquet at all")
    monkeypatch.setattr(listing_at_once, "LIST_THREADS", 8)
    with pytest.raises(ValueError) as e:
        list_parquet_units(resolve_files(_uri(s3, f"{BUCKET}/readahead-bad/*.parquet")), "text")
    assert "readahead-bad/1a-broken.parquet" in str(e.value) and "truncated" in str(e.value), str(e.value)


# --- S3 across a fork ----------------------------------------------------------------------------------------

def _load_remote_benchmark():
    spec = importlib.util.spec_from_file_location("remote_bench", os.path.join(HERE, "..", "benchmarks", "remote.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _child_reads(fs, twin, path, want, out):
    try:
        handle = process_fs(fs).open_input_file(path)
        ok = all(handle.read_at(len(want), 0) == want for _ in range(12))
        out.put((ok, process_fs(fs) is fs, process_fs(twin) is process_fs(fs)))
    except BaseException as e:  # noqa: BLE001
        out.put((repr(e), None, None))


def test_forked_processes_read_s3_through_their_own_connections(s3, creds):
    """Workers forked after the training process read from S3 must not share its pooled connections:
    behind 30 ms of latency, two children reading at once through the parent's client got each other's
    bytes. `process_fs` gives each process its own copy of the filesystem, one for all sources with the
    same options (a second S3 client waits for the first one's requests in flight)."""
    endpoint, _, _, local_dir, _ = s3
    bench = _load_remote_benchmark()
    host, port = endpoint.split(":")
    proxy_port = bench._free_port()
    proxy = bench.slow_proxy(proxy_port, int(port), 0.03, 50e6)
    try:
        uri = _uri(s3).replace(endpoint, f"127.0.0.1:{proxy_port}")
        fs, path = pafs.FileSystem.from_uri(uri.replace("*.parquet", "part-000.parquet"))
        twin, _ = pafs.FileSystem.from_uri(uri.replace("*.parquet", "part-001.parquet"))  # another source, same store
        assert process_fs(fs) is fs  # the process that made it uses it as it is
        want = fs.open_input_file(path).read_at(20000, 0)  # the parent's client now holds a connection
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=_child_reads, args=(fs, twin, path, want, out)) for _ in range(3)]
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert results == [(True, False, True)] * 3, results
        assert pickle.loads(pickle.dumps(fs)).type_name == "s3"
    finally:
        proxy.shutdown()


# --- the first batch from a slow store: round trips of the build -------------------------------------------

@pytest.fixture
def slow_store(s3, creds):
    """The s3 fixture's bucket behind benchmarks/remote.py's proxy (``LATENCY`` a request), with the corpus
    under two prefixes (two sources). Yields (uri of a prefix's glob, log of the proxied requests)."""
    endpoint, access, secret, local_dir, _ = s3
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    for kind in ("slow-a", "slow-b"):
        for name in sorted(os.listdir(local_dir)):
            with open(os.path.join(local_dir, name), "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"{kind}/{name}", Body=f.read())
    bench = _load_remote_benchmark()
    proxy_port, log = bench._free_port(), []
    proxy = bench.slow_proxy(proxy_port, int(endpoint.split(":")[1]), LATENCY, 50e6, log=log)
    try:
        yield (lambda prefix: _uri(s3, f"{BUCKET}/{prefix}/*.parquet").replace(endpoint, f"127.0.0.1:{proxy_port}")), log
    finally:
        proxy.shutdown()


LATENCY = 0.15


def test_sources_on_a_slow_store_are_listed_at_once(slow_store, tok_path):
    """Building a loader lists its remote sources at once: the two listings reach the store together
    (they came one source after the other, 3 round trips apart; then, still listed in threads, a
    second S3 client waited out the first one's requests in flight before sending its own)."""
    uri, log = slow_store
    t0 = time.monotonic()
    pretrain({"a": uri("slow-a"), "b": uri("slow-b")}, tokenizer=tok_path, num_workers=0, **ARGS)
    built = time.monotonic() - t0
    listings = sorted(t for t, _, method, path, _ in log if method == "GET" and "list-type" in path)
    assert len(listings) == 2, log
    assert listings[1] - listings[0] < LATENCY / 2, [round(t - t0, 3) for t in listings]
    # listing, then each file's open and footer (both sources at once): 3 round trips. Counted as the waves
    # of requests in the proxy's log (a request sent a round trip after the one before starts a wave), not
    # as the build's wall time, which a loaded machine stretches.
    sent = sorted(t for t, *_ in log)
    waves = 1 + sum(1 for a, b in zip(sent, sent[1:]) if b - a > 0.9 * LATENCY)
    assert waves <= 3, ([round(t - t0, 3) for t in sent], built)


def _first_units(units, shards, num_shards, seed, epochs):
    """The keys `start_first_fetches` fetches, by its rule written out again: shards in turn, each taking
    its next unit until it has FIRST_SHARD_BYTES of them or has looked at DEPTH units."""
    its, need, looked = [], {}, {}
    for g in shards:
        node = ShardUnits(units.rows, shard=g, num_shards=num_shards, seed=seed, epochs=epochs)
        node.reset(None)
        its.append(node.ahead())
    metas = {i: pq.ParquetFile(pa.BufferReader(units.footers[i])).metadata for i in range(len(units.files))}
    keys, live = [], list(range(len(its)))
    while live:
        for g in list(live):
            s = next(its[g], None)
            looked[g] = looked.get(g, 0) + 1
            if s is None:
                live.remove(g)
                continue
            key = (int(units.file[s.unit]), int(units.row_group[s.unit]))
            if key not in keys:
                keys.append(key)
                ranges = readahead.chunk_ranges(metas[key[0]], key[1], ["text"], units.files[key[0]].size)
                need[g] = need.get(g, 0) + sum(n for _, n in ranges)
            if need.get(g, 0) >= first_fetches.FIRST_SHARD_BYTES or looked[g] >= readahead.DEPTH:
                live.remove(g)
    return keys


def test_first_units_fetched_by_the_building_process_are_not_fetched_again(slow_store):
    """The process that lists a remote source fetches the first units of its shards with the handles
    listing opened (no size lookup, each range once): the readers take those bytes instead of fetching
    them, and read the same documents."""
    uri, log = slow_store
    units = list_parquet_units(resolve_files(uri("slow-a")), "text")
    assert units.handles is not None and units.footers is not None
    want = [_docs(_reader(units, 0, shard=g)) for g in (0, 1)]
    del log[:]
    first = first_fetches.start_first_fetches(units, "text", shards=[0, 1], num_shards=2, seed=3, epochs=2)
    assert first is not None and units.handles is None
    assert first.wait(30) and first.errors == 0
    keys = _first_units(units, [0, 1], 2, 3, 2)
    fetched = [(path, rng) for _, _, method, path, rng in log if method == "GET"]
    assert len(fetched) == len(set(fetched)) and all(m != "HEAD" for _, _, m, _, _ in log), log
    assert {first.size(k) is not None for k in keys} == {True}
    taken = 0
    for g in (0, 1):
        reader = _reader(units, 1 << 20, shard=g)
        assert _docs(reader) == want[g]
        taken += reader.readahead_stats()["first"]
    assert taken == len(keys) and all(first.size(k) is None for k in keys)  # every one taken, none fetched again


def _child_takes(first, keys, out):
    out.put(sum(first.take(k) is not None for k in keys))


def test_a_fork_waits_for_the_first_fetches_in_flight(slow_store):
    """Loader workers forked while the first fetches are on their way get all of them: the fork waits
    for the requests in flight (else the bytes would not be in the child's memory, and a new S3 client
    in the child would wait forever for the parent's requests). The parent lets go of them after as
    many forks as it has workers."""
    uri, _ = slow_store
    units = list_parquet_units(resolve_files(uri("slow-b")), "text")
    first = first_fetches.start_first_fetches(units, "text", shards=[0, 1], num_shards=2, seed=3, epochs=2, forks=1)
    keys = _first_units(units, [0, 1], 2, 3, 2)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_takes, args=(first, keys, out))
    child.start()  # at once: the fetches take at least LATENCY
    assert out.get(timeout=60) == len(keys) > 0
    child.join(30)
    assert all(first.size(k) is None and first.take(k) is None for k in keys)  # one fork: let go of in the parent
    assert pickle.loads(pickle.dumps(units)).handles is None  # a spawned worker gets the bytes, not the handles


# --- line units (jsonl, text): unit_readahead.py -------------------------------------------------------

@pytest.fixture(scope="module")
def line_files(s3, tmp_path_factory):
    """The S3 fixture's texts as 12 jsonl files and 8 text files (a paragraph per document; a file is a
    unit), on local disk and in the bucket under ``lines/``. Returns (local dir, s3 prefix)."""
    endpoint, access, secret, _, texts = s3
    local = tmp_path_factory.mktemp("lines")
    for i in range(12):
        with open(local / f"part-{i:02d}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts[i::12])
    for i in range(8):
        (local / f"part-{i:02d}.txt").write_text("\n\n".join(texts[i::8]) + "\n")
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1", aws_access_key_id=access,
                          aws_secret_access_key=secret)
    for p in sorted(os.listdir(local)):
        client.put_object(Bucket=BUCKET, Key=f"lines/{p}", Body=(local / p).read_bytes())
    return str(local), "lines"


LINE_ARGS = dict(seq_len=127, batch_size=4, buffer_size=24, seed=4, text_mode="paragraphs")


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_line_units_on_s3_read_ahead_equal_local_and_synchronous(s3, creds, tok_path, line_files, kind):
    local, prefix = line_files
    remote = _uri(s3, f"{BUCKET}/{prefix}/*.{kind}")
    args = dict(epochs=1, num_workers=2, **LINE_ARGS)
    on_disk = list(pretrain(os.path.join(local, f"*.{kind}"), tokenizer=tok_path, **args))
    loader = pretrain(remote, tokenizer=tok_path, **args)
    ahead = list(loader)
    creds.setenv(readahead.ENV, "0")
    sync = list(pretrain(remote, tokenizer=tok_path, **args))
    assert len(ahead) == len(sync) == len(on_disk) > 10
    for j, (a, b, c) in enumerate(zip(on_disk, ahead, sync)):
        assert items_equal(a, b) and items_equal(a, c), f"batch {j} of the {kind} files on S3 differs from local disk"
    stats = loader.stats()["sources"]["default"]["readahead"]
    assert stats["peak_bytes"] > 0, "nothing was fetched ahead"


def test_line_units_read_ahead_resume_exactly_at_every_step(tok_path, line_files, monkeypatch):
    local, _ = line_files
    monkeypatch.setenv(readahead.ENV, "all")
    monkeypatch.setenv(readahead.ENV_BYTES, "3K")  # about a unit ahead
    from tokenloom.pipes.sources import unit_readahead

    monkeypatch.setattr(unit_readahead, "PART_BYTES", 700)  # units in parts (the workers fork with it)
    files = {"j": os.path.join(local, "*.jsonl"), "t": os.path.join(local, "*.txt")}
    check_loader_resume(lambda: pretrain(files, tokenizer=tok_path, num_workers=2, **LINE_ARGS), steps=[1, 5], total=10)


def test_line_unit_fetch_error_names_the_unit(line_files, monkeypatch):
    from tokenloom.pipes.sources.line_listing import list_text_units
    from tokenloom.pipes import ReadText

    local, _ = line_files
    monkeypatch.setenv(readahead.ENV, "all")
    units = list_text_units(resolve_files(os.path.join(local, "*.txt"), "txt"), mode="paragraphs")
    node = ReadText(ShardUnits(units.rows, shard=0, num_shards=1, seed=1, epochs=1), units, source="t")
    node.reset()
    victim = [s.unit for s in node._cursor.parent.ahead()][1]  # the first unit is read inline, the next ahead
    real = node._bytes.ahead.opener
    node._bytes.ahead.opener = lambda i: (_ for _ in ()).throw(OSError("connection reset")) if i == int(
        units.file[victim]) else real(i)
    with pytest.raises(RuntimeError, match=r"cannot read .*part-\d+\.txt.*connection reset"):
        for _ in range(400):
            next(node)


def test_line_unit_readers_resume_at_every_step_with_read_ahead(line_files, monkeypatch):
    from tokenloom.pipes import ReadJsonl, list_jsonl_units

    local, _ = line_files
    monkeypatch.setenv(readahead.ENV, "all")
    monkeypatch.setenv(readahead.ENV_BYTES, "2K")
    units = list_jsonl_units(resolve_files(os.path.join(local, "*.jsonl"), "jsonl"))

    def build():
        return ReadJsonl(ShardUnits(units.rows, shard=1, num_shards=2, seed=3, epochs=2), units, source="j")

    node = build()
    node.reset()
    for _ in range(40):
        next(node)
    assert node.readahead_stats()["ready"] + node.readahead_stats()["waited"] > 0  # units came from read-ahead
    assert check_node_resume(build, max_steps=150) == 150


# --- listing line files on remote storage: listing_at_once.py ------------------------------------------------

@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_remote_line_listing_reads_blocks_at_once_and_lists_what_local_disk_lists(s3, creds, line_files, kind,
                                                                                  monkeypatch):
    """Files of a remote source are scanned at once, each by positional reads of BLOCK_BYTES (small here, so
    lines cross blocks): the units, line numbers and blank lines are those listed from local disk."""
    from tokenloom.pipes import list_jsonl_units
    from tokenloom.pipes.sources.line_listing import list_text_units

    local, prefix = line_files
    monkeypatch.setattr(listing_at_once, "BLOCK_BYTES", 1000)
    real, reads = listing_at_once.blocks_at_once, []

    def counted(handle, size, pool, **kw):
        reads.append(size)
        return real(handle, size, pool, block=1000, **kw)

    for module in ("line_listing", "jsonl"):
        monkeypatch.setattr(sys.modules[f"tokenloom.pipes.sources.{module}"], "blocks_at_once", counted)
    lister = (lambda spec: list_jsonl_units(resolve_files(spec, "jsonl"), rows_per_unit=7)) if kind == "jsonl" else \
        (lambda spec: list_text_units(resolve_files(spec, "txt"), mode="paragraphs", rows_per_unit=5))
    on_disk = lister(os.path.join(local, f"*.{kind}"))
    assert not reads
    remote = lister(_uri(s3, f"{BUCKET}/{prefix}/*.{kind}"))
    assert len(reads) == len(on_disk.files) and max(reads) > 3000, reads  # each file in blocks, at once
    for col in ("file", "start", "end", "first_line", "rows"):
        assert np.array_equal(getattr(remote, col), getattr(on_disk, col)), col
    assert remote.blank_lines == on_disk.blank_lines


def test_a_remote_jsonl_source_is_listed_in_a_few_round_trips(slow_store, line_files):
    """12 jsonl files behind LATENCY: listed at once, each in blocks at once (one file after another, each
    in 8 MB blocks, was 4 round trips a file, 48 in all)."""
    from tokenloom.pipes import list_jsonl_units

    uri, log = slow_store
    _, prefix = line_files
    spec = uri(prefix).replace("*.parquet", "*.jsonl")
    t0 = time.monotonic()
    units = list_jsonl_units(resolve_files(spec, "jsonl"))
    took = time.monotonic() - t0
    assert len(units.files) == 12 and units.total_rows > 0
    # the glob's listing, then each file's open, first bytes, open and blocks: 5 round trips, with room for a busy machine
    assert took < 10 * LATENCY, (took, len(log))


def test_line_units_longer_than_a_part_are_fetched_in_parts_and_read_the_same(line_files, monkeypatch):
    """A unit longer than PART_BYTES that the reader waits for is fetched as several reads at once (here parts
    of 97 bytes): the same documents as reading it in one piece; a part that comes back short is an error
    naming the unit, not a hole."""
    from tokenloom.pipes import ReadJsonl, list_jsonl_units
    from tokenloom.pipes.sources import unit_readahead

    local, _ = line_files
    units = list_jsonl_units(resolve_files(os.path.join(local, "*.jsonl"), "jsonl"))

    def docs():
        node = ReadJsonl(ShardUnits(units.rows, shard=0, num_shards=1, seed=3, epochs=1), units, source="j")
        node.reset()
        return [d.text for d in node], node

    monkeypatch.setenv(readahead.ENV, "0")
    want, _ = docs()
    monkeypatch.setenv(readahead.ENV, "all")
    monkeypatch.setattr(unit_readahead, "PART_BYTES", 97)
    real, sizes = readahead.read_range, []

    def counted(handle, off, n):
        sizes.append(n)
        return real(handle, off, n)

    monkeypatch.setattr(unit_readahead, "read_range", counted)
    got, node = docs()
    assert got == want and sizes.count(97) > 2, sizes
    assert node.readahead_stats()["ready"] + node.readahead_stats()["waited"] > 0

    class Short:  # a file that ends early: every read comes back a byte short
        def __init__(self, handle):
            self.handle = handle

        def read_at(self, n, off):
            return self.handle.read_at(n, off)[:-1]

    monkeypatch.setattr(unit_readahead, "read_range", lambda handle, off, n: real(Short(handle), off, n))
    with pytest.raises(RuntimeError, match=r"cannot read .*part-\d+\.jsonl.*bytes of 97"):
        docs()


def test_line_unit_sources_fetch_their_first_units_at_once_in_a_worker(slow_store, line_files, tok_path,
                                                                       monkeypatch):
    """In a loader worker a line reader's fetches start at reset: the first units of two sources reach the store
    together (they came one source after the other, the second after the first one's unit was read). The
    sources are listed without keeping their files open, so the building process fetches none of their units."""
    from tokenloom.pipes.sources import jsonl, line_listing

    monkeypatch.setattr(jsonl, "KEEP_OPEN", 0)
    monkeypatch.setattr(line_listing, "KEEP_OPEN", 0)
    uri, log = slow_store
    _, prefix = line_files
    base = uri(prefix)
    sources = {"j": base.replace("*.parquet", "*.jsonl"), "t": base.replace("*.parquet", "*.txt")}
    loader = pretrain(sources, tokenizer=tok_path, num_workers=1, **LINE_ARGS)
    built = time.monotonic()
    next(iter(loader))
    first = {}
    for arrived, answered, method, path, rng in log:
        if method == "GET" and arrived > built and rng:
            kind = path.rsplit(".", 1)[-1]
            first[kind] = min(first.get(kind, (arrived, answered)), (arrived, answered))
    assert set(first) == {"jsonl", "txt"}, log
    # In flight together: each source's first fetch reached the store before the other's was answered (one after
    # the other, the second would start once the first's unit was read, after its answer). No wall-time bound.
    (a_in, a_out), (b_in, b_out) = first.values()
    assert max(a_in, b_in) < min(a_out, b_out), first



def test_a_remote_jsonl_file_is_opened_once_to_be_listed(slow_store, line_files, s3):
    """Listing a remote jsonl file opens it once: its first reads tell a JSON array apart (a separate open
    and read of its first 64 KB came first), and an array file on S3 lists as on local disk."""
    from tokenloom.pipes import list_jsonl_units

    uri, log = slow_store
    local, prefix = line_files
    spec = uri(prefix).replace("*.parquet", "*.jsonl")
    del log[:]
    list_jsonl_units(resolve_files(spec, "jsonl"))
    heads = [path for _, _, method, path, _ in log if method == "HEAD" and path.endswith(".jsonl")]
    assert len(heads) == len(set(heads)) == 12, heads
    assert not any(rng == "bytes=0-65535" for *_, rng in log), log

    endpoint, access, secret, _, texts = s3
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1", aws_access_key_id=access,
                          aws_secret_access_key=secret)
    mixed = os.path.join(local, "..", "mixed-layouts")
    os.makedirs(mixed, exist_ok=True)
    with open(os.path.join(mixed, "a.json"), "w") as f:
        f.write("  \n" + json.dumps([{"text": t} for t in texts[:40]], indent=1))
    with open(os.path.join(mixed, "b.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[40:90])
    for name in ("a.json", "b.jsonl"):
        with open(os.path.join(mixed, name), "rb") as f:
            client.put_object(Bucket=BUCKET, Key=f"mixed-layouts/{name}", Body=f.read())
    on_disk = list_jsonl_units(resolve_files(os.path.join(mixed, "*"), "jsonl"), rows_per_unit=7)
    remote = list_jsonl_units(resolve_files(_uri(s3, f"{BUCKET}/mixed-layouts/*"), "jsonl"), rows_per_unit=7)
    assert list(remote.arrays) == list(on_disk.arrays) == [True, False]
    for col in ("file", "start", "end", "first_line", "rows"):
        assert np.array_equal(getattr(remote, col), getattr(on_disk, col)), col


def test_fill_plan_ends_on_an_endless_plan_of_one_unit():
    """A small file is one unit, and an endless stream plans it every epoch: the plan skips its repeats, and
    looks at LOOK_PER_DEPTH keys per unit of depth at most (it looked forever: a worker hung at its reset)."""
    from collections import deque
    from itertools import repeat

    ahead = deque()
    assert readahead.fill_plan(ahead, repeat((0, 0)), 16, None) == (0, 0) and list(ahead) == [(0, 0)]
    keys = iter([None] * 100 + [(1, 0)])
    assert readahead.fill_plan(ahead, keys, 16, None) is None and list(ahead) == [(0, 0)]  # 64 looked at
    readahead.fill_plan(ahead, keys, 16, None)
    assert list(ahead) == [(0, 0), (1, 0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_an_endless_source_of_one_unit_reads_ahead_in_a_worker(tmp_path, tok_path, monkeypatch, kind):
    """One file of one unit, an endless stream, read-ahead on, in a loader worker (whose read-ahead plans at
    reset): batches come (the worker hung planning the unit's repeats, epoch after epoch)."""
    texts = [f"document {i} " + "word " * (i % 7) for i in range(30)]
    if kind == "parquet":
        write_corpus(str(tmp_path), texts, files=1, row_group_size=100)
        spec = str(tmp_path / "*.parquet")
    else:
        with open(tmp_path / "one.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        spec = str(tmp_path / "*.jsonl")
    monkeypatch.setenv(readahead.ENV, "all")
    want = list(islice(pretrain(spec, tokenizer=tok_path, num_workers=0, **ARGS), 12))
    got = list(islice(pretrain(spec, tokenizer=tok_path, num_workers=1, **ARGS), 12))
    assert len(got) == 12 and all(items_equal(a, b) for a, b in zip(want, got))


def test_a_remote_compressed_file_is_read_in_blocks_not_in_the_codecs_64_kb_reads(slow_store, s3, tmp_path):
    """A .jsonl.gz on S3 is read ahead in order, BLOCK_BYTES a request (pyarrow's codec asked for 64 KB a read,
    each a round trip): the same units and documents as from local disk, in a few requests."""
    import gzip
    import random

    from tokenloom.pipes import ReadJsonl, list_jsonl_units

    uri, log = slow_store
    endpoint, access, secret, _, _ = s3
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"] + [str(i) for i in range(500)]
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))}) + "\n" for _ in range(3000)]
    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress("".join(lines).encode()))
    size = (tmp_path / "big.jsonl.gz").stat().st_size
    assert size > 4 * 65536
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1", aws_access_key_id=access,
                          aws_secret_access_key=secret)
    client.put_object(Bucket=BUCKET, Key="gz/big.jsonl.gz", Body=(tmp_path / "big.jsonl.gz").read_bytes())

    def docs(spec):
        units = list_jsonl_units(resolve_files(spec, "jsonl"))
        node = ReadJsonl(ShardUnits(units.rows, shard=0, num_shards=1, seed=3, epochs=1, shuffle=False), units,
                         source="z")
        node.reset()
        return units, [d.text for d in node]

    local_units, want = docs(str(tmp_path / "*.jsonl.gz"))
    del log[:]
    remote_units, got = docs(uri("gz").replace("*.parquet", "*.jsonl.gz"))
    assert got == want and np.array_equal(remote_units.end, local_units.end)
    gets = [rng_ for _, _, method, path, rng_ in log if method == "GET" and path.endswith("big.jsonl.gz") and rng_]
    # the first bytes, the listing's scan, the content key's tail, the reader: a request each (12 in 64 KB reads)
    assert len(gets) <= 6, gets


def test_a_compressed_source_on_s3_in_workers_equals_local_disk_and_resumes(s3, creds, tok_path, tmp_path):
    """.jsonl.gz files on S3 read through `InOrder` in two loader workers (a stream pool each, made after the
    fork): the batches of local disk, and a resume mid-file gives the uninterrupted run's next batches."""
    import gzip

    endpoint, access, secret, _, texts = s3
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1", aws_access_key_id=access,
                          aws_secret_access_key=secret)
    for i in range(3):
        body = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts[i::3]).encode())
        (tmp_path / f"p{i}.jsonl.gz").write_bytes(body)
        client.put_object(Bucket=BUCKET, Key=f"gz-workers/p{i}.jsonl.gz", Body=body)
    remote = _uri(s3, f"{BUCKET}/gz-workers/*.jsonl.gz")
    args = dict(epochs=1, num_workers=2, **LINE_ARGS)
    on_disk = list(pretrain(str(tmp_path / "*.jsonl.gz"), tokenizer=tok_path, **args))
    got = list(pretrain(remote, tokenizer=tok_path, **args))
    assert len(got) == len(on_disk) > 6 and all(items_equal(a, b) for a, b in zip(on_disk, got))
    loader = pretrain(remote, tokenizer=tok_path, **args)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    again = pretrain(remote, tokenizer=tok_path, **args)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(on_disk) - 5 and all(items_equal(a, b) for a, b in zip(on_disk[5:], rest))
