"""Files over HTTP(S) range requests, as a pyarrow filesystem: ``https://`` and ``http://`` sources,
and the bytes of ``hf://`` sources (hf_store.py lists them and reads them here, by their ``resolve`` URLs).

Why not fsspec's HTTP filesystem wrapped for pyarrow: through pyarrow's ``FSSpecHandler`` every open
costs a ``HEAD`` (``isfile``) and every read goes through a read-ahead block cache of megabytes
behind one lock, so a footer read fetches a whole block and a worker's read-ahead threads wait on each other. Here:

- **A file is a URL.** ``get_file_info`` asks the server with ``HEAD`` (size, ``ETag``,
  ``Last-Modified``); there is no directory listing over plain HTTP, so a source names its files
  (a list of URLs is fine) and a glob is refused with what to write instead.
- **Reads are positional range requests** (``Range: bytes=a-b``), safe from several threads at once
  (`HttpFile.read_at`: each thread has its own keep-alive connection per host), as read-ahead
  (readahead.py) and listing (listing_at_once.py) use them. `SourceFile.open` hands out `HttpFile`
  itself (`open_ranged`), not pyarrow's wrapper of a Python file, which serializes reads.
- **Every request is retried** by a `retry.RetryPolicy` on what is transient (429 with its
  ``Retry-After``, 5xx, a dropped or reset connection, a timeout), then fails naming the URL and
  the byte range. An answer is checked whole: its status, its ``Content-Range`` and its length, so
  a short body is retried, never handed on.
- **Pinned.** When the listing saw an ``ETag``, every later answer must carry the same one, or the
  read fails (`FileChangedError`): the file changed after the loader was built.
- **Redirects** (the Hub's ``resolve`` answers one to its storage) are followed, up to
  `MAX_REDIRECTS`, and the target is remembered per URL until it fails.
- **Fork-safe.** A forked process uses its own copy (files.py `process_fs` pickles the handler):
  connections are never shared with the parent; the copy keeps the listing's ``ETag``s.

Headers (an ``Authorization`` for the Hub) are sent with every request to the URL's host and never
shown in messages.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urljoin, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from .retry import TRANSIENT_STATUS, RetryPolicy, TransientError, retry_after_seconds

#: Redirects followed per request.
MAX_REDIRECTS = 5
_REDIRECT = frozenset({301, 302, 303, 307, 308})


class HttpStatusError(OSError):
    """The server answered with an error status that waiting does not fix (other than 401, 403, 404)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class FileChangedOnServer(OSError):
    """An answer carries another ``ETag`` than the listing saw: the file changed on the server."""


def _shown(url: str) -> str:
    """``url`` without its query (a signed URL's query is a credential)."""
    return url.split("?", 1)[0]


class _Answer:
    __slots__ = ("status", "headers", "body", "url")

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes, url: str):
        self.status, self.headers, self.body, self.url = status, headers, body, url


