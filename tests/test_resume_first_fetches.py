"""A resume from a slow store starts like a fresh run: the process that loads the state fetches the
row groups its workers read first from the loaded positions (first_fetches.py's `fetch_first_from`,
through `PackedGraph.fetch_first`), and a worker's graph is not started from nothing before its
state is loaded (which fetched the fresh positions' units, then dropped them at the restore).

The oracle does not share the planning code: the worker itself records which row groups it loads
(`ReadParquet._load`, patched before the fork), and the store's log says when each byte range was
asked for. Every batch is also compared with the uninterrupted run.
"""

from __future__ import annotations

import json
import os

import boto3
import pytest

from tokenloom.pipes import ReadParquet
from tokenloom.pipes.sources.readahead import RowGroupReadAhead
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
    fetches), on local disk and in the bucket under ``many/``. Returns the local directory."""
    endpoint, access, secret, _, _ = s3
    local = tmp_path_factory.mktemp("many_units")
    texts = [" ".join(t.split()[:30]) for t in synthetic_texts(1500, seed=31)]
    write_corpus(str(local), texts, files=3, row_group_size=20)
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    for name in sorted(os.listdir(local)):
        client.put_object(Bucket=BUCKET, Key=f"many/{name}", Body=(local / name).read_bytes())
    return str(local)


@pytest.mark.parametrize("saved_workers", [1, 2])  # 2: an elastic resume (the plan hands over the old shards' rows)
def test_a_resume_fetches_its_first_units_before_the_workers_start(s3, creds, tok_path, many_units, tmp_path,
                                                                   monkeypatch, saved_workers):
    endpoint = s3[0]
    bench = _load_remote_benchmark()
    port = bench._free_port()
    proxy = bench.slow_proxy(port, int(endpoint.split(":")[1]), LATENCY, 50e6)
    try:
        uri = _uri(s3, f"{BUCKET}/many/*.parquet").replace(endpoint, f"127.0.0.1:{port}")
        # saved on local disk (a corpus moved to a bucket resumes), well past the fresh run's first fetches
        loader = pretrain(os.path.join(many_units, "*.parquet"), tokenizer=tok_path,
                          **dict(ARGS, num_workers=saved_workers))
        it = iter(loader)
        for _ in range(SAVE_AT):
            next(it)
        state = loader.state_dict()
        want = next(it) if saved_workers == ARGS["num_workers"] else None
        if want is None:
            state = [state]  # every old rank's state: an elastic resume onto one worker
        del it, loader

        # what the worker does, recorded by the worker itself (forked with these patches)
        events = tmp_path / "events.jsonl"
        parent = os.getpid()

        def record(kind, file, group):
            if os.getpid() != parent:
                with open(events, "a") as f:
                    f.write(json.dumps([kind, int(file), int(group)]) + "\n")

        load, take, fetch = ReadParquet._load, RowGroupReadAhead._take_first, RowGroupReadAhead._fetch_part
        monkeypatch.setattr(ReadParquet, "_load", lambda self, s: (
            record("load", self.units.file[s.unit], self.units.row_group[s.unit]), load(self, s))[1])
        monkeypatch.setattr(RowGroupReadAhead, "_take_first", lambda self, key, *a: (
            record("took", *key), take(self, key, *a))[1])
        monkeypatch.setattr(RowGroupReadAhead, "_fetch_part", lambda self, f, *a: (
            record("fetched", *f.key), fetch(self, f, *a))[1])
        resumed = pretrain(uri, tokenizer=tok_path, **ARGS)
        resumed.load_state_dict(state)
        got = [next(iter(resumed)) for _ in range(1)]
        del resumed
    finally:
        proxy.shutdown()
    assert want is None or items_equal(want, got[0]), "the resumed run is not the uninterrupted one"

    seen = [json.loads(line) for line in events.read_text().splitlines()]
    loaded = [tuple(e[1:]) for e in seen if e[0] == "load"]
    took = [tuple(e[1:]) for e in seen if e[0] == "took"]
    fetched = {tuple(e[1:]) for e in seen if e[0] == "fetched"}
    assert len(loaded) >= 3, seen
    first = loaded[:3]  # the row groups the restore reads first
    assert not fetched & set(first), (f"the worker fetched {sorted(fetched & set(first))} itself, among the first "
                                     f"row groups it read {first}: the process that loaded the state did not")
    assert set(first) <= set(took), (first, took)
    assert len(took) == len(set(took)), f"row groups taken twice (dropped at the restore, taken again): {took}"


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
