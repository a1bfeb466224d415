"""``https://`` and ``hf://`` sources through their real clients (http_store.py's range requests,
``huggingface_hub``'s HfApi) against a local server (tests/http_server.py) that speaks plain HTTP
with ranges and the Hub's API, and injects 429s, 503s, reset connections and short answers.

Checked: the batches equal those of the same files on local disk, bit for bit (0 and 2 workers);
exact resume; an elastic resume through the Hub delivers every document once (the oracle's count
of tokens and starts); the same through injected faults; a Hub revision that moved under a run is
refused at resume naming the changed file; retries give up within their bounds naming the URL;
clear errors for what HTTP cannot do and for cloud stores without credentials.
"""

from __future__ import annotations

import logging
import os
import random
import shutil

import pyarrow.fs as pafs
import pytest

from tokenloom.pipes.sources.files import resolve_files
from tokenloom.pipes.sources.from_uri import filesystem_from_uri, google_credentials
from tokenloom.pipes.sources.http_store import HttpHandler
from tokenloom.pipes.sources.retry import RemoteError, RetryPolicy, TransientError, retry_after_seconds
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .http_server import Server
from .resume import check_loader_resume, items_equal
from .test_elastic import (Corpus, check_exactly_once, elastic_resume, ids_corpus, make_builder,  # noqa: F401
                           old_run, received)

