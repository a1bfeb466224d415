"""tiktoken as the engine of a byte-level BPE ``tokenizer.json``, used only where its ids are the same.

A byte-level BPE file (GPT-2, cl100k, o200k and Llama-3 style) describes the
machine a `tiktoken.Encoding` runs: a regex cuts text into pieces, each piece's
UTF-8 bytes are joined pairwise, lowest rank first. `convert` reads that machine
out of the file: the regex (ByteLevel's built-in GPT-2 pattern, or a Split
pattern followed by a ByteLevel without its own), the vocabulary mapped back
from GPT-2's byte-to-unicode alphabet to bytes, and the ids as ranks. It refuses,
naming the reason, what tiktoken cannot run the same way: a normalizer, a prefix
space, dropout, subword prefixes or suffixes, byte fallback, added tokens that
are not special (those are split out before the regex), a byte without a token
(tiktoken needs all 256), merges whose order disagrees with the ids they
produce (tiktoken merges by id), and, when the model does not set
``ignore_merges``, a token its merges would not rebuild from its own bytes
(tiktoken takes a piece that is a whole token as it is).

Structure is necessary, not sufficient: the regex engines differ (Oniguruma in
`tokenizers`, fancy-regex in tiktoken), and tiktoken joins any two neighbours
whose bytes form a token, merge or not. So `choose` also encodes a
sample (`SAMPLE`: prose, contractions, digits, whitespace runs, tabs, code,
accents, CJK, emoji, combining marks, special-token spellings; and this
module's own source) with both and keeps tiktoken only if every id agrees;
otherwise the loader stays on `tokenizers` and the summary says why. Data text is always text: tiktoken's
``encode_ordinary`` never yields a special token, like the loader's
`tokenizers` setting (`tokenizer._as_data_tokenizer`). Only encoding moves:
decoding, token lookups and the fingerprint stay with `tokenizers`, so a state
saved on one engine resumes on the other.

Trade-off: the choice costs time, growing with the vocabulary: conversion, the vocabulary
check and the sample, once in the main process, and once per tokenizer file: the verdict
and the conversion are kept in the tokenizer cache (tokenizer_cache.py), so a later build
reads them instead. Workers receive the verdict with the serialized tokenizer and rebuild
the Encoding from it without checks, once per process (`encoding` caches it). In return,
tiktoken gives more tokens per second than ``encode_batch_fast`` on one thread, and
``pretrain`` more tokens per second with several workers: benchmarks/tokenizer_speed.py
(RESULTS.md "tokenizer speed") measures both; figures in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .compat.tiktoken import ordinary_encoder
from .engines import first_difference

#: ``tokenizers``' ByteLevel pre-tokenizer regex (use_regex=True), which is GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

#: A conversion: (regex, {token bytes: rank}, {special token: id}, ignore_merges).
Parts = Tuple[str, Dict[bytes, int], Dict[str, int], bool]

#: Set to 0 to keep `tokenizers` as the engine even where tiktoken would give the same ids.
ENV_SWITCH = "TOKENLOOM_TIKTOKEN"

#: Text both engines must encode identically before tiktoken is used.
SAMPLE: Tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see what they've done, "
    "and I'M SURE you'd agree she's right. DON'T SHOUT, they'Re fine.\n\n",
    "Numbers: 0 7 42 123 1234 12345 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 0b1011 ١٢٣ ⅷ ²³ 10¹⁰\n",
    "Whitespace:  two   three    four\t\ttabs \t mixed\n\n\n   leading spaces\ntrailing   \n\r\n\u00a0nbsp\u2003em\u3000ideo  \n",
    "def f(x, *args, **kwargs):\n    \"\"\"Docstring.\"\"\"\n    if x >= 10 and not args:\n        return {'a': [1, 2], \"b\": (x ** 2) // 3}\n"
    "\telse:\n\t\tprint(f\"{x!r:>10}\")  # comment\n    return None\n\nclass A(B):\n    pass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; } // C\n<div class=\"x\">&nbsp;</div> $HOME/bin:~/.local ${x}\n",
    "Café naïve résumé Ångström façade Straße œuvre ĳ İstanbul ǅ\n",
    "Ελληνικά Русский текст עִבְרִית العربية हिन्दी ภาษาไทย 한국어 日本語のテキスト 中文文本，标点。\n",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨🚀 and combining e\u0301 a\u0308 n\u0303 Z\u0351\u0353\u0359\n",
    "Special spellings are text: <|endoftext|> <|bos|> <s> </s> [CLS] <|im_start|>user <|begin_of_text|>\n",
    "Punctuation runs: ... --- !!! ??? ;;; ((())) [[]] {{}} ``` ''' \"\"\" ~~~ ___ *** /// \\\\ ||| @@@ ### %%% ^^^\n",
    "URLs: https://example.com/path?q=1&r=%20x#frag mail@example.org C:\\Windows\\System32 ../../etc\n",
    "Mixed: abc123def 1st 2nd 3rd 4th x1y2z3 CamelCaseWord snake_case_word kebab-case-word ALLCAPS12\n",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D ’s ’t don’t\n",
    "",
    " ",
    "\n",
    "a",
    "    \n    \n",
)


class NotConvertible(ValueError):
    """The tokenizer.json is not a byte-level BPE tiktoken can run with the same ids."""


@lru_cache(maxsize=1)
def byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, inverted: the character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _pattern(pre: Optional[Dict[str, Any]]) -> str:
    """The single regex the pre-tokenizer applies, or `NotConvertible`."""
    if pre is None:
        raise NotConvertible("no pre-tokenizer (tiktoken needs a byte-level one)")
    kind = pre.get("type")
    if kind == "ByteLevel":
        _check_bytelevel(pre, use_regex=True)
        return GPT2_PATTERN
    if kind == "Sequence":
        steps = pre.get("pretokenizers") or []
        if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
            split, level = steps
            _check_bytelevel(level, use_regex=False)
            regex = (split.get("pattern") or {}).get("Regex")
            if regex is None:
                raise NotConvertible(f"Split pattern {split.get('pattern')!r} is not a regex")
            if split.get("behavior") != "Isolated" or split.get("invert"):
                raise NotConvertible(f"Split behavior={split.get('behavior')!r} invert={split.get('invert')!r} "
                                     "(tiktoken keeps regex matches: Isolated, invert=false)")
            return regex
        raise NotConvertible(f"pre-tokenizer sequence {[s.get('type') for s in steps]} "
                             "(convertible: ByteLevel, or Split then ByteLevel)")
    raise NotConvertible(f"pre-tokenizer {kind!r} is not byte-level")


def _check_bytelevel(pre: Dict[str, Any], *, use_regex: bool) -> None:
    if pre.get("add_prefix_space"):
        raise NotConvertible("ByteLevel add_prefix_space=true (tiktoken adds no space)")
    if bool(pre.get("use_regex", True)) != use_regex:
        raise NotConvertible(f"ByteLevel use_regex={pre.get('use_regex')!r} here "
                             f"(convertible: {use_regex} in this position)")


def _merge_pairs(merges: Sequence[Any]) -> List[Tuple[str, str]]:
    pairs = []
    for m in merges:
        if isinstance(m, str):
            left, sep, right = m.partition(" ")
            if not sep:
                raise NotConvertible(f"merge {m!r} is not 'left right'")
            pairs.append((left, right))
        else:
            pairs.append((m[0], m[1]))
    return pairs


def convert(payload: str) -> Tuple[str, Dict[bytes, int], Dict[str, int], bool]:
    """(regex, {token bytes: rank}, {special token: id}, ignore_merges) from a tokenizer.json
    text; ranks are the ids. `NotConvertible` names what does not fit."""
    spec = json.loads(payload)
    for key in ("truncation", "padding"):
        if spec.get(key):
            raise NotConvertible(f"{key} is set ({spec[key]}): tokenizers would cut or pad documents")
    norm = spec.get("normalizer")
    if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        raise NotConvertible(f"normalizer {norm.get('type')!r}")
    pat = _pattern(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NotConvertible(f"model {model.get('type')!r} is not BPE")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotConvertible(f"BPE {key}={model[key]!r}")
    if model.get("byte_fallback"):
        raise NotConvertible("BPE byte_fallback=true")
    vocab: Dict[str, int] = model.get("vocab") or {}
    specials: Dict[str, int] = {}
    for added in spec.get("added_tokens") or []:
        if not added.get("special"):
            # Split out of the text before the regex, even with special-token matching off.
            raise NotConvertible(f"added token {added.get('content')!r} (id {added.get('id')}) is not special")
        specials[added["content"]] = int(added["id"])

    decoder = byte_decoder()
    ranks: Dict[bytes, int] = {}
    for token, tid in vocab.items():
        try:
            raw = bytes(decoder[c] for c in token)
        except KeyError:
            continue  # outside the byte alphabet (a special token's spelling): no text reaches it
        if token in specials and len(token) > 1:
            continue  # text spelling "<|bos|>" must not meet it as a whole piece; merges reach it only if listed
        ranks[raw] = int(tid)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise NotConvertible(f"{len(missing)} of the 256 bytes have no token (first: {missing[0]:#04x}); "
                             "tiktoken needs every byte")

    # tiktoken joins the neighbours whose joined bytes have the lowest id; tokenizers applies the
    # earliest merge. They agree only if merge order and the ids of merge results agree.
    last = -1
    made = set()
    for i, (left, right) in enumerate(_merge_pairs(model.get("merges") or [])):
        joined = left + right
        if left not in vocab or right not in vocab or joined not in vocab:
            raise NotConvertible(f"merge #{i} {left!r} + {right!r}: a part or the result is not in the vocabulary")
        tid = int(vocab[joined])
        if tid < last:  # equal: another split of the same token (files converted from tiktoken list each)
            raise NotConvertible(f"merge #{i} {left!r} + {right!r} makes id {tid} after a merge that made id {last}: "
                                 "merge order and ids disagree")
        last = tid
        made.add(joined)
        if joined in specials:
            raw = bytes(decoder[c] for c in joined)
            ranks[raw] = tid
            del specials[joined]  # reachable by merges: an ordinary token of the BPE
    ranked = set(ranks.values())
    unmade = next((t for t in vocab if len(t) > 1 and t not in made and vocab[t] in ranked), None)
    if unmade is not None and not model.get("ignore_merges"):
        # tiktoken takes a piece that spells a token as that token; tokenizers only reaches it by merges.
        raise NotConvertible(f"token {unmade!r} (id {vocab[unmade]}) is made by no merge")
    return pat, ranks, specials, bool(model.get("ignore_merges"))


def _rebuilds_every_token(reference: Any, ranks: Dict[bytes, int]) -> Optional[str]:
    """Without ignore_merges, `tokenizers` merges a piece that spells a whole token; tiktoken
    takes the token. The same only if merging each token's bytes gives that token: checked
    with the file's own BPE model (``reference.model``) on every token's spelling. None, or
    the first token that fails."""
    chars = {b: c for c, b in byte_decoder().items()}
    tokenize = reference.model.tokenize
    for raw, rank in ranks.items():
        if len(raw) > 1:
            ids = [t.id for t in tokenize("".join(chars[b] for b in raw))]
            if ids != [rank]:
                return f"the merges turn token {raw!r} (id {rank}) into ids {ids}"
    return None


_encodings: Dict[str, Any] = {}  # tokenizer.json text -> tiktoken.Encoding, one conversion per process
_encodings_lock = threading.Lock()


def _build(parts: Tuple[str, Dict[bytes, int], Dict[str, int], bool]) -> Any:
    import tiktoken

    pat, ranks, specials, _ = parts
    return tiktoken.Encoding("tokenloom-bpe", pat_str=pat, mergeable_ranks=ranks, special_tokens=specials)


def encoding(payload: str, cached: Optional[Callable[[], Optional[Parts]]] = None) -> Any:
    """The `tiktoken.Encoding` for a tokenizer.json text `choose` accepted, built once per
    process (a loader worker rebuilds it: from the tokenizer cache's conversion, ``cached()``,
    else, more slowly, by converting the payload it was sent)."""
    with _encodings_lock:
        enc = _encodings.get(payload)
        if enc is None:
            parts = cached() if cached is not None else None
            enc = _encodings[payload] = _build(parts if parts is not None else convert(payload))
        return enc


def sample_texts() -> List[str]:
    """`SAMPLE` plus this module's own source in pieces of 2048 characters (code, docstrings, comments)."""
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    return list(SAMPLE) + [source[i:i + 2048] for i in range(0, len(source), 2048)]


