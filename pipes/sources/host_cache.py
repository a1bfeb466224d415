"""What the processes of one host share of remote listings that cannot change: a Hugging Face Hub
tree at a commit sha, and a parquet footer by its file's content id (the Hub's LFS sha256).

Why: every rank lists its sources and reads their footers when it builds its loader (its workers
get the footers from it), so a job of 8 ranks on a host asks the store 8 times for the same
listing and footers, at the same moment, which is how a job meets the Hub's rate limit before its
first batch. What is keyed here is immutable (a commit's tree, a file's bytes by their hash), so the
first process of a host to need an entry fetches it and writes it, and the others wait for it (a
lock file, ``fcntl.flock``) and read it: one request per entry and host, whatever the ranks. What
can change is kept only for `SHARED_FOR_S` seconds, for the ranks of a job that start together: what
a branch points to (an unpinned ``hf://`` source: its ranks then pin the same commit) and a URL's
size and ``ETag`` (its ranks read the same version, or fail naming the change). S3, GCS and Azure
listings are never kept.

Where: ``$TOKENLOOM_CACHE/remote/`` (pipes/cache_dir.py; ``TOKENLOOM_CACHE=0``
switches it off). A directory that cannot be written, an unreadable entry or a failed lock costs
the request, nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from typing import Callable, Iterator, Optional

from ..cache_dir import cache_root

log = logging.getLogger(__name__)

#: Bump when an entry's layout changes: old entries are then not found.
FORMAT = 1
#: Seconds the processes of a host take the same answer to what can change (module docstring).
SHARED_FOR_S = 60.0


def _path(kind: str, key: str) -> Optional[str]:
    root = cache_root()
    if root is None:
        return None
    digest = hashlib.sha256(f"{FORMAT}\0{kind}\0{key}".encode("utf-8", "surrogateescape")).hexdigest()[:40]
    return os.path.join(root, "remote", kind, digest)


def _read(path: str, max_age_s: Optional[float] = None) -> Optional[bytes]:
    try:
        if max_age_s is not None and time.time() - os.path.getmtime(path) > max_age_s:
            return None
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold ``path + '.lock'`` (blocking); nothing when locks are not available here."""
    try:
        import fcntl
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write(path: str, data: bytes) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("cannot keep %s in the host cache: %s", path, e)


def shared(kind: str, key: str, fetch: Callable[[], bytes], max_age_s: Optional[float] = None) -> bytes:
    """The bytes of entry ``key`` of ``kind``: from this host's cache, else ``fetch()``ed once for the
    host (the other processes wait for it, then read it; module docstring). ``max_age_s``: for an
    answer that can change (what a branch points to, a URL's size and ETag), how long the host's
    processes take the same one, so the ranks of a job that start together read the same data."""
    path = _path(kind, key)
    if path is None:
        return fetch()
    data = _read(path, max_age_s)
    if data is not None:
        return data
    with _locked(path):
        data = _read(path, max_age_s)
        if data is None:
            data = fetch()
            _write(path, data)
    return data
