"""One small interface over the tokenizers users have: a ``tokenizer.json`` path,
a tokenizer directory, ``"demo"``, a tiktoken encoding name, a `tokenizers.Tokenizer`,
or a `tiktoken.Encoding`.

A directory is what ``save_pretrained`` writes: ``tokenizer.json`` for the ids, and
``tokenizer_config.json`` (optional) for the BOS/EOS tokens and the chat template
(or ``chat_template.jinja`` beside it), which the encoder carries to `sft`. A name
that is not a path is a tiktoken encoding ("cl100k_base", ...) when the tiktoken
extra is installed; tiktoken downloads an encoding once and caches it, so offline
it loads only from that cache, and a miss is refused in one line saying so.

`Encoder` is what nodes hold. It pickles as the tokenizer's serialized form (a
JSON string or a tiktoken encoding name), so a loader worker rebuilds it
locally and nothing heavy crosses the process boundary beyond that text.

Its fingerprint guards resumes: a state saved with one vocabulary is refused by
a loader built with another. For a Hugging Face tokenizer it hashes the canonical
serialization, ``Tokenizer.from_str(json).to_str()`` (compact, the library's own
field order), so a path, the loaded object and a re-saved or re-indented copy of
the same tokenizer agree, and any change of vocabulary, merges, normalizer,
special tokens or truncation differs. It costs one extra serialization.

What loading a tokenizer.json works out (fingerprint, vocabulary facts, the tiktoken verdict
and conversion) is kept per file content in the user's cache directory (tokenizer_cache.py),
so a later load of the same file, in any process, reads it instead of working it out again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

#: The tokenizer name (Python and command line) of the shipped 4096-id demo tokenizer.
DEMO_TOKENIZER = "demo"

#: Tokens tried, in order, when the user does not name a BOS.
BOS_CANDIDATES = ("<|bos|>", "<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>", "[CLS]", "<|im_start|>")


class Encoder:
    """Batched text -> int32 numpy arrays, plus the few facts the loader needs."""

    #: From a tokenizer directory's tokenizer_config.json (None elsewhere).
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    chat_template: Optional[str] = None
    #: Where the tokenizer came from, for messages.
    origin: str = ""

    def __init__(self, kind: str, payload: str, fingerprint: str, tiktoken_obj: Any = None):
        self.kind = kind  # "hf" | "tiktoken"
        self._payload = payload
        self.fingerprint = fingerprint
        self._tok: Any = tiktoken_obj
        # What encodes: a tokenizer.json runs on the fastest engine that gives tokenizers' ids (engines.py).
        self.engine = "tiktoken" if kind == "tiktoken" else "tokenizers"
        self.engine_note = "a tiktoken.Encoding" if kind == "tiktoken" else ""
        #: Per faster engine, whether it gives tokenizers' ids for this tokenizer.json, and why (hf only).
        self.verdicts: Dict[str, Tuple[bool, str]] = {}
        # From the tokenizer cache (tokenizer_cache.py): the facts a loader's build asks for, so
        # `tokenizers` loads the file only where it is needed; the entry holds the tiktoken conversion.
        self._facts: Optional[Dict[str, Any]] = None
        self._entry: Optional[str] = None

    # --- pickling: ship the serialized tokenizer, rebuild lazily --------------
    def __getstate__(self):
        state = dict(self.__dict__)
        if self.kind == "hf":
            state["_tok"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def tok(self) -> Any:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = _as_data_tokenizer(Tokenizer.from_str(self._payload))
        return self._tok

    # --- the interface ---------------------------------------------------------
    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        if self.engine == "fastokens":  # a worker builds the tokenizer once, from the payload it was sent
            from . import fastokens_engine

            if not self._stand_in():
                return fastokens_engine.encode_batch(fastokens_engine.build(self._payload), texts)
            tok = fastokens_engine.ready(self._payload)
            if tok is not None:
                return fastokens_engine.encode_batch(tok, texts)
            # fastokens is still being built in the background: the same ids from tiktoken meanwhile
        if self.engine in ("tiktoken", "fastokens") and self.kind == "hf":  # a worker rebuilds the Encoding once
            from . import tiktoken_bpe

            return tiktoken_bpe.encode_batch(tiktoken_bpe.encoding(self._payload, self._cached_parts), texts)
        if self.kind == "hf":
            encs = self.tok.encode_batch_fast(list(texts), add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encs]
        out = self.tok.encode_ordinary_batch(list(texts))
        return [np.asarray(ids, dtype=np.int32) for ids in out]

    def prepare(self) -> None:
        """Build what encoding needs first, now, in the training process: loader workers forked
        afterwards inherit it instead of each building its own. That is the tiktoken encoding of a
        tokenizer.json, for tiktoken and as fastokens' stand-in while each worker builds fastokens
        in the background (fastokens_engine.py); only where nothing stands in is the fastokens
        tokenizer itself built here."""
        if self.engine == "fastokens" and not self._stand_in():
            from . import fastokens_engine

            fastokens_engine.build(self._payload)
        elif self.engine in ("tiktoken", "fastokens") and self.kind == "hf":
            from . import tiktoken_bpe

            tiktoken_bpe.encoding(self._payload, self._cached_parts)

    def _stand_in(self) -> bool:
        """Whether tiktoken may encode while fastokens is being built: its verdict says it gives
        tokenizers' ids for this file, and it is not switched off."""
        from .tiktoken_bpe import switched_off

        return bool(self.verdicts.get("tiktoken", (False, ""))[0]) and not switched_off()

    def _cached_parts(self) -> Any:
        if self._entry is None or self._facts is None:
            return None
        from . import tokenizer_cache

        return tokenizer_cache.read_parts(self._entry, self._facts)

    def token_id(self, token: Union[str, int]) -> int:
        """The id of a token given as a string or an int; `ValueError` if unknown."""
        if isinstance(token, (int, np.integer)):
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(f"token id {token=} is outside the vocabulary (size {self.vocab_size})")
            return int(token)
        if self._tok is None and self._facts is not None:
            known = {**self._facts["lookups"], **{t: i for t, (i, _) in self._facts["added"].items()}}
            if token in known:
                tid = known[token]
                if tid is None:
                    raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary; "
                                     "pass a token that exists (or its id)")
                return int(tid)
        if self.kind == "hf":
            tid = self.tok.token_to_id(token)
        else:
            try:
                tid = self.tok.encode_single_token(token)
            except (KeyError, ValueError):
                tid = None
        if tid is None:
            raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary; "
                             "pass a token that exists (or its id)")
        return int(tid)

    def special_tokens(self) -> Dict[str, int]:
        """The special tokens (spelling -> id): those data text never becomes (see `_as_data_tokenizer`)."""
        if self.kind == "tiktoken":
            return {t: int(self.tok.encode_single_token(t)) for t in self.tok.special_tokens_set}
        if self._tok is None and self._facts is not None:
            return {t: int(i) for t, (i, special) in self._facts["added"].items() if special}
        return {t.content: int(i) for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def default_bos(self) -> int:
        if self.bos_token is not None:  # the tokenizer_config.json's own
            return self.token_id(self.bos_token)
        for cand in BOS_CANDIDATES:
            try:
                return self.token_id(cand)
            except ValueError:
                continue
        raise ValueError(
            f"the tokenizer has none of the usual BOS tokens {BOS_CANDIDATES}; "
            "pass bos='<your token>' or bos=<id>"
        )

    @property
    def vocab_size(self) -> int:
        if self._tok is None and self._facts is not None:
            return int(self._facts["vocab_size"])
        return int(self.tok.get_vocab_size()) if self.kind == "hf" else int(self.tok.n_vocab)

    def facts(self) -> Dict[str, Any]:
        """What the tokenizer cache keeps of an ``hf`` encoder besides the tiktoken conversion."""
        tok = self.tok
        return {"fingerprint": self.fingerprint, "vocab_size": int(tok.get_vocab_size()), "note": self.engine_note,
                "verdicts": {name: list(v) for name, v in self.verdicts.items()},
                "added": {t.content: [int(i), bool(t.special)] for i, t in tok.get_added_tokens_decoder().items()},
                "lookups": {c: tok.token_to_id(c) for c in BOS_CANDIDATES}}

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self.tok.decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids)

    def id_to_token(self, i: int) -> str:
        if self.kind == "hf":
            return self.tok.id_to_token(int(i)) or f"<{i}>"
        return self.tok.decode_single_token_bytes(int(i)).decode("utf-8", "replace")


