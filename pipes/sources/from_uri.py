"""A URI into a pyarrow filesystem, without waiting on a service the URI does not need.

pyarrow builds an S3 filesystem (``FileSystem.from_uri``, ``S3FileSystem(...)``, and the copy a
forked worker unpickles, files.py's `process_fs`) through the AWS SDK, whose client configuration
looks up a default region before pyarrow applies the one it was given: from ``AWS_DEFAULT_REGION``
or ``AWS_REGION``, the profile's config file, else the EC2 instance metadata service (IMDS,
169.254.169.254), unless ``AWS_EC2_METADATA_DISABLED`` is ``true``. Off EC2 (a laptop, another cloud,
a cluster in front of MinIO or R2) that service does not answer: the SDK waits out its timeouts
each time a client is built, even with ``region=`` in the URI, whose region then replaces the
looked-up one. With no credentials in the environment the credential chain asks the same
service too. docs/reliability.md has the measured waits.

What `filesystem_from_uri` and `copy_filesystem` do about it, only while they build an S3
filesystem and only where the environment does not say otherwise:

- a region the URI names (``region=``; a copy: the region its original has) is given to the SDK
  as ``AWS_REGION``, so it looks up none. The filesystem is the one pyarrow builds from the URI.
- an endpoint of the URI's own (``endpoint_override=``, else ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL``) that is not AWS's (a host not under ``amazonaws.com`` or ``api.aws``): the
  SDK is told ``AWS_EC2_METADATA_DISABLED=true``. The instance's role is AWS's credentials and
  region, which such a store neither checks nor has: without a region the SDK takes ``us-east-1``
  (what it took when the service did not answer), without credentials it signs nothing.
- set ``AWS_EC2_METADATA_DISABLED`` (to ``false`` to keep asking the service), ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION`` yourself and that variable is left as it is.

The SDK reads these from the process environment only, so they are set in ``os.environ`` for the
time of the build and put back after, one build at a time (a lock); nothing is changed at import
or left behind.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import urllib.parse
from typing import Dict, Iterator, Mapping, Optional, Tuple

import pyarrow.fs as pafs

from ..process_hooks import at_fork

#: Hosts of AWS's own S3 endpoints: an endpoint under one of these may need the instance's role.
AWS_HOSTS = ("amazonaws.com", "amazonaws.com.cn", "api.aws")

_ENV_LOCK = threading.Lock()
#: While a build runs: the values its settings replaced (a child forked meanwhile puts them back).
_REPLACED: Dict[str, Optional[str]] = {}


def _host(endpoint: str) -> str:
    """The host of an endpoint given as ``host[:port]`` or ``scheme://host[:port]/...``."""
    parsed = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    return (parsed.hostname or "").lower()