ARGS = dict(seq_len=127, batch_size=4, buffer_size=24, seed=4)
#: Retries of the fault tests: their waits short, so that what is tested is what the faults change (nothing),
#: not how long backing off takes on a busy machine (the default policy's waits: its own tests).
QUICK_RETRY = RetryPolicy(backoff_s=0.005, max_backoff_s=0.05)
SHA_A, SHA_B = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three parquet files of 600 documents, row groups of 32 rows; returns (folder, texts)."""
    root = tmp_path_factory.mktemp("remote")
    texts = synthetic_texts(600, seed=11)
    write_corpus(str(root), texts, files=3, row_group_size=32)
    return str(root), texts


@pytest.fixture
def hub_env(monkeypatch):
    """Point huggingface_hub at a server for the test (its endpoint is read when the client is made)."""
    def point(server: Server) -> None:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        import huggingface_hub.constants as c
        monkeypatch.setattr(c, "ENDPOINT", server.url)
    return point


def _urls(server: Server, folder: str):
    return [f"{server.url}/files/{n}" for n in sorted(os.listdir(folder)) if n.endswith(".parquet")]


def _all(spec, tok, **kw):
    return list(pretrain(spec, tokenizer=tok, epochs=1, **{**ARGS, **kw}))


def _same(a, b, what):
    assert len(a) == len(b) > 10, (len(a), len(b))
    for j, (x, y) in enumerate(zip(a, b)):
        assert items_equal(x, y), f"batch {j} {what} differs from the same files read from disk"


# --- the same batches as local files ------------------------------------------------------------

def test_https_urls_give_the_batches_of_local_files_and_resume_exactly(files, tok_path):
    folder, _ = files
    with Server(folder) as server:
        local = _all(os.path.join(folder, "*.parquet"), tok_path, num_workers=2)
        over_http = _all(_urls(server, folder), tok_path, num_workers=2)
        _same(local, over_http, "read over HTTP")
        check_loader_resume(lambda: pretrain(_urls(server, folder), tokenizer=tok_path, num_workers=2, **ARGS),
                            steps=[3, 9], total=14)
        assert all(m in ("GET", "HEAD") for m, _, _ in server.log)
        assert any(r for _, _, r in server.log), "no range request was made"


def test_hub_glob_and_pinned_revision_give_the_batches_of_local_files(files, tok_path, hub_env, caplog):
    folder, _ = files
    with Server(folder, {"org/web": {"main": (SHA_A, folder), SHA_A: (SHA_A, folder)}}) as server:
        hub_env(server)
        local = _all(os.path.join(folder, "*.parquet"), tok_path)
        with caplog.at_level(logging.INFO, logger="tokenloom"):
            hub = _all("hf://datasets/org/web/*.parquet", tok_path)
        _same(local, hub, "read from the Hub")
        assert any(f"pinned to revision {SHA_A}" in r.getMessage() for r in caplog.records)
        pinned = _all(f"hf://datasets/org/web@{SHA_A}/part-00[0-2].parquet", tok_path)
        _same(local, pinned, "read from the Hub at a pinned sha")
        got = resolve_files("hf://datasets/org/web/part-001.parquet")
        assert [f.uri for f in got] == [f"hf://datasets/org/web@{SHA_A}/part-001.parquet"]
        assert all(f"/resolve/{SHA_A}/" in p for _, p, _ in server.log if "/resolve/" in p)
        # a source is listed with two calls: the revision and the tree; no HEAD per file
        assert not any(m == "HEAD" for m, _, _ in server.log)


@pytest.mark.parametrize("kinds", [("429", "503", "reset", "short")], ids=["429-503-reset-short"])
def test_injected_faults_change_nothing(files, tok_path, hub_env, kinds):
    folder, _ = files
    local = _all(os.path.join(folder, "*.parquet"), tok_path, num_workers=2)
    with Server(folder, {"org/web": {"main": (SHA_A, folder)}}, fault_every=2, fault_kinds=kinds) as server:
        hub_env(server)
        _same(local, _all(_urls(server, folder), tok_path, num_workers=2, retry=QUICK_RETRY),
              "read over HTTP through faults")
        _same(local, _all("hf://datasets/org/web/*.parquet", tok_path, num_workers=2, retry=QUICK_RETRY),
              "read from the Hub through faults")
        assert server.faults >= 12, server.faults


def test_a_hub_revision_that_moved_is_refused_at_resume_naming_the_file(files, tok_path, hub_env, tmp_path,
                                                                       monkeypatch):
    folder, texts = files
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    write_corpus(str(moved), [t + " changed" if i % 7 == 0 else t for i, t in enumerate(texts)], files=3,
                 row_group_size=32)
    os.remove(moved / "part-000.parquet")
    shutil.copy(os.path.join(folder, "part-000.parquet"), moved / "part-000.parquet")  # only 001 and 002 change
    revisions = {"main": (SHA_A, folder), SHA_A: (SHA_A, folder)}
    with Server(folder, {"org/web": revisions}) as server:
        hub_env(server)
        build = lambda: pretrain("hf://datasets/org/web/*.parquet", tokenizer=tok_path, **ARGS)
        loader = build()
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        del it
        revisions["main"] = (SHA_B, str(moved))
        revisions[SHA_B] = (SHA_B, str(moved))
        monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "later"))  # past the host's shared answer
        resumed = build()
        with pytest.raises(ValueError, match="part-001.parquet"):
            resumed.load_state_dict(state)


def test_elastic_resume_through_the_hub_delivers_every_document_once(ids_corpus, tok_path, hub_env):
    root = os.path.dirname(os.path.dirname(ids_corpus.globs["a"]))
    with Server(root, {"org/ids": {"main": (SHA_A, root)}}, fault_every=5) as server:
        hub_env(server)
        hub = Corpus({n: f"hf://datasets/org/ids/{n}/*.parquet" for n in ids_corpus.globs}, ids_corpus.docs,
                     ids_corpus.source_tokens, ids_corpus.source_docs, ids_corpus.tokenizer)
        build = make_builder(hub, retry=QUICK_RETRY)
        first = old_run(build, 2, 2, steps=5)
        resumed = elastic_resume(build, [r.final for r in first], 1, 2)
        from tokenloom.pipes import load_encoder
        got = received([b for r in first for b in r.batches] + [b for r in resumed for b in r.batches],
                       ids_corpus, load_encoder(tok_path))
        check_exactly_once(got, ids_corpus, ("a", "b"), "2x2 -> 1x2 through the Hub")
        assert server.faults > 0


# --- retries ------------------------------------------------------------------------------------

def test_a_hub_listing_goes_on_through_reset_connections(files, hub_env, tmp_path, monkeypatch):
    """huggingface_hub 2 reads through httpx (its vendored httpx2), whose dropped connections are not
    OSErrors: the listing retries them as any other client's (a CI run failed on one)."""
    folder, _ = files
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))  # nothing listed before: every call made
    with Server(folder, {"org/resets": {"main": (SHA_A, folder)}}, fault_every=2, fault_kinds=("reset",)) as server:
        hub_env(server)
        got = resolve_files("hf://datasets/org/resets/*.parquet", retry=QUICK_RETRY)
        assert len(got) == 3 and server.faults >= 1, (got, server.faults)


