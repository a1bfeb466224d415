"""Turn what a user wrote (path, glob, directory, URI, or a list of them) into files.

Every spec goes through `pyarrow.fs`, so ``/data/x.parquet``, ``data/*.parquet``,
``data/`` (searched recursively), ``s3://bucket/prefix/*.parquet`` and
``gs://...`` are handled by one code path. Globs read as in the shell: ``*``, ``?`` and
``[...]`` match within one directory, ``**/`` any number of them (``data/**/*.parquet``).
A spec that matches nothing is an error naming the spec, never an empty epoch that spins forever.

Files are returned sorted by path so every rank and worker lists the same files
in the same order; the order is what the shard assignment is computed from.

Each file carries what the resume fingerprint (fingerprint.py) needs: its path
relative to the spec it matched (so a corpus moved to another mount still
matches), its size, its modification time from the listing, and, once listing
has read it, a content key (parquet: a hash of the footer).

Remote errors are sorted into what the user must fix: a bucket that does not
exist (`FileNotFoundError` naming the bucket; an empty listing is told apart
from a missing bucket by one extra lookup of the bucket, only when nothing
matched), credentials the store refuses (`PermissionError`), an endpoint that
cannot be reached (`ConnectionError`). A password in the URI
(``s3://KEY:SECRET@bucket/...``) is masked in every message.

A remote filesystem is not used across a fork: its client keeps HTTP connections
open, and loader workers forked from the process that listed the files would share
those sockets, so two workers' requests on one connection read each other's
responses (seen as "Parquet magic bytes not found" or a thrift error on a good
file, with several workers behind a store's latency). A forked process opens files through
its own copy of the filesystem (`process_fs`: unpickled once per process, the same
options, new connections). Sources on the same store with the same options share one
copy: pyarrow makes a new S3 client wait until the requests of the process's other
clients in flight have ended, so a second source's first request would wait about one
round trip behind the first source's. The same wait would hold back a loader's build, which
lists its remote sources at once: within `shared_filesystems` (the recipes' listing) URIs of
one bucket with the same options resolve to one filesystem, made before any request is in flight.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pyarrow.fs as pafs

from .from_uri import copy_filesystem, filesystem_from_uri
from .host_cache import SHARED_FOR_S, shared
from .http_store import http_filesystem, ranged_opener
from .retry import RetryPolicy


def sft_advice(column: str) -> str:
    """How to train on ``column`` when it holds conversations (lists of messages) where a text
    recipe wanted text: the sft recipe, told the column unless it is sft's default. Worded for
    Python; the command line says ``--recipe sft`` (tokenloom/cli_hints.py)."""
    return "the sft recipe, sft(...)" + ("" if column == "messages" else f" with messages_field={column!r}")


#: Compressed endings of JSON sources, and pyarrow's codec for each (compressed.py).
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2"}
_JSON = (".jsonl", ".json", ".ndjson")

#: File endings a directory spec picks up, per format (jsonl: JSON lines or arrays, plain or compressed).
FORMAT_SUFFIXES = {
    "parquet": (".parquet", ".pq"),
    "jsonl": _JSON + tuple(e + c for e in _JSON for c in COMPRESSIONS),
    "txt": (".txt", ".md", ".text"),
}

SourceSpec = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

#: The index `tokenloom index` writes next to the data (see manifest.py); never a data file,
#: even when a glob such as ``*.json`` matches it.
MANIFEST_NAME = "_tokenloom_index.json"


#: Per-process copies of remote filesystems, by id of the original (kept alive here), made in forked processes.
_PROCESS_FS: Dict[int, Tuple[pafs.FileSystem, pafs.FileSystem]] = {}
_PROCESS_FS_LOCK = threading.Lock()  # read-ahead threads open files at once: one copy each
#: The process that imported this module, which lists the sources: another one is forked from it (or
#: from a process forked from it) and must not share its filesystems' connections. Told by the pid, not
#: a fork hook, so that importing tokenloom registers nothing.
_LISTING_PID = os.getpid()
_COPIES_PID = [_LISTING_PID]  # the process _PROCESS_FS and its lock belong to


def _own_copies() -> None:
    """In a process forked since the copies were made: a fresh table and lock (a lock held by another
    thread at the fork would stay held here for ever)."""
    global _PROCESS_FS_LOCK
    if _COPIES_PID[0] != os.getpid():
        _PROCESS_FS.clear()
        _PROCESS_FS_LOCK = threading.Lock()
        _COPIES_PID[0] = os.getpid()


def process_fs(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs``, or in a forked process (a loader worker) this process's own copy of it: a remote
    filesystem's pooled connections must not be shared with the parent or siblings (module docstring).
    Local filesystems hold no connections and are returned as they are."""
    if os.getpid() == _LISTING_PID or fs.type_name == "local":
        return fs
    _own_copies()
    with _PROCESS_FS_LOCK:
        hit = _PROCESS_FS.get(id(fs))
        if hit is None or hit[0] is not fs:
            copy = next((c for o, c in _PROCESS_FS.values() if _same(o, fs)), None)
            if copy is None:
                try:
                    copy = copy_filesystem(fs)
                except Exception:  # a filesystem that does not pickle (a Python handler) is used as it is
                    copy = fs
            hit = _PROCESS_FS[id(fs)] = (fs, copy)
        return hit[1]