class HttpHandler(pafs.FileSystemHandler):
    """A pyarrow filesystem handler over HTTP(S) (module docstring): use it as
    ``pyarrow.fs.PyFileSystem(HttpHandler(...))``; paths are full URLs.

    Args:
        headers: sent with every request (e.g. ``Authorization``); kept out of every message.
        retry: how requests are retried (`RetryPolicy`).
        name: the type name pyarrow reports (``http``, ``hf``).
    """

    def __init__(self, headers: Optional[Mapping[str, str]] = None, retry: Optional[RetryPolicy] = None,
                 name: str = "http"):
        self.headers = dict(headers or {})
        self.retry = retry or RetryPolicy()
        self.name = name
        self.etags: Dict[str, str] = {}  # URL -> ETag the listing saw
        self._local = threading.local()
        self._located: Dict[str, str] = {}  # URL -> where its last redirect led
        self._pid = os.getpid()

    def __getstate__(self) -> Dict[str, Any]:
        return {"headers": self.headers, "retry": self.retry, "name": self.name, "etags": dict(self.etags)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["headers"], state["retry"], state["name"])
        self.etags.update(state["etags"])

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, HttpHandler) and other.headers == self.headers and other.retry == self.retry
                and other.name == self.name)

    def __hash__(self) -> int:
        return hash((self.name, self.retry))

    def __repr__(self) -> str:
        return f"HttpHandler(name={self.name!r}, retry={self.retry!r})"

    # --- connections and requests --------------------------------------------------------------
    def _connection(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        if self._pid != os.getpid():  # a fork of a process that used this very object
            self.__init__(self.headers, self.retry, self.name)
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get((scheme, netloc))
        if conn is None:
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = conns[(scheme, netloc)] = cls(netloc, timeout=self.retry.timeout_s)
        return conn

    def _drop(self, scheme: str, netloc: str) -> None:
        conn = getattr(self._local, "conns", {}).pop((scheme, netloc), None)
        if conn is not None:
            conn.close()

    def _once(self, method: str, url: str, extra: Mapping[str, str]) -> _Answer:
        """One request, following redirects; transient failures raise `TransientError`."""
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https"):
                raise ValueError(f"{_shown(url)}: not an http(s) URL")
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn = self._connection(parts.scheme, parts.netloc)
            try:
                conn.request(method, target, headers={**self.headers, **extra})
                resp = conn.getresponse()
                body = resp.read()  # for HEAD: b"", and it frees the connection for the next request
            except (http.client.HTTPException, OSError) as e:
                self._drop(parts.scheme, parts.netloc)
                raise TransientError(f"{method} {_shown(url)}: {type(e).__name__}: {e}") from e
            if resp.will_close:
                self._drop(parts.scheme, parts.netloc)
            headers = {k.lower(): v for k, v in resp.getheaders()}
            if resp.status in _REDIRECT and "location" in headers:
                url = urljoin(url, headers["location"])
                continue
            if resp.status in TRANSIENT_STATUS:
                raise TransientError(f"{method} {_shown(url)}: HTTP {resp.status} {resp.reason}", resp.status,
                                     retry_after_seconds(headers.get("retry-after")))
            return _Answer(resp.status, headers, body, url)
        raise OSError(f"{method} {_shown(url)}: more than {MAX_REDIRECTS} redirects")

    def request(self, method: str, url: str, extra: Mapping[str, str], what: str) -> _Answer:
        """A request to ``url`` (or where it last redirected to), retried; raises by the status:
        404 FileNotFoundError, 401/403 PermissionError, others OSError."""
        def attempt() -> _Answer:
            located = self._located.get(url, url)
            answer = self._once(method, located, extra)
            if located != url and answer.status in (401, 403, 404, 410):  # a stale redirect target
                self._located.pop(url, None)
                answer = self._once(method, url, extra)
            if answer.url != url and answer.status < 300:
                self._located[url] = answer.url
            return answer

        answer = self.retry.call(attempt, f"{what} of {_shown(url)}")
        if answer.status == 404:
            raise FileNotFoundError(f"{_shown(url)}: the server says it does not exist (HTTP 404)")
        if answer.status in (401, 403):
            raise PermissionError(f"{_shown(url)}: the server refused access (HTTP {answer.status}); "
                                  "check the token or credentials (for the Hugging Face Hub: HF_TOKEN or "
                                  "`hf auth login`, and that the token may read the repository)")
        if answer.status >= 300:
            raise HttpStatusError(f"{what} of {_shown(url)}: HTTP {answer.status}", answer.status)
        return answer

    def _check_etag(self, url: str, answer: _Answer) -> None:
        want, got = self.etags.get(url), answer.headers.get("etag")
        if want and got and want != got:
            raise FileChangedOnServer(f"{_shown(url)} changed on the server after the loader was built (ETag {got}, "
                                      f"listed with {want}): rebuild the loader, or pin the data to a version")

    # --- what pyarrow asks -----------------------------------------------------------------------
    def info(self, url: str) -> pafs.FileInfo:
        """The file at ``url`` (NotFound when the server says 404); remembers its ETag."""
        try:
            answer = self.request("HEAD", url, {}, "size lookup")
        except FileNotFoundError:
            return pafs.FileInfo(url, pafs.FileType.NotFound)
        except HttpStatusError:  # a server that does not answer HEAD
            answer = None
        size = None if answer is None else answer.headers.get("content-length")
        if size is None:
            # No length from HEAD: ask for the first byte, whose answer gives the total.
            answer = self.request("GET", url, {"Range": "bytes=0-0"}, "size lookup")
            total = answer.headers.get("content-range", "").rpartition("/")[2]
            size = total if total.isdigit() else answer.headers.get("content-length")
            if size is None:
                raise OSError(f"{_shown(url)}: the server gives no size (no Content-Length or Content-Range)")
        if "etag" in answer.headers:
            self.etags[url] = answer.headers["etag"]
        mtime = None
        if "last-modified" in answer.headers:
            try:
                mtime = parsedate_to_datetime(answer.headers["last-modified"])
            except (TypeError, ValueError):
                mtime = None
        return pafs.FileInfo(url, pafs.FileType.File, size=int(size), mtime=mtime)

    def read_range(self, url: str, offset: int, length: int, size: Optional[int]) -> bytes:
        """Exactly bytes ``[offset, offset + length)`` of ``url`` (fewer only at the end of a file of
        ``size`` bytes), or an error: a retry never returns part of a range."""
        if length <= 0:
            return b""
        want = length if size is None else max(0, min(length, size - offset))
        if want == 0:
            return b""
        what = f"bytes {offset}-{offset + want - 1}"

        def attempt() -> bytes:
            answer = self.request("GET", url, {"Range": f"bytes={offset}-{offset + want - 1}"}, what)
            self._check_etag(url, answer)
            body = answer.body
            if answer.status == 200:  # the server ignored the range: the whole file came
                body = body[offset:offset + want]
            elif answer.status != 206:
                raise OSError(f"{what} of {_shown(url)}: HTTP {answer.status}, expected 206")
            elif not answer.headers.get("content-range", "").startswith(f"bytes {offset}-"):
                raise OSError(f"{what} of {_shown(url)}: the server answered {answer.headers.get('content-range')!r}")
            if len(body) != want:
                raise TransientError(f"{what} of {_shown(url)}: {len(body)} bytes came of {want}")
            return body

        return self.retry.call(attempt, f"{what} of {_shown(url)}")

    def open_ranged(self, url: str, size: Optional[int] = None) -> "HttpFile":
        """The file at ``url`` for positional reads from several threads (module docstring); ``size``:
        its size as listed (no request then: the length of every answer is checked against it)."""
        if size is not None:
            return HttpFile(self, url, size)
        info = self.info(url)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{_shown(url)}: the server says it does not exist (HTTP 404)")
        return HttpFile(self, url, info.size)

    def get_type_name(self) -> str:
        return self.name

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: List[str]) -> List[pafs.FileInfo]:
        return [self.info(p) for p in paths]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> List[pafs.FileInfo]:
        raise OSError(f"{_shown(selector.base_dir)}: HTTP has no directory listing; name each file by its URL "
                      "(a list of URLs is a source), or use hf://datasets/<org>/<name>/<glob> for the Hub")

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.PythonFile(self.open_ranged(path), mode="r")

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.open_input_file(path)

    def _read_only(self, *_: Any, **__: Any) -> Any:
        raise OSError("HTTP sources are read-only")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _read_only
    move = copy_file = open_output_stream = open_append_stream = _read_only


