"""``hf://`` sources: files of a Hugging Face Hub dataset repository, listed once through
``huggingface_hub`` and read by HTTP range requests (http_store.py), pinned to one revision.

``hf://datasets/<org>/<name>[@<revision>]/<path or glob>``: the revision is a branch, a tag or a
commit sha (default ``main``), ``refs/convert/parquet`` (``~parquet``, the Hub's parquet conversion)
or ``refs/pr/<n>``, also URL-encoded; the path a file, a folder (its files of the source's format, found
recursively) or a glob as files.py reads globs (``data/*.parquet``, ``**/*.parquet``).

- **Pinned.** The revision is resolved to its commit sha once, when the source is listed, and
  every file is read at that sha (``<endpoint>/datasets/<repo>/resolve/<sha>/<path>``), so files
  pushed to the branch during a run are not mixed in; a source given without ``@<sha>`` logs the
  sha it was pinned to. The files' URIs name the sha (``hf://datasets/org/name@<sha>/path``), and a
  resume against files whose content changed is refused as for local files (fingerprint.py).
- **Few requests.** One call resolves the revision (none with ``@<sha>``) and one (paged) lists the
  tree, once per host for all its ranks and workers (host_cache.py: a commit's tree does not change);
  sizes come from the listing, so opening a file costs no request, and footers are kept per host by
  the files' content ids.
- **Retried.** The listing calls are retried on 429 and 5xx and on dropped connections
  (`retry.RetryPolicy`); the reads are http_store.py's.
- **The real client.** ``huggingface_hub``'s `HfApi` (the ``hf`` extra) makes the listing calls:
  its endpoint (``HF_ENDPOINT``), its token (``HF_TOKEN``, ``hf auth login``) and its headers,
  which the reads send too.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple
from urllib.parse import quote, unquote

from .host_cache import SHARED_FOR_S, shared
from .http_store import http_filesystem
from .retry import RetryPolicy, TransientError

log = logging.getLogger(__name__)

#: Repository types an ``hf://`` URI may name, by their plural as the Hub's URLs spell them.
REPO_TYPES = {"datasets": "dataset", "models": "model", "spaces": "space"}
_SHA = re.compile(r"[0-9a-f]{40}\Z")
#: Short names of revisions, as huggingface_hub's HfFileSystem reads them: ``@~parquet`` is the Hub's
#: parquet conversion of a dataset (its ``refs/convert/parquet`` branch).
REVISION_ALIASES = {"~parquet": "refs/convert/parquet"}


@dataclass(frozen=True)
class HfPath:
    """An ``hf://`` URI, parsed: repository type (``dataset``), id (``org/name``), revision (None:
    ``main``) and the path inside the repository (may be a glob; "" for the root)."""

    repo_type: str
    repo_id: str
    revision: Optional[str]
    path: str

    @staticmethod
    def parse(uri: str) -> "HfPath":
        if not uri.startswith("hf://"):
            raise ValueError(f"{uri!r} is not an hf:// URI")
        parts = uri[len("hf://"):].split("/")
        if parts[0] not in REPO_TYPES:  # hf://org/name/... : a dataset, as huggingface_hub reads it for datasets
            parts = ["datasets"] + parts
        if len(parts) < 3 or not parts[1] or not parts[2]:
            raise ValueError(f"{uri!r}: write hf://datasets/<org>/<name>[@<revision>]/<path or glob>")
        name, _, revision = parts[2].partition("@")
        rest = parts[3:]
        revision = unquote(revision)  # refs%2Fconvert%2Fparquet, as huggingface_hub writes it
        if revision == "refs" and len(rest) >= 2 and rest[0] in ("convert", "pr"):  # refs/convert/parquet, refs/pr/N
            revision, rest = "/".join(["refs"] + rest[:2]), rest[2:]
        revision = REVISION_ALIASES.get(revision, revision)
        return HfPath(REPO_TYPES[parts[0]], f"{parts[1]}/{name}", revision or None, "/".join(rest).strip("/"))

    def uri(self, sha: str, path: str) -> str:
        plural = next(k for k, v in REPO_TYPES.items() if v == self.repo_type)
        return f"hf://{plural}/{self.repo_id}@{sha}/{path}"


def _api():
    try:
        from huggingface_hub import HfApi
    except ImportError as e:
        raise ImportError("hf:// sources read the Hub through huggingface_hub: pip install 'tokenloom[hf]' "
                          "(or pip install huggingface_hub)") from e
    return HfApi()


def _transport_errors() -> Tuple[type, ...]:
    """What a dropped or reset connection raises in the HTTP client huggingface_hub uses: ``OSError``
    (requests), and the ``TransportError`` of httpx or of the httpx2 that huggingface_hub 2 vendors,
    among the modules it has imported (none is imported here)."""
    found: List[type] = [OSError]
    for name in ("httpx2", "httpx"):
        module = sys.modules.get(name)
        error = getattr(module, "TransportError", None) if module is not None else None
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def _transient(call, what: str, retry: RetryPolicy):
    """``call()`` retried on the Hub's transient answers and on dropped connections."""
    from huggingface_hub.errors import HfHubHTTPError

    def attempt():
        try:
            return call()
        except HfHubHTTPError as e:
            status = getattr(getattr(e, "response", None), "status_code", 0) or 0
            if status in (408, 429, 500, 502, 503, 504):
                raise TransientError(f"{what}: HTTP {status}", status) from e
            raise
        except _transport_errors() as e:  # a connection reset or dropped under the client
            raise TransientError(f"{what}: {type(e).__name__}: {e}") from e
    return retry.call(attempt, what)