def _same(a: pafs.FileSystem, b: pafs.FileSystem) -> bool:
    try:
        return bool(a.equals(b))
    except Exception:
        return False


@dataclass(frozen=True)
class SourceFile:
    """One resolved file: the filesystem it lives on, its path there, its size, and the
    name it is known by in fingerprints (relative to the spec that matched it).

    The filesystem object travels with the file because it carries options that a
    bare path loses (an S3 endpoint override, credentials); pyarrow filesystems pickle.
    ``key`` is set by listing where the format has something that changes with the
    content (a parquet footer's hash); ``mtime_ns`` is the listing's, when the store has one.
    """

    path: str
    size: int
    name: str
    fs: pafs.FileSystem = field(compare=False, repr=False)
    uri: str = ""
    key: str = ""
    mtime_ns: Optional[int] = field(default=None, compare=False)
    #: Whether the listing that found this file saw an index (`MANIFEST_NAME`) in the directory its spec
    #: resolved under (a glob's or a directory's listing covers it; None: not known, e.g. a file spec),
    #: so a remote source is not asked twice (manifest.py).
    index_listed: Optional[bool] = field(default=None, compare=False, repr=False)
    #: An id of the file's bytes that changes with them (the Hub's LFS sha256 or git blob id; "": none
    #: known): what the host cache keys its footer by (host_cache.py).
    content: str = field(default="", compare=False, repr=False)

    def open(self):
        """A seekable input file (through this process's own filesystem, see `process_fs`): pyarrow's,
        or for HTTP and the Hub one whose ``read_at`` several threads may call at once (http_store.py)."""
        fs = process_fs(self.fs)
        ranged = ranged_opener(fs)
        return ranged(self.path, self.size) if ranged is not None else fs.open_input_file(self.path)

    def open_unchanged(self):
        """`open`, refusing a file whose size is not the listed one: a rewritten file's row groups
        or line offsets are not the listed units, and reading on would mix them up."""
        handle = self.open()
        size = handle.size()
        if size != self.size:
            handle.close()
            raise FileChangedError(f"{self.uri or self.path} is {size} bytes now, it was listed with {self.size}; "
                                   "the file changed after the loader was built: rebuild the loader")
        return handle


class FileChangedError(RuntimeError):
    """A file is not the one that was listed (its size changed)."""


class OpenFiles:
    """What one reader keeps open per file index (a handle, a parquet file, a mapped table, a
    stream): at most ``limit``, the least recently used dropped first and closed if it can be."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open: "OrderedDict[int, Any]" = OrderedDict()

    def get(self, i: int, opener: Callable[[int], Any]) -> Any:
        """File ``i``'s open thing, ``opener(i)`` when it has none."""
        value = self._open.get(i)
        if value is None:
            value = self._open[i] = opener(i)
            if len(self._open) > self.limit:
                self.drop(next(iter(self._open)))
        else:
            self._open.move_to_end(i)
        return value

    def drop(self, i: int) -> None:
        """Forget (and close) file ``i``'s open thing, if any."""
        value = self._open.pop(i, None)
        if hasattr(value, "close"):
            value.close()

    def close(self) -> None:
        for i in list(self._open):
            self.drop(i)


class FileUnits:
    """What every format's table of work units shares (parquet `UnitTable`, text and jsonl
    `LineUnitTable`, Hugging Face `ArrowUnits`): unit ``i`` lies in ``files[file[i]]`` and
    holds ``rows[i]`` rows. The subclasses are dataclasses that declare those fields."""

    @property
    def total_rows(self) -> int:
        return int(self.rows.sum())

    def path(self, unit: int) -> str:
        """The URI (else the path) of the file unit ``unit`` lies in, as messages name it."""
        f = self.files[int(self.file[unit])]
        return f.uri or f.path