def test_retries_give_up_within_their_bounds_naming_the_url_and_the_range(files):
    folder, _ = files
    with Server(folder, fault_every=1, fault_kinds=("503",)) as server:
        handler = HttpHandler(retry=RetryPolicy(attempts=3, backoff_s=0.0))
        url = f"{server.url}/files/part-000.parquet"
        with pytest.raises(RemoteError) as e:
            handler.read_range(url, 100, 50, 10_000)
        assert url in str(e.value) and "bytes 100-149" in str(e.value) and "3 times" in str(e.value)
        assert len(server.log) == 3
    with pytest.raises(RemoteError, match="max_time_s"):
        RetryPolicy(attempts=100, backoff_s=1.0, max_time_s=0.5).call(
            lambda: (_ for _ in ()).throw(TransientError("busy", 503)), "a call", sleep=lambda s: None)


def test_a_retry_waits_what_retry_after_asks_and_backs_off_with_jitter():
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=4.0)
    rng = random.Random(0)
    waits = [policy.wait(k, None, rng) for k in range(1, 9)]
    assert all(0 <= w <= min(4.0, 0.5 * 2 ** (k - 1)) for k, w in zip(range(1, 9), waits))
    assert len(set(waits)) == len(waits), "waits are drawn (jitter), not fixed"
    assert policy.wait(1, 7.0, rng) == 7.0
    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    slept = []
    calls = iter([TransientError("slow down", 429, 2.5), TransientError("busy", 503), "ok"])

    def call():
        got = next(calls)
        if isinstance(got, Exception):
            raise got
        return got
    assert RetryPolicy(backoff_s=0.0).call(call, "x", sleep=slept.append) == "ok"
    assert slept[0] == 2.5 and len(slept) == 2
    for bad in (dict(attempts=0), dict(max_time_s=0), dict(backoff_s=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)


def test_a_changed_file_under_a_running_reader_is_an_error_not_other_bytes(files, tmp_path):
    folder, _ = files
    shutil.copy(os.path.join(folder, "part-000.parquet"), tmp_path / "x.parquet")
    with Server(str(tmp_path)) as server:
        handler = HttpHandler()
        url = f"{server.url}/files/x.parquet"
        size = handler.info(url).size
        assert handler.read_range(url, 0, 4, size) == b"PAR1"
        os.utime(tmp_path / "x.parquet", (1, 1))  # the server's ETag follows the file's time
        with pytest.raises(OSError, match="changed on the server"):
            handler.read_range(url, 0, 4, size)


# --- what cannot work says so -------------------------------------------------------------------

def test_http_globs_folders_and_missing_files_are_clear_errors(files, tok_path):
    folder, _ = files
    with Server(folder) as server:
        with pytest.raises(FileNotFoundError, match="404"):
            resolve_files(f"{server.url}/files/nope.parquet")
        with pytest.raises(FileNotFoundError, match="cannot be listed"):
            resolve_files(f"{server.url}/files/")
        with pytest.raises(OSError, match="no directory listing"):
            pafs.PyFileSystem(HttpHandler()).get_file_info(pafs.FileSelector(f"{server.url}/files"))


def test_cloud_stores_without_credentials_fail_fast_with_what_to_set(monkeypatch, tmp_path):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    assert not google_credentials()
    fs, path = filesystem_from_uri("gs://public-bucket/data/x.parquet")
    assert fs.type_name == "gcs" and path == "public-bucket/data/x.parquet"
    (tmp_path / "application_default_credentials.json").write_text("{}")
    assert google_credentials()
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    with pytest.raises(ValueError, match="AZURE_STORAGE_ACCOUNT_NAME"):
        filesystem_from_uri("az://container/x.parquet")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    fs, path = filesystem_from_uri("az://container/x.parquet")
    assert fs.type_name == "abfs" and path == "container/x.parquet"


def test_an_hf_source_names_a_missing_repository_and_revision(tok_path, hub_env, files):
    folder, _ = files
    with Server(folder, {"org/web": {"main": (SHA_A, folder)}}) as server:
        hub_env(server)
        with pytest.raises(FileNotFoundError, match="repository 'org/nope' not found"):
            resolve_files("hf://datasets/org/nope/*.parquet")
        with pytest.raises(FileNotFoundError, match="revision 'v9' not found"):
            resolve_files("hf://datasets/org/web@v9/*.parquet")
        with pytest.raises(FileNotFoundError, match="matched no files"):
            resolve_files("hf://datasets/org/web/*.jsonl")


def test_the_retry_setting_reaches_the_requests(files, tok_path):
    from tokenloom.recipes import RetryPolicy
    folder, _ = files
    with Server(folder, fault_every=1, fault_kinds=("503",)) as server:
        with pytest.raises(RemoteError, match="failed 2 times"):
            pretrain(_urls(server, folder)[:1], tokenizer=tok_path, retry=RetryPolicy(attempts=2, backoff_s=0.0), **ARGS)
        assert len(server.log) == 2


def test_jsonl_and_text_over_http_give_the_batches_of_local_files(tmp_path, tok_path):
    import json
    texts = synthetic_texts(300, seed=5)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "b.txt").write_text("\n\n".join(texts[:50]))
    with Server(str(tmp_path)) as server:
        for name, mode in (("a.jsonl", "file"), ("b.txt", "paragraphs")):
            local = _all(str(tmp_path / name), tok_path, text_mode=mode, num_workers=2)
            remote = _all(f"{server.url}/files/{name}", tok_path, text_mode=mode, num_workers=2)
            assert len(local) == len(remote) > 0
            assert all(items_equal(a, b) for a, b in zip(local, remote)), name


