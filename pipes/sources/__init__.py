"""Where documents come from, in two layers; storage never imports a format (tests/test_imports.py).

Storage, bytes from where they live: ``files`` (specs: paths, globs, directories, URIs, to files),
``from_uri`` (pyarrow's filesystems, S3/GCS/Azure set-up), ``http_store`` (HTTP(S) range reads),
``hf_store`` (the Hugging Face Hub), ``retry`` (what is retried, how long), ``host_cache`` (what a host's
ranks share), ``listing_at_once``, ``parquet_footer``, ``readahead``, ``unit_readahead``,
``first_fetches`` (bytes fetched before they are read).

Formats, documents from bytes: ``readers`` (one source, any format: detect, list work units, build the
reader), ``parquet`` (with ``parquet_windows``, ``row_windows``), ``jsonl``, ``json_array``, ``compressed``,
``text_files``, ``line_listing``, ``hf_datasets``; ``manifest`` (the parquet index); ``fingerprint``
(what a resume must find unchanged); the token cache (``cache*``); ``examples``, ``memory``: in-memory data.
"""

from .files import FORMAT_SUFFIXES, MANIFEST_NAME, SourceFile, SourceSpec, fingerprint_files, resolve_files

__all__ = ["FORMAT_SUFFIXES", "MANIFEST_NAME", "SourceFile", "SourceSpec", "fingerprint_files", "resolve_files"]