class HttpFile:
    """A file over HTTP: positional reads (`read_at`, thread-safe) and a file object's ``read``,
    ``seek`` and ``tell`` over them (for pyarrow, which wraps it in a ``PythonFile``)."""

    #: A fork need not wait for a read in flight (first_fetches.blocks_fork): the handler drops the
    #: connections a forked child inherits.
    FORK_SAFE = True

    def __init__(self, handler: HttpHandler, url: str, size: int):
        self.handler, self.url, self._size = handler, url, int(size)
        self._pos, self.closed = 0, False

    def size(self) -> int:
        return self._size

    def read_at(self, nbytes: int, offset: int) -> bytes:
        return self.handler.read_range(self.url, int(offset), int(nbytes), self._size)

    def read(self, nbytes: int = -1) -> bytes:
        n = self._size - self._pos if nbytes is None or nbytes < 0 else int(nbytes)
        data = self.read_at(n, self._pos)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + int(offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> "HttpFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def http_filesystem(headers: Optional[Mapping[str, str]] = None, retry: Optional[RetryPolicy] = None,
                    name: str = "http") -> pafs.PyFileSystem:
    """A pyarrow filesystem over HTTP(S) (module docstring)."""
    return pafs.PyFileSystem(HttpHandler(headers, retry, name))


def ranged_opener(fs: pafs.FileSystem) -> Optional[Any]:
    """The ``open_ranged`` of a filesystem that offers files with thread-safe positional reads
    (this module's), else None."""
    handler = getattr(fs, "handler", None)
    return getattr(handler, "open_ranged", None)