@dataclass(frozen=True)
class HfFile:
    """One listed file: its resolve URL (what is read), size, path in the repository, pinned URI
    and content id (the LFS sha256, else the git blob id)."""

    url: str
    size: int
    path: str
    uri: str
    content: str


def list_hf(uri: str, suffixes: Tuple[str, ...], match, retry: Optional[RetryPolicy] = None,
            index_name: str = "") -> Tuple[Any, str, List[HfFile], Optional[bool]]:
    """The files ``uri`` names (module docstring): ``(filesystem, base path in the repo, files, whether
    the listing saw a file ``index_name`` in the base folder (None: not listed))``;
    ``suffixes`` are the format's file endings (a folder's files), ``match(pattern, path)`` reads a
    glob. Raises FileNotFoundError naming the URI when nothing matches."""
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import build_hf_headers

    retry = retry or RetryPolicy()
    where = HfPath.parse(uri)
    api = _api()
    if where.revision is not None and _SHA.match(where.revision):
        sha = where.revision  # pinned already: no lookup (a wrong sha fails the listing, naming it)
    else:
        def lookup() -> bytes:
            return _transient(lambda: api.repo_info(where.repo_id, revision=where.revision,
                                                    repo_type=where.repo_type),
                              f"{uri}: the revision lookup", retry).sha.encode()
        try:
            # ranks of one host starting together pin the same commit (host_cache.py)
            key = f"{api.endpoint}\0{where.repo_type}\0{where.repo_id}\0{where.revision or 'main'}"
            sha = shared("hub-revision", key, lookup, max_age_s=SHARED_FOR_S).decode()
        except RepositoryNotFoundError as e:
            raise FileNotFoundError(f"source {uri!r}: repository {where.repo_id!r} not found on {api.endpoint} (or it "
                                    "is private or gated: set HF_TOKEN, or run `hf auth login`, with access to it)") from e
        except RevisionNotFoundError as e:
            raise FileNotFoundError(f"source {uri!r}: revision {where.revision!r} not found in {where.repo_id!r}") from e
        log.info("%s: pinned to revision %s (%s at the start); write @%s in the URI to read the same files on every "
                 "run", uri, sha, where.revision or "main", sha)
    segments = where.path.split("/") if where.path else []
    glob_at = next((i for i, p in enumerate(segments) if any(c in p for c in "*?[")), None)
    one, index = None, None
    if glob_at is None and where.path:
        got = _transient(lambda: api.get_paths_info(where.repo_id, [where.path], revision=sha,
                                                    repo_type=where.repo_type),
                         f"{uri}: the path lookup", retry)
        one = next((_Entry(p.path, int(p.size), _content(p)) for p in got if _is_file(p) and p.path == where.path),
                   None)
    if one is not None:
        files, base = [one], where.path.rpartition("/")[0]
    else:
        base = "/".join(segments if glob_at is None else segments[:glob_at])
        def listing() -> bytes:
            try:
                got = _transient(lambda: list(api.list_repo_tree(where.repo_id, path_in_repo=base or None,
                                                                 recursive=True, revision=sha,
                                                                 repo_type=where.repo_type)),
                                 f"{uri}: the listing", retry)
            except EntryNotFoundError:
                got = []
            return json.dumps([[e.path, int(e.size), _content(e)] for e in got if _is_file(e)]).encode()

        try:
            # a commit's tree does not change: listed once per host (host_cache.py)
            key = f"{api.endpoint}\0{where.repo_type}\0{where.repo_id}\0{sha}\0{base}"
            entries = [_Entry(*e) for e in json.loads(shared("hub-tree", key, listing))]
        except RepositoryNotFoundError as e:
            raise FileNotFoundError(f"source {uri!r}: repository {where.repo_id!r} not found on {api.endpoint}") from e
        except RevisionNotFoundError as e:
            raise FileNotFoundError(f"source {uri!r}: revision {sha!r} not found in {where.repo_id!r}") from e
        files = entries
        index = any(f.path == (f"{base}/{index_name}" if base else index_name) for f in files)
        if glob_at is not None:
            files = [f for f in files if match(where.path, f.path)]
        else:
            files = [f for f in files if f.path.endswith(suffixes)
                     and not f.path.rpartition("/")[2].startswith((".", "_"))]
    if not files:
        raise FileNotFoundError(f"source {uri!r} matched no files with the endings {suffixes} at revision {sha} of "
                                f"{where.repo_id!r}; check the path, the glob and the revision")
    plural = next(k for k, v in REPO_TYPES.items() if v == where.repo_type)
    prefix = "" if where.repo_type == "model" else f"{plural}/"
    out = []
    for f in sorted(files, key=lambda f: f.path):
        url = f"{api.endpoint}/{prefix}{where.repo_id}/resolve/{sha}/{quote(f.path)}"
        out.append(HfFile(url, f.size, f.path, where.uri(sha, f.path), f.content))
    fs = http_filesystem(build_hf_headers(), retry, name="hf")
    return fs, base, out, index


class _Entry(NamedTuple):
    """A file of a listing: its path in the repository, size and content id."""

    path: str
    size: int
    content: str


def _content(entry: Any) -> str:
    """A listed file's content id: its LFS sha256, else its git blob id (both hash its bytes)."""
    lfs = getattr(entry, "lfs", None)
    sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return str(sha or getattr(entry, "blob_id", "") or "")


def _is_file(entry: Any) -> bool:
    """Is a listing's entry a file (a folder has no size)?"""
    return getattr(entry, "size", None) is not None and not hasattr(entry, "tree_id")