def test_ranks_of_one_host_list_a_hub_commit_and_read_its_footers_once(files, tok_path, hub_env, tmp_path, monkeypatch):
    folder, _ = files
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    with Server(folder, {"org/web": {"main": (SHA_A, folder)}}) as server:
        hub_env(server)
        spec = f"hf://datasets/org/web@{SHA_A}/*.parquet"
        sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}

        def footers(log):  # reads that end at a file's last byte
            return [p for _, p, r in log if r and r.endswith(f"-{sizes.get(p.rpartition('/')[2], -1) - 1}")]
        for rank in range(4):
            before = len(server.log)
            it = iter(pretrain(spec, tokenizer=tok_path, rank=rank, world_size=4, **ARGS))
            next(it)
            del it
            trees = [p for _, p, _ in server.log if "/tree/" in p]
            assert len(trees) == 1, f"rank {rank}: the tree was listed {len(trees)} times"
            read = footers(server.log[before:])
            assert len(read) == (3 if rank == 0 else 0), f"rank {rank} read footers {read}"
    monkeypatch.setenv("TOKENLOOM_CACHE", "0")
    with Server(folder, {"org/web": {"main": (SHA_A, folder)}}) as server:
        hub_env(server)
        for _ in range(2):
            resolve_files(spec)
        assert len([p for _, p, _ in server.log if "/tree/" in p]) == 2, "TOKENLOOM_CACHE=0 keeps nothing"


