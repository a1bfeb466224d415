"""A token cache on a slow store (cache_remote.py): its folder is read beside the sources' listing, in
one listing; the build reads its footers once, for every worker; the first row groups a worker reads
were fetched by the process that built the loader (fresh and resumed); errors name what they named.

The store is the s3 fixture's bucket behind benchmarks/remote.py's proxy, whose log says when each
request arrived and was answered. The worker records what it loads, takes and fetches through patches
it inherits at the fork, so the checks do not share the planning code.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import boto3
import pytest

from tokenloom.pipes.sources.cache import build_cache
from tokenloom.recipes import pretrain

from .resume import items_equal
from .test_readahead import LATENCY, _load_remote_benchmark
from .test_resume_first_fetches import _record_the_worker
from .test_s3 import BUCKET, _uri, creds, s3  # noqa: F401 (fixtures)

ARGS = dict(seq_len=127, batch_size=4, buffer_size=16, seed=5)
SAVE_AT = 12


@pytest.fixture
def slow_cache(s3, creds, tok_path):
    """The s3 fixture's files, their token cache built into the bucket (straight to moto), and the bucket
    behind the slow proxy. Yields (uri of the files, uri of the cache, the proxy's log, a boto3 client),
    both uris through the proxy."""
    endpoint, access, secret, _, _ = s3
    cache = _uri(s3, f"{BUCKET}/cache-remote")
    done = build_cache({"web": _uri(s3)}, tok_path, cache, processes=1)
    assert done["complete"]
    bench = _load_remote_benchmark()
    port, log = bench._free_port(), []
    proxy = bench.slow_proxy(port, int(endpoint.split(":")[1]), LATENCY, 50e6, log=log)
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                          aws_access_key_id=access, aws_secret_access_key=secret)
    slow = lambda uri: uri.replace(endpoint, f"127.0.0.1:{port}")  # noqa: E731
    try:
        yield slow(_uri(s3)), slow(cache), log, client
    finally:
        proxy.shutdown()
        for obj in client.list_objects_v2(Bucket=BUCKET, Prefix="cache-remote/").get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])


@pytest.mark.parametrize("start", ["fresh", "resume"])
def test_the_first_cached_units_come_before_the_workers_start(s3, slow_cache, tok_path, tmp_path, monkeypatch, start):
    """The row groups of the token cache a worker reads first were fetched by the process that built the
    loader (and loaded the state), not by the worker; a resume's next batch is the uninterrupted run's."""
    files, cache, _, _ = slow_cache
    want = state = None
    if start == "resume":  # saved by a loader tokenizing the local copies: the same units, positions and batches
        loader = pretrain({"web": os.path.join(s3[3], "*.parquet")}, tokenizer=tok_path, num_workers=1, **ARGS)
        it = iter(loader)
        for _ in range(SAVE_AT):
            next(it)
        state, want = loader.state_dict(), next(it)
        del it, loader
    events = tmp_path / "events.jsonl"
    _record_the_worker(monkeypatch, events)
    loader = pretrain({"web": files}, tokenizer=tok_path, cache=cache, cache_strict=True, num_workers=1, **ARGS)
    if state is not None:
        loader.load_state_dict(state)
    got = next(iter(loader))
    del loader
    assert want is None or items_equal(want, got), "the resumed run is not the uninterrupted one"

    seen = [json.loads(line) for line in events.read_text().splitlines()]
    loaded = [tuple(e[1:]) for e in seen if e[0] == "load"]
    took = {tuple(e[1:]) for e in seen if e[0] == "took"}
    fetched = {tuple(e[1:]) for e in seen if e[0] == "fetched"}
    assert len(loaded) >= 3, seen
    first = loaded[:3]
    assert not fetched & set(first), (f"the worker fetched {sorted(fetched & set(first))} itself, among the first "
                                     f"units it read {first}: the process that built the loader did not")
    assert set(first) <= took, (first, took)


def test_the_cache_is_read_in_one_listing_beside_the_sources_and_its_footers_once(slow_cache, tok_path):
    """The cache's folder is listed once (it was listed twice, and its tokens/ a third time, one after the
    other, after the sources' listing), while the sources are listed; with 2 workers each cache file's
    footer is read once, by the build (each worker read every footer it needed)."""
    files, cache, log, client = slow_cache
    sizes = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="cache-remote/")["Contents"]}
    del log[:]
    loader = pretrain({"web": files}, tokenizer=tok_path, cache=cache, cache_strict=True, num_workers=2, **ARGS)
    it = iter(loader)
    for _ in range(4):
        next(it)
    del it, loader

    listings = [(arrived, path) for arrived, _, method, path, _ in log if method == "GET" and "list-type" in path]
    of_cache = [t for t, path in listings if "cache-remote" in path]
    assert len(of_cache) == 1, listings
    tails = Counter()
    for _, _, method, path, rng in log:
        key = path.split("?")[0].split(f"/{BUCKET}/", 1)[-1]
        if method == "GET" and key.endswith(".parquet") and "/tokens/" in key and rng.endswith(f"-{sizes[key] - 1}"):
            tails[key] += 1
    cache_files = [k for k in sizes if "/tokens/" in k and k.endswith(".parquet")]
    assert tails and set(tails) <= set(cache_files) and set(tails.values()) == {1}, tails
    source_footers = [answered for _, answered, method, path, rng in log
                      if method == "GET" and rng and "/web/2024/" in path]
    assert source_footers and of_cache[0] < min(source_footers), "the cache was read after the sources' listing"


def test_a_bad_manifest_on_the_store_is_named(slow_cache, tok_path):
    files, cache, _, client = slow_cache
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="cache-remote/")["Contents"]
               if o["Key"].endswith(".json"))
    client.put_object(Bucket=BUCKET, Key=key, Body=b"{not json")
    with pytest.raises(ValueError, match=rf"{os.path.basename(key)} is not valid JSON .*build the cache again"):
        pretrain({"web": files}, tokenizer=tok_path, cache=cache, num_workers=0, **ARGS)


def test_a_cache_file_whose_footer_is_corrupt_is_named_when_read(slow_cache, tok_path):
    """The build cannot read the footer: it does not ship it, and the reader names the cache file and
    says to rebuild, as it did when every worker read its own footers."""
    files, cache, _, client = slow_cache
    key = sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="cache-remote/")["Contents"]
                 if "/tokens/" in o["Key"] and o["Key"].endswith(".parquet"))[0]
    data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=data[:-12] + b"\0" * 12)  # same size, no footer
    loader = pretrain({"web": files}, tokenizer=tok_path, cache=cache, num_workers=0, epochs=1, **ARGS)
    with pytest.raises(RuntimeError, match=rf"cannot read cache file .*{os.path.basename(key)}.*rebuild the cache"):
        for _ in loader:
            pass


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_a_remote_cache_resumes_exactly_through_the_shared_helper(slow_cache, tok_path, workers):
    """The shared resume helper over a token cache on the slow store, whose first row groups the building
    process fetches (and, resuming, those of the loaded positions), with 0, 1 and 3 workers; its batches are
    those of tokenizing the same files on the fly."""
    from .resume import check_loader_resume

    files, cache, _, _ = slow_cache
    args = dict(ARGS, num_workers=workers)
    on_the_fly = [b for _, b in zip(range(10), pretrain({"web": files}, tokenizer=tok_path, **args))]
    check_loader_resume(lambda: pretrain({"web": files}, tokenizer=tok_path, cache=cache, cache_strict=True, **args),
                        steps=[1, 6], total=10, reference=on_the_fly)


def test_a_build_that_fails_before_matching_closes_the_files_the_cache_reads_opened(slow_cache, tok_path, monkeypatch):
    """The cache's folder is read while the sources are listed; a build that then fails (here: a source
    with too few rows for its shards) closes the cache files that read opened, once the read ends."""
    from tokenloom.pipes.sources import cache_remote

    files, cache, _, _ = slow_cache
    opened, closed = [], []
    read_cache, close = cache_remote.read_cache, cache_remote.CacheRead.close

    def recorded(spec, name):
        read = read_cache(spec, name)
        opened.extend(f.handle for f in read.footers.values() if getattr(f, "handle", None) is not None)
        return read

    monkeypatch.setattr("tokenloom.pipes.sources.cache.read_cache", recorded)
    monkeypatch.setattr(cache_remote.CacheRead, "close", lambda self: (closed.append(self), close(self))[1])
    with pytest.raises(ValueError, match="shard"):
        pretrain({"web": files}, tokenizer=tok_path, cache=cache, num_workers=2, world_size=1000, rank=0, **ARGS)
    deadline = time.monotonic() + 30
    while not closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert opened and closed and all(h.closed for h in opened), (len(opened), len(closed))