def _as_data_tokenizer(tok: Any) -> Any:
    """Text from data files must never turn into control tokens: a document that
    contains the characters ``<|endoftext|>`` is text, as with tiktoken's
    ``encode_ordinary``. Special tokens are inserted by id (BOS, EOS, chat
    templates), never by spelling them in text."""
    tok.encode_special_tokens = True
    return tok


def with_engine(enc: Encoder, engine: Optional[str] = None) -> Encoder:
    """``enc`` set to encode on the engine `engines.choose` picks from its verdicts: ``engine``
    (``auto``/None: ``$TOKENLOOM_ENGINE``, else the fastest that gives tokenizers' ids); `Encoder.engine_note`
    says why (the run summary shows it). A forced engine that cannot be used is a `ValueError`."""
    from .engines import choose, forced_engine
    from .tiktoken_bpe import switched_off

    forced, source = forced_engine(engine)
    if enc.kind == "tiktoken":
        if engine not in (None, "auto", "tiktoken"):  # an explicit engine=; $TOKENLOOM_ENGINE is for tokenizer.json files
            raise ValueError(f"{source}: a tiktoken encoding ({enc.origin or enc._payload}) runs on tiktoken; "
                             "pass a tokenizer.json to use another engine")
        return enc
    enc.engine, enc.engine_note = choose(enc.verdicts, forced, source, switched_off())
    return enc