def is_aws_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` (``host[:port]`` or a URL) is one of AWS's S3 endpoints."""
    host = _host(endpoint)
    return any(host == h or host.endswith("." + h) for h in AWS_HOSTS)


def sdk_settings(region: Optional[str], endpoint: Optional[str],
                 environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The variables to set while an S3 filesystem with ``region`` and ``endpoint`` (None: not given)
    is built so that the SDK waits on no service it does not need (module docstring); none that
    ``environ`` sets already."""
    endpoint = endpoint or environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")
    out: Dict[str, str] = {}
    if region and not environ.get("AWS_REGION") and not environ.get("AWS_DEFAULT_REGION"):
        out["AWS_REGION"] = region
    if endpoint and not is_aws_endpoint(endpoint) and "AWS_EC2_METADATA_DISABLED" not in environ:
        out["AWS_EC2_METADATA_DISABLED"] = "true"
    return out


def uri_settings(uri: str, environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """`sdk_settings` for ``uri``: its ``region=`` and ``endpoint_override=``; nothing but for ``s3://``."""
    scheme, _, rest = uri.partition("://")
    if scheme.lower() != "s3":
        return {}
    query = urllib.parse.parse_qs(rest.partition("?")[2])
    return sdk_settings((query.get("region") or [None])[-1], (query.get("endpoint_override") or [None])[-1], environ)


def filesystem_settings(fs: pafs.FileSystem, environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """`sdk_settings` for another S3 filesystem like ``fs`` (its region and endpoint); nothing but for S3."""
    if fs.type_name != "s3":
        return {}
    try:
        _, (kwargs,) = fs.__reduce__()
    except Exception:  # noqa: BLE001 - a pyarrow that pickles it otherwise: only the region
        kwargs = {"region": getattr(fs, "region", None)}
    return sdk_settings(kwargs.get("region"), kwargs.get("endpoint_override"), environ)


@contextlib.contextmanager
def sdk_environment(settings: Mapping[str, str]) -> Iterator[None]:
    """Within: ``settings`` in ``os.environ`` (one such block at a time); after: the environment as it was."""
    if not settings:
        yield
        return
    at_fork("from_uri", after_in_child=_after_fork_in_child)
    with _ENV_LOCK:
        _REPLACED.update({k: os.environ.get(k) for k in settings})
        os.environ.update(settings)
        try:
            yield
        finally:
            _put_back()


def _put_back() -> None:
    for k, v in _REPLACED.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _REPLACED.clear()


def _after_fork_in_child() -> None:
    """A child forked while another thread built a filesystem: that thread is not here to put the
    environment back or let go of the lock (held, it would stop this process's builds for ever)."""
    global _ENV_LOCK
    _put_back()
    _ENV_LOCK = threading.Lock()


#: Seconds pyarrow's GCS client retries a request before it fails (its default is 15 minutes).
GCS_RETRY_S = 15.0


def google_credentials(environ: Mapping[str, str] = os.environ) -> bool:
    """Does this machine name Google credentials (a key file, or gcloud's application default
    credentials)? Without, pyarrow's client asks the GCE metadata server, which off Google Cloud
    does not answer: a source would wait minutes and then fail."""
    if environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return True
    config = environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    return os.path.isfile(os.path.join(config, "application_default_credentials.json"))


def _gcs(uri: str) -> Tuple[pafs.FileSystem, str]:
    """``gs://bucket/path``: with Google credentials, as pyarrow builds it (its retries bounded by
    `GCS_RETRY_S`); without, anonymous (public buckets read; a private one fails fast with what to set)."""
    import datetime
    parts = urllib.parse.urlsplit(uri)
    path = (parts.netloc + parts.path).rstrip("/")
    limit = datetime.timedelta(seconds=GCS_RETRY_S)
    if google_credentials():
        return pafs.GcsFileSystem(retry_time_limit=limit), path
    return pafs.GcsFileSystem(anonymous=True, retry_time_limit=limit), path


def _azure(uri: str, environ: Mapping[str, str] = os.environ) -> Tuple[pafs.FileSystem, str]:
    """``az://container/path``: the container of the storage account ``AZURE_STORAGE_ACCOUNT_NAME``
    names (adlfs's convention), with its key (``AZURE_STORAGE_ACCOUNT_KEY``) if set, else Azure's
    default credentials (pyarrow's)."""
    account = environ.get("AZURE_STORAGE_ACCOUNT_NAME") or environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise ValueError(f"{uri}: az:// names a container, not its storage account: set AZURE_STORAGE_ACCOUNT_NAME, "
                         "or write abfs://<container>@<account>.dfs.core.windows.net/<path>")
    parts = urllib.parse.urlsplit(uri)
    key = environ.get("AZURE_STORAGE_ACCOUNT_KEY") or environ.get("AZURE_STORAGE_KEY")
    fs = pafs.AzureFileSystem(account_name=account, account_key=key) if key else pafs.AzureFileSystem(account)
    return fs, (parts.netloc + parts.path).rstrip("/")


def filesystem_from_uri(uri: str) -> Tuple[pafs.FileSystem, str]:
    """``pyarrow.fs.FileSystem.from_uri(uri)``: the same filesystem and path, built without a wait on
    the EC2 metadata service that the URI does not need (module docstring); ``gs://`` without Google
    credentials anonymous (`_gcs`), ``az://`` on the account the environment names (`_azure`)."""
    scheme = uri.split("://", 1)[0].lower()
    if scheme in ("gs", "gcs"):
        return _gcs(uri)
    if scheme == "az":
        return _azure(uri)
    with sdk_environment(uri_settings(uri)):
        return pafs.FileSystem.from_uri(uri)


def copy_filesystem(fs: pafs.FileSystem) -> pafs.FileSystem:
    """A new filesystem with ``fs``'s options (its own client and connections), built as
    `filesystem_from_uri` builds one. Raises what pickling ``fs`` raises."""
    with sdk_environment(filesystem_settings(fs)):
        return pickle.loads(pickle.dumps(fs))
