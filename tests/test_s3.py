"""S3 through pyarrow.fs, against moto's S3 server on loopback (started here, no network).

The server checks signatures: an IAM user with an S3 policy is created first, then
moto's authentication is switched on, so wrong credentials are refused the way a real
store refuses them. Credentials reach pyarrow the way they do on a user's machine,
through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; the endpoint goes in the URI
(``?endpoint_override=127.0.0.1:PORT&scheme=http``).

Checked: an S3 corpus gives bit for bit the batches of the same files on local disk
(one epoch, 2 loader workers, every document once), exact resume, and clear errors
for a missing bucket, refused credentials (not a hang), and a secret in the URI is
never echoed.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.parse
import urllib.request

import boto3  # comes with moto[server], in the dev extra
import moto.server as moto_server
import pyarrow.fs as pafs
import pytest

from tokenloom.pipes import load_encoder
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus
from .resume import check_loader_resume, items_equal
from .test_manifest import footer_reads, index  # noqa: F401  (footer_reads is a fixture)
from .test_torchrun import _doc_ids


BUCKET, PREFIX = "corpus-bucket", "web/2024"
ARGS = dict(seq_len=127, batch_size=4, buffer_size=24, seed=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server with authentication on, a bucket holding 3 parquet files, and the same
    files on local disk. Yields (endpoint host:port, access key, secret, local dir, texts)."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        # moto keeps its accounts, users and buckets per process: another module's server in this
        # test process (tests/test_cache.py uses this fixture too) left them behind
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", data=b"", method="POST"), timeout=10)
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="loader")
        policy = iam.create_policy(PolicyName="read-write-s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        iam.attach_user_policy(UserName="loader", PolicyArn=policy["Policy"]["Arn"])
        key = iam.create_access_key(UserName="loader")["AccessKey"]
        _set_auth(url, b"0")  # from now on every request must be signed by a known key

        # at most 40 words: no document is cut into chunks, so every segment names its document
        texts = [" ".join(t.split()[:40]) for t in synthetic_texts(360, seed=12)]
        local = tmp_path_factory.mktemp("s3_local")
        paths = write_corpus(str(local), texts, files=3, row_group_size=24)
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
        client.create_bucket(Bucket=BUCKET)
        for p in paths:
            with open(p, "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{os.path.basename(p)}", Body=f.read())
        yield f"127.0.0.1:{port}", key["AccessKeyId"], key["SecretAccessKey"], str(local), texts
    finally:
        try:
            _set_auth(url, b"inf")
        finally:
            server.stop()


def _set_auth(url: str, count: bytes) -> None:
    """moto's switch: authenticate every request after the first ``count`` ones."""
    req = urllib.request.Request(f"{url}/moto-api/reset-auth", data=count, method="POST",
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


@pytest.fixture
def creds(s3, monkeypatch, tmp_path):
    """The user's environment: these credentials, no profile or config file, no EC2 metadata lookups."""
    _, access, secret, _, _ = s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _uri(s3, path=f"{BUCKET}/{PREFIX}/*.parquet", userinfo=""):
    endpoint = s3[0]
    return f"s3://{userinfo}{path}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


def test_s3_epoch_equals_local_files_and_covers_every_document(s3, creds, tok_path):
    _, _, _, local, texts = s3
    remote = list(pretrain(_uri(s3), tokenizer=tok_path, epochs=1, num_workers=2, **ARGS))
    on_disk = list(pretrain(os.path.join(local, "*.parquet"), tokenizer=tok_path, epochs=1, num_workers=2, **ARGS))
    assert len(remote) == len(on_disk) > 10
    for j, (a, b) in enumerate(zip(on_disk, remote)):
        assert items_equal(a, b), f"batch {j} read from S3 differs from the same files read from disk"
    # the two workers' shards are disjoint and together cover the corpus
    ids = _doc_ids(remote, load_encoder(tok_path))
    assert len(ids) == len(set(ids)), "a document was read twice"
    assert set(ids) == {t.split()[0] for t in texts}, "documents missing"


def test_s3_exact_resume_with_two_workers(s3, creds, tok_path):
    build = lambda: pretrain(_uri(s3), tokenizer=tok_path, num_workers=2, **ARGS)
    check_loader_resume(build, steps=[3, 8], total=14)


def test_s3_state_matches_local_state_fingerprint(s3, creds, tok_path):
    """The same files in a bucket and on disk have the same fingerprint (relative names and
    sizes), so a state saved on one resumes on the other."""
    _, _, _, local, _ = s3
    disk = pretrain(os.path.join(local, "*.parquet"), tokenizer=tok_path, **ARGS)
    it = iter(disk)
    next(it), next(it)
    state = disk.state_dict()
    want = [next(it) for _ in range(3)]
    remote = pretrain(_uri(s3), tokenizer=tok_path, **ARGS)
    remote.load_state_dict(state)
    rit = iter(remote)
    for j, w in enumerate(want):
        assert items_equal(w, next(rit)), f"batch {2 + j} after moving the corpus to S3 differs"


@pytest.mark.parametrize("path", ["no-such-bucket/web/*.parquet", "no-such-bucket/web/part-000.parquet"])
def test_missing_bucket_names_the_bucket_and_the_uri(s3, creds, tok_path, path):
    uri = _uri(s3, path)
    with pytest.raises(FileNotFoundError) as e:
        pretrain(uri, tokenizer=tok_path, **ARGS)
    msg = str(e.value)
    assert "bucket 'no-such-bucket' does not exist" in msg, msg
    assert uri in msg, msg


def test_missing_prefix_in_an_existing_bucket_is_an_empty_glob(s3, creds, tok_path):
    uri = _uri(s3, f"{BUCKET}/no/such/prefix/*.parquet")
    with pytest.raises(FileNotFoundError, match="matched no parquet files") as e:
        pretrain(uri, tokenizer=tok_path, **ARGS)
    assert uri in str(e.value) and "does not exist" not in str(e.value)


def _raises_without_hanging(fn, timeout=60):
    """Run fn in a thread; fail if it is still running after ``timeout`` s, else return its exception."""
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still waiting after {timeout}s: bad credentials must fail, not hang"
    assert "error" in box, "bad credentials were accepted"
    return box["error"]


@pytest.mark.parametrize("var,value", [("AWS_SECRET_ACCESS_KEY", "not-the-secret"),
                                       ("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")])
def test_bad_credentials_are_a_clear_error(s3, creds, tok_path, var, value):
    creds.setenv(var, value)
    uri = _uri(s3)
    err = _raises_without_hanging(lambda: pretrain(uri, tokenizer=tok_path, **ARGS))
    assert isinstance(err, PermissionError), f"{type(err).__name__}: {err}"
    msg = str(err)
    assert uri in msg and "refused the credentials" in msg and "AWS_SECRET_ACCESS_KEY" in msg, msg


def test_secret_in_the_uri_is_never_echoed(s3, creds, tok_path):
    creds.delenv("AWS_ACCESS_KEY_ID")
    creds.delenv("AWS_SECRET_ACCESS_KEY")
    _, access, _, _, _ = s3
    secret = "wr0ng-Secret-Value"
    uri = _uri(s3, userinfo=f"{access}:{urllib.parse.quote(secret, safe='')}@")
    err = _raises_without_hanging(lambda: pretrain(uri, tokenizer=tok_path, **ARGS))
    assert isinstance(err, PermissionError), f"{type(err).__name__}: {err}"
    assert secret not in str(err) and "***" in str(err), str(err)
    # an unparsable URI (a '/' in the secret) is echoed by pyarrow itself: masked too
    bad = _uri(s3, userinfo=f"{access}:a/{secret}@")
    with pytest.raises(FileNotFoundError) as e:
        pretrain(bad, tokenizer=tok_path, **ARGS)
    assert secret not in str(e.value) and e.value.__cause__ is None, str(e.value)


def test_index_next_to_the_objects_replaces_the_footer_reads(s3, creds, tok_path, footer_reads):
    """`tokenloom index` on an S3 glob writes the index into the bucket; a loader then reads no
    footer and yields the same batches."""
    uri = _uri(s3)
    reference = next(iter(pretrain(uri, tokenizer=tok_path, **ARGS)))
    assert index(uri) == 0
    fs, path = pafs.FileSystem.from_uri(_uri(s3, f"{BUCKET}/{PREFIX}/_tokenloom_index.json"))
    try:
        footer_reads[0] = 0
        with_index = pretrain(uri, tokenizer=tok_path, **ARGS)
        assert footer_reads[0] == 0
        assert items_equal(reference, next(iter(with_index)))
    finally:
        fs.delete_file(path)  # the other tests list the footers