def _pick_engine(enc: Encoder, raw: Optional[bytes] = None, engine: Optional[str] = None) -> Encoder:
    """Work out which faster engines give tokenizers' ids for this tokenizer.json (fastokens_engine.py,
    tiktoken_bpe.py) and choose (`with_engine`). With the file's ``raw`` bytes, the verdicts and the
    facts are kept in the tokenizer cache for the next load."""
    from . import fastokens_engine, tiktoken_bpe, tokenizer_cache

    fast = fastokens_engine.verdict(enc._payload, enc.tok)
    encoding, parts, why = tiktoken_bpe.verdict(enc._payload, enc.tok)
    enc.verdicts = {"fastokens": fast, "tiktoken": (encoding is not None, why)}
    with_engine(enc, engine)
    if raw is not None:
        kept = tokenizer_cache.store(raw, enc.facts(), parts)
        if kept is not None:  # a worker builds the Encoding from the entry, not by converting
            enc._entry, enc._facts = kept
    return enc


def _from_cache(raw: bytes, payload: str, engine: Optional[str] = None) -> Optional[Encoder]:
    """The encoder of a tokenizer.json loaded before (tokenizer_cache.py), or None."""
    from . import tokenizer_cache

    found = tokenizer_cache.lookup(raw)
    if found is None:
        return None
    where, facts = found
    enc = Encoder("hf", payload, facts["fingerprint"])
    enc._facts, enc._entry = facts, where
    enc.verdicts = {name: (bool(ok), str(why)) for name, (ok, why) in facts["verdicts"].items()}
    return with_engine(enc, engine)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def demo_tokenizer_path() -> str:
    """Path of the shipped demo tokenizer, ``tokenloom/data/tokenizer.json`` (a 4096-id byte-level BPE),
    found as the package's data (no import of the package's code)."""
    from importlib.resources import files

    return str(files("tokenloom") / "data" / "tokenizer.json")