#: pyarrow/AWS error codes that mean "these credentials are refused".
_DENIED = ("ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID", "EXPIRED_TOKEN",
           "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden", "Unauthorized",
           "PERMISSION_DENIED", "UNAUTHENTICATED", "AuthenticationException", "AuthorizationFailure")
_CREDENTIAL_HINTS = {
    "gs": "Google credentials: GOOGLE_APPLICATION_CREDENTIALS (a service account key file) or "
          "`gcloud auth application-default login` (without either, gs:// is read anonymously: public buckets only)",
    "az": "Azure credentials: AZURE_STORAGE_ACCOUNT_KEY, or `az login` / a managed identity for Azure's default "
          "credentials, and that they may read the container",
    "s3": "the credentials for this endpoint (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the key "
          "and secret in the URI) and that they may read the bucket",
}

def _credential_hint(spec: str) -> str:
    scheme = spec.split("://", 1)[0].lower() if "://" in spec else ""
    key = {"gcs": "gs", "abfs": "az", "abfss": "az"}.get(scheme, scheme)
    return "check " + _CREDENTIAL_HINTS.get(key, _CREDENTIAL_HINTS["s3"])


def _redact(text: str, spec: str) -> str:
    """``text`` with the password of ``spec``'s ``user:password@`` part masked."""
    if "://" not in spec:
        return text
    # Up to the first '@', not the first '/': a secret may hold a '/' (then the URI does not parse,
    # and pyarrow's message repeats it).
    head = spec.split("://", 1)[1].split("?", 1)[0]
    userinfo = head.split("@", 1)[0] if "@" in head else ""
    if ":" not in userinfo:
        return text
    secret = userinfo.split(":", 1)[1]
    return text.replace(secret, "***") if secret else text


def _bucket(path: str) -> str:
    return path.split("/", 1)[0]


def _remote_error(spec: str, path: str, e: OSError) -> OSError:
    """The error to raise for a failed remote lookup of ``spec``, by what the user must fix."""
    msg = _redact(str(e), spec)
    shown = _redact(repr(spec), spec)
    if any(code in msg for code in _DENIED):
        return PermissionError(f"cannot read source {shown}: the store refused the credentials ({msg}); "
                               f"{_credential_hint(spec)}")
    if "NO_SUCH_BUCKET" in msg or "NoSuchBucket" in msg:
        return FileNotFoundError(f"source {shown}: bucket {_bucket(path)!r} does not exist ({msg})")
    if "NETWORK_CONNECTION" in msg or "Could not connect" in msg or "Couldn't resolve host" in msg \
            or "Could not resolve host" in msg:
        return ConnectionError(f"cannot reach the storage endpoint of source {shown}: {msg}; check the "
                               "endpoint (endpoint_override=, scheme=) and the network")
    return FileNotFoundError(f"cannot list source {shown}: {msg}")


def _missing_bucket(fs: pafs.FileSystem, spec: str, path: str) -> None:
    """For a remote spec that matched nothing: raise if its bucket does not exist."""
    bucket = _bucket(path)
    try:
        info = fs.get_file_info(bucket)
    except OSError as e:
        raise _remote_error(spec, path, e) from e
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"source {_redact(repr(spec), spec)}: bucket {bucket!r} does not exist; "
                                "check the bucket name, the endpoint and the region")


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


