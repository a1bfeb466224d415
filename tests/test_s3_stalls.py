"""What made S3 sources stall (issue 42): building an S3 filesystem asked the EC2 metadata service for a
region (and credentials) that the URI did not need, a wait of seconds per filesystem off EC2; a loader
forked its workers while first fetches were still in flight, after which they could wait for ever; and a
stopped test proxy kept accepting connections it never answered, holding every new S3 client of the
process until its request timed out (docs/reliability.md).

The metadata service is never reached: the SDK is pointed at a listener on loopback
(``AWS_EC2_METADATA_SERVICE_ENDPOINT``) that accepts connections, counts them and never answers, as an
unreachable service behaves.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from tokenloom.pipes.sources import first_fetches
from tokenloom.pipes.sources.from_uri import filesystem_settings, is_aws_endpoint, sdk_environment, sdk_settings
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .test_readahead import _load_remote_benchmark
from .test_s3 import BUCKET, _uri, s3  # noqa: F401 (fixture)

_LIST_AND_FORK = r"""
import os, sys
from tokenloom.pipes.sources.files import resolve_files
files = resolve_files(sys.argv[1])
assert len(files) == 3, files
pid = os.fork()
if pid == 0:  # a loader worker: opens the file through its own copy of the filesystem (process_fs)
    with files[0].open() as f:
        os._exit(0 if len(f.read_at(4, 0)) == 4 else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.fixture
def silent_metadata_service():
    """A listener on loopback that accepts connections and never answers. Yields (its URL, the list of
    connections it accepted)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        server.close()
        for conn in accepted:
            conn.close()


def test_listing_and_a_workers_copy_ask_no_metadata_service(s3, silent_metadata_service, tmp_path):
    """A user of an S3-compatible store with credentials in the environment and nothing else set (no
    region variable, no AWS_EC2_METADATA_DISABLED): listing and a forked worker's copy of the
    filesystem make no connection to the metadata service (pyarrow's from_uri and the copy made several)."""
    url, accepted = silent_metadata_service
    endpoint, access, secret, _, _ = s3
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret, AWS_EC2_METADATA_SERVICE_ENDPOINT=url,
               AWS_CONFIG_FILE=str(tmp_path / "no-config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-creds"))
    done = subprocess.run([sys.executable, "-c", _LIST_AND_FORK, _uri(s3)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(accepted) == 0, f"{len(accepted)} connections to the metadata service"


@pytest.mark.parametrize("region,endpoint,environ,want", [
    ("us-east-1", "127.0.0.1:9000", {}, {"AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}),
    (None, "http://minio.local:9000", {}, {"AWS_EC2_METADATA_DISABLED": "true"}),
    (None, None, {"AWS_ENDPOINT_URL_S3": "https://x.r2.cloudflarestorage.com"}, {"AWS_EC2_METADATA_DISABLED": "true"}),
    ("eu-west-1", None, {}, {"AWS_REGION": "eu-west-1"}),  # AWS: the instance's role may be the credentials
    ("eu-west-1", "s3.eu-west-1.amazonaws.com", {}, {"AWS_REGION": "eu-west-1"}),
    ("eu-west-1", "127.0.0.1:9000", {"AWS_DEFAULT_REGION": "us-west-2", "AWS_EC2_METADATA_DISABLED": "false"}, {}),
    ("eu-west-1", "127.0.0.1:9000", {"AWS_REGION": "us-west-2"}, {"AWS_EC2_METADATA_DISABLED": "true"}),
    (None, None, {}, {}),
])
def test_what_the_sdk_is_told_while_a_filesystem_is_built(region, endpoint, environ, want):
    assert sdk_settings(region, endpoint, environ) == want


def test_aws_endpoints_are_told_apart():
    assert is_aws_endpoint("s3.eu-west-1.amazonaws.com") and is_aws_endpoint("https://s3.cn-north-1.amazonaws.com.cn")
    assert is_aws_endpoint("bucket.vpce-1a2b.s3.us-east-1.vpce.amazonaws.com:443")
    assert not is_aws_endpoint("127.0.0.1:9000") and not is_aws_endpoint("amazonaws.com.evil.example")


def test_the_environment_is_put_back_after_a_build(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "keep-me")
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    with sdk_environment({"AWS_REGION": "other", "AWS_EC2_METADATA_DISABLED": "true"}):
        assert os.environ["AWS_REGION"] == "other" and os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
    assert os.environ["AWS_REGION"] == "keep-me" and "AWS_EC2_METADATA_DISABLED" not in os.environ
    with pytest.raises(RuntimeError):
        with sdk_environment({"AWS_EC2_METADATA_DISABLED": "true"}):
            raise RuntimeError
    assert "AWS_EC2_METADATA_DISABLED" not in os.environ


def test_a_copy_is_told_the_region_of_its_original(monkeypatch):
    import pyarrow.fs as pafs

    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # building the original here waits on nothing
    fs = pafs.S3FileSystem(region="ap-south-1", endpoint_override="127.0.0.1:9", scheme="http")
    assert filesystem_settings(fs, {}) == {"AWS_REGION": "ap-south-1", "AWS_EC2_METADATA_DISABLED": "true"}
    assert filesystem_settings(pafs.LocalFileSystem(), {}) == {}


def test_a_stopped_proxy_refuses_connections():
    """A request to a proxy that was stopped is refused at once (it was accepted by the kernel and never
    answered: the S3 client waited out its timeouts, and every new client of the process behind it)."""
    bench = _load_remote_benchmark()
    port = bench._free_port()
    proxy = bench.slow_proxy(port, bench._free_port(), 0.0, 50e6)
    proxy.shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_first_fetches_that_do_not_end_stop_the_workers_start_with_a_clear_error(tok_path, tmp_path, monkeypatch):
    """The loader forks its workers only once the first fetches have no request in flight; after
    ``FIRST_WAIT`` it raises naming the files instead (it forked, and the workers could wait for ever)."""
    monkeypatch.setattr(first_fetches, "FIRST_WAIT", 0.5)
    release = threading.Event()

    class Hanging:
        def read_at(self, n, off):
            release.wait(60)
            return b"\0" * n

        def close(self):
            pass

    stuck = first_fetches.FirstFetches([((0, 0), Hanging(), 100, [(0, 10)])], names={0: "s3://bucket/a.parquet"})
    paths = write_corpus(str(tmp_path), synthetic_texts(60, seed=3), files=2, row_group_size=10)
    loader = pretrain(paths, tokenizer=tok_path, num_workers=1, seq_len=63, batch_size=2, buffer_size=8, seed=1)
    try:
        with pytest.raises(TimeoutError, match=r"'s3://bucket/a\.parquet'.*TOKENLOOM_READAHEAD=0"):
            next(iter(loader))
    finally:
        release.set()
        assert stuck.wait(30)
    assert next(iter(loader))["input_ids"].shape == (2, 63), "once the fetches end, the workers start"


def test_a_child_forked_during_a_build_can_build_and_has_the_environment_as_it_was(monkeypatch):
    """A fork while another thread builds a filesystem: the child does not inherit the build's held lock
    (its own builds would wait for ever) nor the variables set for the build."""
    import signal

    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    inside, leave = threading.Event(), threading.Event()

    def build():
        with sdk_environment({"AWS_EC2_METADATA_DISABLED": "true"}):
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=build)
    t.start()
    try:
        assert inside.wait(30)
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # a held lock: killed instead of waiting for ever
                signal.alarm(20)
                ok = "AWS_EC2_METADATA_DISABLED" not in os.environ
                with sdk_environment({"AWS_EC2_METADATA_DISABLED": "true"}):
                    pass
                code = 0 if ok else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        leave.set()
        t.join()
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with {os.waitstatus_to_exitcode(status)}"