def load_encoder(tokenizer: Any, engine: Optional[str] = None) -> Encoder:
    """Accept a path to ``tokenizer.json``, a tokenizer directory, ``"demo"``, a tiktoken
    encoding name, a `tokenizers.Tokenizer`, a `tiktoken.Encoding`, or an `Encoder`;
    raise `ValueError` naming the path when it cannot be loaded. ``engine`` (engines.py): None
    (``$TOKENLOOM_ENGINE``, else automatic), ``"auto"``, or the engine to force."""
    if isinstance(tokenizer, Encoder):
        return tokenizer if engine is None else with_engine(copy.copy(tokenizer), engine)
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if path == DEMO_TOKENIZER:
            path = demo_tokenizer_path()
        elif os.path.isdir(path):
            return _load_directory(path, engine)
        elif not os.path.exists(path) and _is_name(path):
            return with_engine(_load_tiktoken_name(path), engine)
        payload = ""
        try:
            with open(path, "rb") as f:
                raw = f.read()
            payload = raw.decode("utf-8")
            cached = _from_cache(raw, payload, engine)
            if cached is not None:
                return cached
            from tokenizers import Tokenizer

            tok = _as_data_tokenizer(Tokenizer.from_str(payload))
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer file {path!r} does not exist; pass the path of a tokenizer.json") from e
        except Exception as e:
            raise ValueError(_not_a_tokenizer(path, payload) or f"cannot load tokenizer from {path!r}: {e}. "
                             "Expected a Hugging Face tokenizers JSON file (tokenizer.json)") from e
        canonical = tok.to_str()  # the special-token switch is not serialized
        enc = Encoder("hf", canonical, _hash(canonical))
        enc._tok = tok
        return _pick_engine(enc, raw, engine)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        Tokenizer = None
    if Tokenizer is not None and isinstance(tokenizer, Tokenizer):
        # Re-read, so the payload is in canonical form whatever the object went through; the worker's
        # copy is built from it, so switching special-token handling never changes the caller's object.
        payload = Tokenizer.from_str(tokenizer.to_str()).to_str()
        return _pick_engine(Encoder("hf", payload, _hash(payload)), engine=engine)
    if type(tokenizer).__module__.startswith("tiktoken") and hasattr(tokenizer, "encode_ordinary_batch"):
        name = getattr(tokenizer, "name", "tiktoken")
        return with_engine(Encoder("tiktoken", name, _hash(f"tiktoken:{name}:{tokenizer.n_vocab}"),
                                   tiktoken_obj=tokenizer), engine)
    raise TypeError(
        f"unsupported tokenizer {type(tokenizer).__name__}; pass a path to tokenizer.json, "
        "a tokenizers.Tokenizer or a tiktoken.Encoding"
    )


#: Keys of other JSON files a tokenizer directory holds (tokenizer_config.json, special_tokens_map.json).
_CONFIG_KEYS = ("tokenizer_class", "chat_template", "model_max_length", "added_tokens_decoder", "bos_token",
                "eos_token", "pad_token", "unk_token")


def _not_a_tokenizer(path: str, payload: str) -> Optional[str]:
    """Why ``path``, valid JSON, is not a tokenizer.json (None: it is not valid JSON, or it looks
    like one, so the tokenizers library's own error says more)."""
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        return None
    held = f"keys {sorted(obj)[:8]}{' ...' if len(obj) > 8 else ''}" if isinstance(obj, dict) else \
        f"a JSON {type(obj).__name__}"
    which = " (it looks like a tokenizer_config.json)" if isinstance(obj, dict) and any(
        k in obj for k in _CONFIG_KEYS) else ""
    folder = os.path.dirname(path) or "."
    beside = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(beside) and not os.path.samefile(beside, path):
        fix = f"pass {beside!r}, or the directory {folder!r} (tokenloom reads tokenizer_config.json from it)"
    else:
        fix = "pass the tokenizer.json (tokenizer.save_pretrained(dir) writes one) or the directory holding it"
    return (f"tokenizer file {path!r} is JSON but not a tokenizer.json{which}: it holds {held}, where a "
            "tokenizer.json holds the \"model\" (its \"type\", \"vocab\" and merges), \"added_tokens\", "
            f"\"normalizer\", \"pre_tokenizer\" and \"decoder\"; {fix}")