@functools.lru_cache(maxsize=64)
def glob_pattern(path: str) -> "re.Pattern[str]":
    """A glob as the shell reads it: ``*``, ``?`` and ``[...]`` stay within one path segment,
    ``**`` (a segment of its own) spans any number of directories. (``fnmatch`` lets ``*`` cross
    ``/``, so ``data/*.parquet`` also took ``data/sub/x.parquet``.)"""
    out, i, n = [], 0, len(path)
    while i < n:
        c = path[i]
        if path.startswith("**/", i) and (i == 0 or path[i - 1] == "/"):
            out.append("(?:[^/]*/)*")
            i += 3
        elif path.startswith("**", i) and (i == 0 or path[i - 1] == "/") and i + 2 == n:
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            start = i + 1 + (path[i + 1:i + 2] in ("!", "^"))
            j = path.find("]", start + (path[start:start + 1] == "]"))  # "[]x]": a leading ] is in the set
            if j < 0:
                out.append(re.escape(c))
                i += 1
                continue
            body = path[i + 1:j]
            out.append("[" + ("^" + body[1:] if body[:1] in ("!", "^") else body).replace("\\", "\\\\") + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z", re.S)


#: While `shared_filesystems` is active: {URI: (filesystem, path)} and {URI without its path: filesystem}.
_SHARED: List[Tuple[Dict[str, Tuple[pafs.FileSystem, str]], Dict[str, pafs.FileSystem]]] = []
_SHARED_LOCK = threading.Lock()


@contextlib.contextmanager
def shared_filesystems(specs: Sequence[Any] = ()) -> Iterator[None]:
    """Within: the URIs of ``specs`` (URIs, or lists of them) that differ only in their path (same
    scheme, user, bucket and query) resolve to one filesystem object, made here in turn, in whatever
    thread they are listed. pyarrow makes a new S3 client wait until the requests of the process's
    other clients in flight have ended (see the module docstring): sources listed at once, each making
    its own client, would go one after the other (the second source's ``FileSystem.from_uri`` waits out
    the first one's listing, about a round trip). Only for the while: a filesystem keeps the
    credentials of when it was made."""
    by_uri: Dict[str, Tuple[pafs.FileSystem, str]] = {}
    by_key: Dict[str, pafs.FileSystem] = {}
    for spec in specs:
        for one in [spec] if isinstance(spec, (str, os.PathLike)) else spec if isinstance(spec, (list, tuple)) else ():
            uri = os.fspath(one) if isinstance(one, (str, os.PathLike)) else ""
            if "://" not in uri:
                continue
            try:
                fs, path = filesystem_from_uri(uri)
            except Exception:  # noqa: BLE001 - a bad URI is reported when its source is listed
                continue
            fs = by_key.setdefault(_share_key(uri), fs)
            by_uri[uri] = (fs, path)
    with _SHARED_LOCK:
        _SHARED.append((by_uri, by_key))
    try:
        yield
    finally:
        with _SHARED_LOCK:
            _SHARED.remove((by_uri, by_key))


def _share_key(uri: str) -> str:
    """A URI without its path: what its filesystem is made of (pyarrow resolves an S3 bucket's region)."""
    scheme, rest = uri.split("://", 1)
    rest, _, query = rest.partition("?")
    return f"{scheme}://{rest.split('/', 1)[0]}?{query}"


def _split_uri(spec: str) -> Tuple[pafs.FileSystem, str, str]:
    """Return (filesystem, path inside it, scheme prefix for display)."""
    if "://" in spec:
        with _SHARED_LOCK:
            hit = next((by_uri[spec] for by_uri, _ in reversed(_SHARED) if spec in by_uri), None)
        fs, path = hit if hit is not None else filesystem_from_uri(spec)
        return fs, path, spec.split("://", 1)[0] + "://"
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(spec)), ""


def _glob_root(path: str) -> str:
    root = []
    for part in path.split("/"):
        if _is_glob(part):
            break
        root.append(part)
    return "/".join(root) or "/"


def resolve_files(spec: SourceSpec, fmt: str = "parquet", retry: Optional[RetryPolicy] = None) -> List[SourceFile]:
    """Resolve one spec or a list of specs into a sorted, de-duplicated list of files; ``retry``: how
    requests to ``https://`` and ``hf://`` files are retried (retry.py; None: its defaults).

    Raises `FileNotFoundError` naming the spec when it matches no file.
    """
    if fmt not in FORMAT_SUFFIXES:
        raise ValueError(f"{fmt=} is not a known format; use one of {sorted(FORMAT_SUFFIXES)}")
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise ValueError("no source given: pass a path, glob, directory or URI (or a list of them)")
    out: dict = {}
    urls = [os.fspath(one) for one in specs if os.fspath(one).startswith(("http://", "https://"))]
    looked: Dict[str, List[SourceFile]] = {}
    if len(urls) > 1:  # one size lookup (a round trip) per URL: at once, not one after the other
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(min(len(urls), HTTP_LOOKUPS)) as pool:
            looked = dict(zip(urls, pool.map(lambda u: _resolve_http(u, retry), urls)))
    for one in specs:
        spec = os.fspath(one)
        for f in looked[spec] if spec in looked else _resolve_one(spec, fmt, retry):
            out.setdefault(f.uri, f)
    return [out[k] for k in sorted(out)]


#: Size lookups of a list of URLs made at once.
HTTP_LOOKUPS = 16