def test_the_host_cache_fetches_an_entry_once_for_concurrent_processes(tmp_path, monkeypatch):
    import threading
    import time

    from tokenloom.pipes.sources.host_cache import shared
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    calls, got = [], []

    def fetch():
        calls.append(1)
        time.sleep(0.2)
        return b"the listing"
    threads = [threading.Thread(target=lambda: got.append(shared("t", "k", fetch))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and got == [b"the listing"] * 6
    with pytest.raises(RuntimeError):
        shared("t", "other", lambda: (_ for _ in ()).throw(RuntimeError("store down")))
    assert shared("t", "other", lambda: b"later") == b"later", "a failed fetch is not kept"


def test_ranks_of_one_host_starting_together_pin_the_same_commit_and_version(files, tok_path, hub_env, tmp_path,
                                                                              monkeypatch):
    folder, _ = files
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    revisions = {"main": (SHA_A, folder)}
    with Server(folder, {"org/web": revisions}) as server:
        hub_env(server)
        first = resolve_files("hf://datasets/org/web/*.parquet")
        revisions["main"] = (SHA_B, folder)  # a push between two ranks' starts
        second = resolve_files("hf://datasets/org/web/*.parquet")
        assert [f.uri for f in first] == [f.uri for f in second] and SHA_A in first[0].uri
        assert len([p for _, p, _ in server.log if p.startswith("/api/datasets/org/web") and "/tree/" not in p]) == 1
        url = f"{server.url}/files/part-000.parquet"
        a = resolve_files([url])
        heads = len([m for m, _, _ in server.log if m == "HEAD"])
        b = resolve_files([url])
        assert len([m for m, _, _ in server.log if m == "HEAD"]) == heads, "the second rank asked again"
        assert a[0].size == b[0].size
        assert b[0].fs.handler.etags[url] == a[0].fs.handler.etags[url]
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "later"))
    with Server(folder, {"org/web": revisions}) as server:
        hub_env(server)
        assert SHA_B in resolve_files("hf://datasets/org/web/*.parquet")[0].uri, "a later start sees the push"


def test_a_kept_connection_serves_the_request_after_a_head_without_a_retry(files):
    folder, _ = files
    with Server(folder) as server:
        handler = HttpHandler(retry=RetryPolicy(attempts=1))  # any failed request would raise
        url = f"{server.url}/files/part-000.parquet"
        size = handler.info(url).size
        assert handler.read_range(url, 0, 4, size) == b"PAR1"
        assert handler.info(url).size == size and handler.read_range(url, 4, 4, size)
        assert [m for m, _, _ in server.log] == ["HEAD", "GET", "HEAD", "GET"]


@pytest.mark.parametrize("uri,revision,path", [
    ("hf://datasets/org/web@v1.0/data/*.parquet", "v1.0", "data/*.parquet"),
    ("hf://datasets/org/web@refs/convert/parquet/default/train/*.parquet", "refs/convert/parquet", "default/train/*.parquet"),
    ("hf://datasets/org/web@refs%2Fconvert%2Fparquet/default/train/0000.parquet", "refs/convert/parquet",
     "default/train/0000.parquet"),
    ("hf://datasets/org/web@~parquet/default/train/*.parquet", "refs/convert/parquet", "default/train/*.parquet"),
    ("hf://datasets/org/web@refs/pr/3/x.parquet", "refs/pr/3", "x.parquet"),
    ("hf://datasets/org/web/x.parquet", None, "x.parquet"),
])
def test_hf_uris_name_their_revision_as_huggingface_hub_writes_them(uri, revision, path):
    from tokenloom.pipes.sources.hf_store import HfPath
    got = HfPath.parse(uri)
    assert (got.repo_id, got.revision, got.path) == ("org/web", revision, path)


def test_the_hubs_parquet_conversion_is_read_at_its_commit(files, tok_path, hub_env):
    folder, _ = files
    with Server(folder, {"org/web": {"main": (SHA_B, folder), "refs/convert/parquet": (SHA_A, folder)}}) as server:
        hub_env(server)
        got = resolve_files("hf://datasets/org/web@~parquet/*.parquet")
        assert [f.uri for f in got][0] == f"hf://datasets/org/web@{SHA_A}/part-000.parquet"


def test_verify_checks_a_remote_source_on_other_topologies_too(files, tok_path, hub_env):
    """`tokenloom.verify` on a Hub source with faults injected: every resume, and a state saved on
    1 rank x 1 worker resumed on 2 ranks, delivers the epoch exactly."""
    from tokenloom.verify import verify
    folder, _ = files
    with Server(folder, {"org/data": {"main": (SHA_A, folder)}}, fault_every=5) as server:
        hub_env(server)

        def build(**topology):
            return pretrain("hf://datasets/org/data/*.parquet", tokenizer=tok_path, epochs=1,
                            retry=QUICK_RETRY, **{**ARGS, "num_workers": 1, **topology})
        report = verify(build, steps=10**9, points=1, chain=False, elastic=[((1, 1), (2, 0))])
        assert server.faults > 0
    assert report.ok and any(c.name.startswith("elastic") for c in report.checks), str(report)