def _is_name(value: str) -> bool:
    """A bare name ("cl100k_base"), not a path: no folder and no file ending."""
    return "/" not in value and os.sep not in value and "." not in value


def _load_tiktoken_name(name: str) -> Encoder:
    try:
        import tiktoken
    except ImportError:
        raise ValueError(f"tokenizer {name!r} is not a file or directory; as a tiktoken encoding name it needs "
                         "the tiktoken extra (pip install 'tokenloom[tiktoken]'), or pass the path of a "
                         f"tokenizer.json or tokenizer directory, or {DEMO_TOKENIZER!r}") from None
    try:
        enc = tiktoken.get_encoding(name)
    except ValueError as e:
        if "nknown encoding" not in str(e):
            raise ValueError(f"tiktoken encoding {name!r} could not be loaded: {e}") from e
        raise ValueError(f"tokenizer {name!r} is not a file, a directory or a tiktoken encoding "
                         f"(known: {tiktoken.list_encoding_names()}); pass the path of a tokenizer.json or "
                         f"tokenizer directory, or {DEMO_TOKENIZER!r}") from None
    except Exception as e:  # a download attempt failed: offline, and not in tiktoken's cache
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
            "<tmp>/data-gym-cache"
        raise ValueError(f"tiktoken encoding {name!r} is not available offline ({type(e).__name__}): tiktoken "
                         f"downloads an encoding once and caches it in {cache} (TIKTOKEN_CACHE_DIR); load it once on "
                         "a machine with internet and copy that cache here, or pass a tokenizer.json") from None
    out = load_encoder(enc)
    out.origin = name
    return out


def _load_directory(path: str, engine: Optional[str] = None) -> Encoder:
    """``save_pretrained``'s layout: tokenizer.json, plus BOS/EOS and the chat template from
    tokenizer_config.json (or chat_template.jinja, where newer transformers put it)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"tokenizer directory {path!r} has no tokenizer.json (it holds {sorted(os.listdir(path))[:8]}); "
                         "tokenloom reads Hugging Face fast tokenizers: tokenizer.save_pretrained(dir) writes one")
    enc = load_encoder(file, engine)
    config_path = os.path.join(path, "tokenizer_config.json")
    config: Dict[str, Any] = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as e:
            raise ValueError(f"{config_path!r} is not valid JSON: {e}") from None
    enc.bos_token, enc.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    enc.chat_template = _chat_template_text(config.get("chat_template"), config_path)
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            enc.chat_template = f.read()
    for what, token in (("bos_token", enc.bos_token), ("eos_token", enc.eos_token)):
        if token is not None:
            try:
                enc.token_id(token)
            except ValueError:
                raise ValueError(f"{config_path!r}: {what}={token!r} is not a token of {file!r}; "
                                 "fix the config, or pass the tokenizer.json alone") from None
    enc.origin = path
    return enc


def _token_text(value: Any) -> Optional[str]:
    """``"<s>"`` or transformers' serialized AddedToken ``{"content": "<s>", ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template_text(value: Any, where: str) -> Optional[str]:
    """A template string, or transformers' named list ``[{"name": "default", "template": ...}]``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{where!r}: chat_template names {sorted(named, key=str)} and none is 'default'; "
                         "pass sft(template=<one of them as a .jinja file>)")
    raise ValueError(f"{where!r}: chat_template is {type(value).__name__}, expected a string")


def resolve_special(encoder: Encoder, token: Optional[Union[str, int]], *, default_bos: bool) -> Optional[int]:
    """The id for a user-given BOS/EOS (str or int), the tokenizer's own BOS, or None."""
    if token is None:
        return encoder.default_bos() if default_bos else None
    return encoder.token_id(token)