def _resolve_http(spec: str, retry: Optional[RetryPolicy] = None) -> List[SourceFile]:
    """One file by its URL (HTTP has no listing: http_store.py)."""
    if spec.split("?", 1)[0].endswith("/"):
        raise FileNotFoundError(f"source {spec!r}: a folder over plain HTTP cannot be listed; name each file by "
                                "its URL (a list of URLs is a source)")
    fs = http_filesystem(retry=retry)

    def head() -> bytes:
        info = fs.get_file_info(spec)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"source {spec!r} does not exist (the server answered 404)")
        return json.dumps([int(info.size), info.mtime_ns, fs.handler.etags.get(spec)]).encode()

    # the ranks of a job on one host that start together read the same version (host_cache.py)
    size, mtime_ns, etag = json.loads(shared("http-head", spec, head, max_age_s=SHARED_FOR_S))
    if etag:
        fs.handler.etags[spec] = etag
    name = spec.split("?", 1)[0].rstrip("/").rpartition("/")[2]
    return [SourceFile(path=spec, size=int(size), name=name, fs=fs, uri=spec, mtime_ns=mtime_ns)]


def _resolve_hf(spec: str, fmt: str, retry: Optional[RetryPolicy] = None) -> List[SourceFile]:
    """The files of an ``hf://`` URI, pinned to one revision (hf_store.py)."""
    from .hf_store import list_hf
    fs, base, files, index = list_hf(spec, FORMAT_SUFFIXES[fmt],
                                     lambda pattern, path: bool(glob_pattern(pattern).match(path)),
                                     retry=retry, index_name=MANIFEST_NAME)
    return [SourceFile(path=f.url, size=f.size, name=os.path.relpath(f.path, base) if base else f.path, fs=fs,
                       uri=f.uri, index_listed=index, content=f.content) for f in files]


def _resolve_one(spec: str, fmt: str, retry: Optional[RetryPolicy] = None) -> List[SourceFile]:
    if spec.startswith(("http://", "https://")):
        return _resolve_http(spec, retry)
    if spec.startswith("hf://"):
        return _resolve_hf(spec, fmt, retry)
    try:
        fs, path, prefix = _split_uri(spec)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for bad URIs
        raise FileNotFoundError(f"cannot open source {_redact(repr(spec), spec)}: {_redact(str(e), spec)}") from None
    remote = fs.type_name != "local"  # s3, gcs, hdfs ...: paths start with a bucket
    listed = None  # everything under base, when base was listed recursively
    try:
        if _is_glob(path):
            base = _glob_root(path)
            infos = listed = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
            files = [i for i in infos if i.type == pafs.FileType.File and glob_pattern(path).match(i.path)
                     and os.path.basename(i.path) != MANIFEST_NAME]
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.File:
                files, base = [info], os.path.dirname(path)
            elif info.type == pafs.FileType.Directory:
                base = path
                infos = listed = fs.get_file_info(pafs.FileSelector(path, recursive=True))
                files = [
                    i for i in infos
                    if i.type == pafs.FileType.File
                    and i.path.endswith(FORMAT_SUFFIXES[fmt])
                    and not os.path.basename(i.path).startswith((".", "_"))
                ]
            else:
                if remote:
                    _missing_bucket(fs, spec, path)
                raise FileNotFoundError(f"source {_redact(repr(spec), spec)} does not exist (looked for {path!r})")
    except FileNotFoundError:
        raise
    except OSError as e:
        if not remote:
            raise FileNotFoundError(f"cannot list source {spec!r}: {e}") from e
        raise _remote_error(spec, path, e) from e
    if not files:
        if remote:
            _missing_bucket(fs, spec, path)
        what = "glob" if _is_glob(path) else "directory"
        raise FileNotFoundError(
            f"source {_redact(repr(spec), spec)} matched no {fmt} files ({what} {path!r}); "
            f"check the path, or the file endings {FORMAT_SUFFIXES[fmt]}"
        )
    base = base.rstrip("/")
    index_listed = None if listed is None else any(i.path == f"{base}/{MANIFEST_NAME}" for i in listed)
    return [
        SourceFile(
            path=i.path,
            size=int(i.size),
            name=os.path.relpath(i.path, base) if base else i.path,
            fs=fs,
            uri=prefix + i.path,
            mtime_ns=i.mtime_ns,
            index_listed=index_listed,
        )
        for i in files
    ]


def fingerprint_files(files: Sequence[SourceFile]) -> str:
    """A short hash of (relative name, size, content key) of every file, order included
    (a loader's fingerprint of a source is `fingerprint.source_fingerprint`)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.size}\0{f.key}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]
