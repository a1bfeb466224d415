"""One small interface over the tokenizers users have: a ``tokenizer.json`` path,
a `tokenizers.Tokenizer`, or a `tiktoken.Encoding`.

`Encoder` is what nodes hold. It pickles as the tokenizer's serialized form (a
JSON string or a tiktoken encoding name), so a loader worker rebuilds it
locally and nothing heavy crosses the process boundary beyond that text.

Its fingerprint guards resumes: a state saved with one vocabulary is refused by
a loader built with another. For a Hugging Face tokenizer it hashes the canonical
serialization, ``Tokenizer.from_str(json).to_str()`` (compact, the library's own
field order), so a path, the loaded object and a re-saved or re-indented copy of
the same tokenizer agree, and any change of vocabulary, merges, normalizer,
special tokens or truncation differs. It costs one extra serialization: 3 ms for
the shipped 4096-id tokenizer.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, List, Optional, Sequence, Union

import numpy as np

#: Tokens tried, in order, when the user does not name a BOS.
BOS_CANDIDATES = ("<|bos|>", "<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>", "[CLS]", "<|im_start|>")


class Encoder:
    """Batched text -> int32 numpy arrays, plus the few facts the loader needs."""

    def __init__(self, kind: str, payload: str, fingerprint: str, tiktoken_obj: Any = None):
        self.kind = kind  # "hf" | "tiktoken"
        self._payload = payload
        self.fingerprint = fingerprint
        self._tok: Any = tiktoken_obj
        # What encodes: a byte-level BPE tokenizer.json runs on tiktoken where its ids are the same (tiktoken_bpe).
        self.engine = "tiktoken" if kind == "tiktoken" else "tokenizers"
        self.engine_note = "a tiktoken.Encoding" if kind == "tiktoken" else ""

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
        if self.engine == "tiktoken" and self.kind == "hf":  # a worker rebuilds the Encoding from the payload, once
            from . import tiktoken_bpe

            return tiktoken_bpe.encode_batch(tiktoken_bpe.encoding(self._payload), texts)
        if self.kind == "hf":
            encs = self.tok.encode_batch_fast(list(texts), add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encs]
        out = self.tok.encode_ordinary_batch(list(texts))
        return [np.asarray(ids, dtype=np.int32) for ids in out]

    def token_id(self, token: Union[str, int]) -> int:
        """The id of a token given as a string or an int; `ValueError` if unknown."""
        if isinstance(token, (int, np.integer)):
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(f"token id {token=} is outside the vocabulary (size {self.vocab_size})")
            return int(token)
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

    def default_bos(self) -> int:
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
        return int(self.tok.get_vocab_size()) if self.kind == "hf" else int(self.tok.n_vocab)

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


def _pick_engine(enc: Encoder) -> Encoder:
    """tiktoken for a byte-level BPE tokenizer.json where it gives the same ids, else tokenizers;
    `Encoder.engine_note` says why (shown in the run summary)."""
    from . import tiktoken_bpe

    fast, enc.engine_note = tiktoken_bpe.choose(enc._payload, enc.tok)
    enc.engine = "tokenizers" if fast is None else "tiktoken"
    return enc


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def load_encoder(tokenizer: Any) -> Encoder:
    """Accept a path to ``tokenizer.json``, a `tokenizers.Tokenizer`, a `tiktoken.Encoding`,
    or an `Encoder`; raise `ValueError` naming the path when it cannot be loaded."""
    if isinstance(tokenizer, Encoder):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        try:
            with open(path, encoding="utf-8") as f:
                payload = f.read()
            from tokenizers import Tokenizer

            tok = _as_data_tokenizer(Tokenizer.from_str(payload))
        except FileNotFoundError as e:
            raise ValueError(f"tokenizer file {path!r} does not exist; pass the path of a tokenizer.json") from e
        except Exception as e:
            raise ValueError(f"cannot load tokenizer from {path!r}: {e}. "
                             "Expected a Hugging Face tokenizers JSON file (tokenizer.json)") from e
        canonical = tok.to_str()  # the special-token switch is not serialized
        enc = Encoder("hf", canonical, _hash(canonical))
        enc._tok = tok
        return _pick_engine(enc)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        Tokenizer = None
    if Tokenizer is not None and isinstance(tokenizer, Tokenizer):
        # Re-read, so the payload is in canonical form whatever the object went through; the worker's
        # copy is built from it, so switching special-token handling never changes the caller's object.
        payload = Tokenizer.from_str(tokenizer.to_str()).to_str()
        return _pick_engine(Encoder("hf", payload, _hash(payload)))
    if type(tokenizer).__module__.startswith("tiktoken") and hasattr(tokenizer, "encode_ordinary_batch"):
        name = getattr(tokenizer, "name", "tiktoken")
        return Encoder("tiktoken", name, _hash(f"tiktoken:{name}:{tokenizer.n_vocab}"), tiktoken_obj=tokenizer)
    raise TypeError(
        f"unsupported tokenizer {type(tokenizer).__name__}; pass a path to tokenizer.json, "
        "a tokenizers.Tokenizer or a tiktoken.Encoding"
    )


def resolve_special(encoder: Encoder, token: Optional[Union[str, int]], *, default_bos: bool) -> Optional[int]:
    """The id for a user-given BOS/EOS (str or int), the tokenizer's own BOS, or None."""
    if token is None:
        return encoder.default_bos() if default_bos else None
    return encoder.token_id(token)
