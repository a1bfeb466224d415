"""Where documents come from: one room per kind of reader, and the listing they share.

``files``: specs (paths, globs, directories, URIs) to files through ``pyarrow.fs``.
``readers``: one source, any format: detect, list work units, build the reader.
``parquet``, ``jsonl``, ``text_files``: the readers; ``manifest``: the parquet index;
``fingerprint``: what a resume must find unchanged; ``examples``, ``memory``: in-memory data.
"""

from .files import FORMAT_SUFFIXES, MANIFEST_NAME, SourceFile, SourceSpec, fingerprint_files, resolve_files

__all__ = ["FORMAT_SUFFIXES", "MANIFEST_NAME", "SourceFile", "SourceSpec", "fingerprint_files", "resolve_files"]