def switched_off() -> Optional[str]:
    """Why tiktoken is not to be used whatever the file (the environment switch), or None."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    return None


def choose(payload: str, reference: Any, sample: Optional[Sequence[str]] = None) -> Tuple[Optional[Any], str]:
    """(tiktoken Encoding or None, why) for a tokenizer.json text; ``reference`` is the
    `tokenizers.Tokenizer` the loader would use otherwise (special tokens as text)."""
    off = switched_off()
    if off:
        return None, off
    enc, _, why = verdict(payload, reference, sample)
    return enc, why


def verdict(payload: str, reference: Any, sample: Optional[Sequence[str]] = None
            ) -> Tuple[Optional[Any], Optional[Parts], str]:
    """(tiktoken Encoding, its conversion, why) where tiktoken gives the same ids, else (None, None,
    why); the environment switch aside (`choose`), so the verdict can be kept per tokenizer."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return None, None, "tiktoken is not installed (pip install 'tokenloom[tiktoken]' may be faster)"
    try:
        parts = convert(payload)
        if not parts[3]:
            problem = _rebuilds_every_token(reference, parts[1])
            if problem:
                raise NotConvertible(problem)
        enc = _build(parts)
    except NotConvertible as e:
        return None, None, f"not convertible to tiktoken: {e}"
    except Exception as e:  # e.g. tiktoken's regex engine rejects the pattern
        return None, None, f"tiktoken cannot build it: {type(e).__name__}: {e}"
    texts = sample_texts() if sample is None else list(sample)
    differs = first_difference(encode_batch(enc, texts, threads=1), reference, texts)
    if differs:
        return None, None, differs
    with _encodings_lock:
        _encodings.setdefault(payload, enc)
    size = sum(len(t.encode("utf-8")) for t in texts)
    return enc, parts, f"same ids as tokenizers on a {size / 1024:.0f} KB sample"


