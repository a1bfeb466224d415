"""What loading a tokenizer.json works out, kept once per tokenizer: a build in a blink.

Loading a ``tokenizer.json`` works out a few facts that depend on its content only: its
fingerprint (the hash of the canonical serialization, tokenizer.py), its vocabulary size and
added tokens, the ids of the usual BOS spellings, and whether the faster engines give
`tokenizers`' ids (the verdicts: fastokens_engine.py loads the file and encodes a sample;
tiktoken_bpe.py converts the vocabulary and merges, checks every token and encodes a sample),
with tiktoken's converted vocabulary. For a large byte-level BPE that work (the
JSON parse, the conversion, the token check and ``tokenizers``' own load) is paid in every
process that builds a loader, on every build, and grows with the vocabulary. None of it changes
unless the file does.

So it is done once per tokenizer and kept in the user's cache directory, under the SHA-256 of
the file's bytes (and of what decides the verdicts: this format, tiktoken's, fastokens' and
tokenizers' versions, the checking code): ``meta.json`` (the facts) and ``ranks.bin`` (the converted
vocabulary: token bytes end to end, their offsets and ranks as int64). A warm load reads the
file (to hash it), the facts and nothing else in the process that builds the loader; the
tiktoken encoding is built from ``ranks.bin`` where text is encoded (a loader worker: reading
and building from it instead of converting), and ``tokenizers`` loads the file only where it
is needed (decoding, a token outside the facts, the ``tokenizers`` engine). Cold and warm
loads are compared in docs/performance.md.

Safe to share: an entry is written to a temporary name and renamed into place (readers see
a whole entry or none; concurrent builders of the same tokenizer write the same bytes); an
entry that does not parse, lacks a key or whose ``ranks.bin`` does not match the checksum
in its facts is ignored and written again. A cache directory that cannot be written costs the
cold load, nothing else.

Where: ``$TOKENLOOM_CACHE`` if set (``0``, ``off`` or an empty value: no cache), else
``$XDG_CACHE_HOME/tokenloom`` or ``~/.cache/tokenloom``; entries in ``tokenizers/``. Read
where a tokenizer is loaded (the recipe's edge), never in a node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .cache_dir import ENV_CACHE, cache_root  # noqa: F401 (ENV_CACHE re-exported)

log = logging.getLogger(__name__)

#: Bump when an entry's layout or meaning changes: old entries are then simply not found.
FORMAT = 2
META, RANKS = "meta.json", "ranks.bin"

# Keys of meta.json.
K_FORMAT, K_FINGERPRINT, K_VOCAB, K_ADDED, K_LOOKUPS = "format", "fingerprint", "vocab_size", "added", "lookups"
K_TIKTOKEN, K_NOTE, K_PATTERN, K_SPECIALS, K_IGNORE_MERGES = "tiktoken", "note", "pattern", "specials", "ignore_merges"
K_RANKS_SHA, K_RANKS_COUNT, K_VERDICTS = "ranks_sha256", "ranks_count", "verdicts"
REQUIRED = (K_FORMAT, K_FINGERPRINT, K_VOCAB, K_ADDED, K_LOOKUPS, K_TIKTOKEN, K_NOTE, K_VERDICTS)

Parts = Tuple[str, Dict[bytes, int], Dict[str, int], bool]


#: The modules whose code decides a verdict (beside this one): an entry is kept per version of them.
DECIDING_CODE = ("tiktoken_bpe.py", "fastokens_engine.py", "engines.py", "tokenizer.py")


def _decider() -> str:
    """What the verdict and the facts depend on besides the file: a change of any is another key."""
    import tokenizers

    try:
        import tiktoken
        tiktoken_version = tiktoken.__version__ if hasattr(tiktoken, "__version__") else "?"
    except ImportError:
        tiktoken_version = "absent"
    from .fastokens_engine import version as fastokens_version
    code = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for module in DECIDING_CODE:  # read as files: importing them would run the loader's code both ways
        with open(os.path.join(here, module), "rb") as f:
            code.update(f.read())
    return f"{FORMAT}|{tokenizers.__version__}|{tiktoken_version}|{fastokens_version() or 'absent'}|{code.hexdigest()}"


def entry_dir(raw: bytes) -> Optional[str]:
    """Where the entry of a tokenizer.json with these bytes lives (None: no cache)."""
    root = cache_root()
    if root is None:
        return None
    key = hashlib.sha256(raw)
    key.update(_decider().encode())
    return os.path.join(root, "tokenizers", key.hexdigest()[:32])


def lookup(raw: bytes) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(entry directory, facts) for this tokenizer.json, or None (no cache, no entry, or a bad one)."""
    where = entry_dir(raw)
    if where is None:
        return None
    try:
        with open(os.path.join(where, META), encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or any(k not in meta for k in REQUIRED) or meta[K_FORMAT] != FORMAT:
            raise ValueError(f"keys {sorted(meta) if isinstance(meta, dict) else type(meta).__name__}")
        if meta[K_TIKTOKEN]:  # ~3 ms for a 100k vocabulary; a bad file is rewritten now, not met in a worker
            with open(os.path.join(where, RANKS), "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != meta[K_RANKS_SHA]:
                    raise ValueError("ranks.bin does not match its checksum")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.info("tokenizer cache entry %s is unreadable (%s): building it again", where, e)
        return None
    return where, meta


def read_parts(where: str, meta: Dict[str, Any]) -> Optional[Parts]:
    """The tiktoken conversion kept in an entry, checked against its checksum (None: bad or gone)."""
    try:
        with open(os.path.join(where, RANKS), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != meta[K_RANKS_SHA]:
            raise ValueError("checksum differs")
        n = int(meta[K_RANKS_COUNT])
        offsets = np.frombuffer(data, dtype="<i8", count=n + 1).tolist()
        ranks = np.frombuffer(data, dtype="<i8", count=n, offset=8 * (n + 1)).tolist()
        blob = data[8 * (2 * n + 1):]
        if offsets[-1] != len(blob):
            raise ValueError("token bytes of another length")
        table = {blob[offsets[i]:offsets[i + 1]]: ranks[i] for i in range(n)}
        return meta[K_PATTERN], table, {k: int(v) for k, v in meta[K_SPECIALS].items()}, bool(meta[K_IGNORE_MERGES])
    except (OSError, ValueError, KeyError) as e:
        log.info("tokenizer cache entry %s: ranks.bin unusable (%s); converting from the tokenizer.json", where, e)
        return None


def _ranks_bytes(ranks: Dict[bytes, int]) -> bytes:
    """ranks.bin: offsets (n + 1 int64), ranks (n int64), then the token bytes end to end."""
    tokens = list(ranks)
    offsets = np.zeros(len(tokens) + 1, dtype="<i8")
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    return offsets.tobytes() + np.asarray([ranks[t] for t in tokens], dtype="<i8").tobytes() + b"".join(tokens)


def parts_facts(parts: Optional[Parts], data: bytes) -> Dict[str, Any]:
    """The facts of meta.json that describe a tiktoken conversion (its ranks.bin is ``data``)."""
    if parts is None:
        return {}
    pattern, ranks, specials, ignore_merges = parts
    return {K_PATTERN: pattern, K_SPECIALS: specials, K_IGNORE_MERGES: ignore_merges,
            K_RANKS_SHA: hashlib.sha256(data).hexdigest(), K_RANKS_COUNT: len(ranks)}


def store(raw: bytes, facts: Dict[str, Any], parts: Optional[Parts]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """Write the entry (facts, and the tiktoken conversion where it is used); (entry directory,
    facts as kept), or None where there is no cache or it cannot be written."""
    where = entry_dir(raw)
    if where is None:
        return None
    files: Dict[str, bytes] = {}
    if parts is not None:
        files[RANKS] = _ranks_bytes(parts[1])
    meta = dict(facts, **{K_FORMAT: FORMAT, K_TIKTOKEN: parts is not None}, **parts_facts(parts, files.get(RANKS, b"")))
    files[META] = json.dumps(meta, sort_keys=True).encode()
    try:
        os.makedirs(where, exist_ok=True)
        for name in sorted(files, key=lambda n: n == META):  # meta.json last: it makes the entry whole
            fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(files[name])
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a cache shared by a team unreadable to the rest
            os.replace(tmp, os.path.join(where, name))
    except OSError as e:
        log.info("tokenizer cache %s cannot be written (%s): loading stays cold", where, e)
        return None
    return where, meta
