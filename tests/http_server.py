"""A local HTTP server for remote-source tests and benchmarks: files with range requests, the
Hugging Face Hub's API as ``huggingface_hub`` calls it, and injected latency, bandwidth caps and faults.

- ``/files/<path>``: the files under ``root`` (``HEAD`` and ``GET`` with ``Range``, an ``ETag``).
- The Hub (``HF_ENDPOINT`` pointed here): ``hub`` maps a repository id (``org/name``) to its
  revisions, ``{name or sha: (sha, folder)}`` (the folder's files are the repository at that sha):
  ``GET /api/datasets/<repo>[/revision/<rev>]`` (its sha), ``GET /api/datasets/<repo>/tree/<rev>[/<path>]``
  (recursive, paged by ``Link`` headers), ``POST /api/datasets/<repo>/paths-info/<rev>`` and
  ``/datasets/<repo>/resolve/<rev>/<path>`` (``HEAD``, ``GET`` with ``Range``).
- Faults: with ``fault_every=k``, every k-th request (counted over all requests) gets the next of
  ``fault_kinds``: ``429`` (with ``Retry-After: 0``), ``503``, ``reset`` (the connection closed
  with no answer), ``short`` (half the body, then closed).
- ``latency_s`` before every answer, ``bytes_per_s`` per connection (the body written in slices).
- ``log``: every request as ``(method, path, range header)``; ``sent``: body bytes sent;
  ``GET /_stats``: ``{"requests", "sent", "faults"}`` as JSON (not counted), for a benchmark that
  runs the server in a process of its own (``python tests/http_server.py ROOT [HUB_REPO] [LATENCY_S]
  [BYTES_PER_S]`` prints the URL).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlsplit


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # clients open many connections at once; a full backlog drops SYNs (1 s resends)

    def __init__(self, root: str = "", hub: Optional[Dict[str, Dict[str, Tuple[str, str]]]] = None, *,
                 latency_s: float = 0.0, bytes_per_s: float = 0.0, fault_every: int = 0,
                 fault_kinds: Tuple[str, ...] = ("429", "503", "reset", "short"), page_size: int = 1000):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.hub = root, hub or {}
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self.fault_every, self.fault_kinds = fault_every, fault_kinds
        self.page_size = page_size
        self.log: List[Tuple[str, str, str]] = []
        self.faults = 0
        self.sent = 0
        self._count = 0
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def handle_error(self, request, client_address) -> None:
        """A client that dropped a connection (or a fault that did) is not an error of the server."""
        import sys
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def next_fault(self) -> Optional[str]:
        with self._lock:
            self._count += 1
            if self.fault_every and self._count % self.fault_every == 0:
                kind = self.fault_kinds[(self._count // self.fault_every - 1) % len(self.fault_kinds)]
                self.faults += 1
                return kind
        return None


def _etag(path: str) -> str:
    st = os.stat(path)
    return '"' + hashlib.sha1(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()[:16] + '"'


def _oid(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _fault(self) -> bool:
        kind = self.server.next_fault()
        if kind is None:
            return False
        if kind in ("429", "503"):
            self._send(int(kind), b"busy", {"Retry-After": "0"} if kind == "429" else {})
        elif kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.close_connection = True
            self.connection.close()
        else:
            return None  # short: the handler sends half a body
        return True

    def _send(self, status: int, body: bytes, headers: Optional[Dict[str, str]] = None, head: bool = False,
              short: bool = False) -> None:
        if self.server.latency_s:
            time.sleep(self.server.latency_s)
        head = head or self.command == "HEAD"  # an answer to HEAD has no body, whatever its status
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        if short:
            self.send_header("Connection", "close")
        self.end_headers()
        if head:
            return
        with self.server._lock:
            self.server.sent += len(body)
        if short:
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        rate = self.server.bytes_per_s
        if not rate:
            self.wfile.write(body)
            return
        step = max(1, int(rate / 50))
        for i in range(0, len(body), step):
            t = time.perf_counter()
            self.wfile.write(body[i:i + step])
            left = step / rate - (time.perf_counter() - t)
            if left > 0:
                time.sleep(left)

    def _serve_file(self, path: str, head: bool, extra: Optional[Dict[str, str]] = None) -> None:
        if not os.path.isfile(path):
            self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, head)
            return
        fault = self._fault()
        if fault:
            return
        size = os.path.getsize(path)
        headers = {"ETag": _etag(path), "Accept-Ranges": "bytes",
                   "Last-Modified": formatdate(os.path.getmtime(path), usegmt=True), **(extra or {})}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, stop = int(a), min(int(b) if b else size - 1, size - 1)
            if start >= size:
                self._send(416, b"", {"Content-Range": f"bytes */{size}"}, head)
                return
            with open(path, "rb") as f:
                f.seek(start)
                body = f.read(stop - start + 1)
            headers["Content-Range"] = f"bytes {start}-{stop}/{size}"
            self._send(206, body, headers, head, short=fault is None)
            return
        with open(path, "rb") as f:
            body = f.read()
        self._send(200, body, headers, head, short=fault is None)

    # --- the Hub ---------------------------------------------------------------------------------
    def _repo(self, parts: List[str]) -> Tuple[Optional[str], List[str]]:
        """The repository id a path names (org/name) and the rest of the path."""
        if len(parts) >= 2 and f"{parts[0]}/{parts[1]}" in self.server.hub:
            return f"{parts[0]}/{parts[1]}", parts[2:]
        return None, parts

    def _revision(self, repo: str, rev: str) -> Optional[Tuple[str, str]]:
        revs = self.server.hub[repo]
        rev = unquote(rev)
        return revs.get(rev) or next((v for v in revs.values() if v[0] == rev), None)

    def _json(self, obj, status: int = 200, headers: Optional[Dict[str, str]] = None, head: bool = False) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}, head)

    def _entries(self, folder: str, under: str) -> List[dict]:
        base = os.path.join(folder, under) if under else folder
        if os.path.isfile(base):
            return [self._entry(folder, under)]
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for d in dirnames:
                rel = os.path.relpath(os.path.join(dirpath, d), folder).replace(os.sep, "/")
                out.append({"type": "directory", "oid": "0" * 40, "path": rel})
            for name in sorted(filenames):
                out.append(self._entry(folder, os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")))
        return out

    def _entry(self, folder: str, rel: str) -> dict:
        full = os.path.join(folder, rel)
        size = os.path.getsize(full)
        oid = _oid(full)
        return {"type": "file", "oid": oid[:40], "size": size, "path": rel,
                "lfs": {"oid": oid, "size": size, "pointerSize": 134}}

    def _api(self, method: str, parts: List[str], query: dict) -> None:
        if self._fault():
            return
        kind = parts[0] if parts else ""
        repo, rest = self._repo(parts[1:])
        if kind != "datasets" or repo is None:
            self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            return
        if not rest or rest[0] == "revision":
            rev = self._revision(repo, rest[1] if len(rest) > 1 else "main")
            if rev is None:
                self._json({"error": "Invalid rev id"}, 404, {"X-Error-Code": "RevisionNotFound"})
                return
            self._json({"id": repo, "sha": rev[0], "private": False})
            return
        if rest[0] in ("tree", "paths-info") and len(rest) >= 2:
            rev = self._revision(repo, rest[1])
            if rev is None:
                self._json({"error": "Invalid rev id"}, 404, {"X-Error-Code": "RevisionNotFound"})
                return
            folder = rev[1]
            if rest[0] == "paths-info":
                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                out = [e for p in form.get("paths", []) if os.path.exists(os.path.join(folder, p))
                       for e in ([self._entry(folder, p)] if os.path.isfile(os.path.join(folder, p))
                                 else [{"type": "directory", "oid": "0" * 40, "path": p}])]
                self._json(out)
                return
            under = unquote("/".join(rest[2:]))
            if under and not os.path.exists(os.path.join(folder, under)):
                self._json({"error": "not found"}, 404, {"X-Error-Code": "EntryNotFound"})
                return
            entries = self._entries(folder, under)
            start = int(query.get("cursor", ["0"])[0])
            page = entries[start:start + self.server.page_size]
            headers = {}
            if start + self.server.page_size < len(entries):
                nxt = f"{self.server.url}{self.path.split('?')[0]}?recursive=True&expand=False&cursor={start + len(page)}"
                headers["Link"] = f'<{nxt}>; rel="next"'
            self._json(page, headers=headers)
            return
        self._json({"error": "not found"}, 404)

    def _route(self, method: str) -> None:
        if self.path == "/_stats":
            srv = self.server
            self._json({"requests": len(srv.log), "sent": srv.sent, "faults": srv.faults})
            return
        self.server.log.append((method, self.path, self.headers.get("Range", "")))
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        head = method == "HEAD"
        if parts[0] == "files":
            self._serve_file(os.path.join(self.server.root, *parts[1:]), head)
        elif parts[0] == "api":
            self._api(method, parts[1:], parse_qs(url.query))
        elif parts[0] == "datasets":
            repo, rest = self._repo(parts[1:])
            if repo is None or len(rest) < 3 or rest[0] != "resolve":
                self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)
                return
            rev = self._revision(repo, rest[1])
            if rev is None:
                self._send(404, b"", {"X-Error-Code": "RevisionNotFound"}, head)
                return
            self._serve_file(os.path.join(rev[1], *rest[2:]), head, {"X-Repo-Commit": rev[0]})
        else:
            self._send(404, b"", None, head)

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")


if __name__ == "__main__":
    import sys
    root = sys.argv[1]
    hub = {sys.argv[2]: {"main": ("c" * 40, root)}} if len(sys.argv) > 2 and sys.argv[2] != "-" else {}
    srv = Server(root, hub, latency_s=float(sys.argv[3]) if len(sys.argv) > 3 else 0.0,
                 bytes_per_s=float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    print(srv.url, flush=True)
    srv.serve_forever()