_pool_lock = threading.Lock()
_pool: Dict[int, ThreadPoolExecutor] = {}  # by pid: a pool's threads do not survive a fork


def _executor() -> ThreadPoolExecutor:
    pid = os.getpid()
    with _pool_lock:
        if pid not in _pool:
            _pool.clear()
            _pool[pid] = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tokenloom-tiktoken")
        return _pool[pid]


def threads_wanted() -> int:
    """1 where `tokenizers` is told to stay on one thread (tokenloom's loader workers set
    ``TOKENIZERS_PARALLELISM=false``), all cores otherwise: the same policy for both engines."""
    off = os.environ.get("TOKENIZERS_PARALLELISM", "").strip().lower() in ("0", "false", "no", "off")
    return 1 if off else (os.cpu_count() or 1)


def encode_batch(enc: Any, texts: Sequence[str], threads: Optional[int] = None) -> List[np.ndarray]:
    """int32 id arrays (read-only), special-token spellings encoded as text. Calls the core
    directly: a text with a lone surrogate raises (as `tokenizers` does) instead of being repaired."""
    encode = ordinary_encoder(enc)
    threads = threads_wanted() if threads is None else threads
    if threads <= 1 or len(texts) < 2:
        return [encode(t) for t in texts]
    # The core releases the GIL while it encodes; a persistent pool, not one per call.
    return list(_executor().map(encode, texts))
