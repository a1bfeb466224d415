"""The tokenizer node: documents in, int32 token arrays (BOS first, optional EOS) out.

Documents are encoded with the tokenizer's batched call (``encode_batch_fast``
for Hugging Face tokenizers, which runs in Rust without the GIL), a batch being
``batch_docs`` documents (64) or ``batch_chars`` characters (32,768), whichever
comes first. A call's own cost, beyond its documents, is small next to encoding
``batch_docs`` short ones. The character bound keeps one call short when documents
are long (whole source files, say): a batch of ``batch_docs`` of those would be a long
call in which the worker produces nothing, and such bursts are what a training loop
waits on when a worker's queue is short.

State is a position, not the encoded batch: the upstream state taken just before
the batch was read, plus how many documents of the batch were handed out. A
restore re-reads and re-encodes that one batch (at most ``batch_docs``
documents) and skips what was already emitted.

A batch's documents are slices of one int32 buffer, made by one ``np.concatenate``
of their ids and BOS/EOS, instead of an allocation and two copies per document; that
matters most from the token cache, where a document costs little else (figures in
docs/performance.md). The trade-off: a buffer (at most ``batch_docs`` documents or about
``batch_chars`` characters of ids) lives while any of its documents waits in the packer;
measured over many cached batches, a worker's memory is the same as with one array per
document (docs/performance.md).

A document read from a token cache (pipes/sources/cache.py) arrives as
`Pretokenized` ids instead of text: it is not encoded, only given its BOS/EOS,
so it becomes the very array encoding its text would give. Its ``len()`` is its
text's length in characters, so batches are cut where they would be for the text
and the state is the same position with or without a cache. The state also
counts the documents encoded from text (``encoded``: all of them without a
cache; with one, those of units missing from it), as of the batch start.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from .base import Node
from .graph import Branch
from .items import BatchInFlight, Doc, TokenDoc
from .roles import BRANCH
from .tokenizer import Encoder


class Pretokenized:
    """A document's token ids (no BOS/EOS) in place of its text, and the text's length in
    characters (its ``len()``, what `Tokenize` counts toward ``batch_chars``)."""

    __slots__ = ("ids", "chars")

    def __init__(self, ids: np.ndarray, chars: int):
        self.ids, self.chars = ids, chars

    def __len__(self) -> int:
        return self.chars


class Tokenize(BatchInFlight, Branch, Node[TokenDoc]):
    """Documents to token ids, encoded in batches: ``[bos] ids [eos]`` per document, a `TokenDoc` each.

    Args:
        parent: a node of `Doc` (a reader); a ``Pretokenized`` text (a token cache) is passed through.
        encoder: the `Encoder` that turns texts into ids.
        bos, eos: token ids put before and after every document (None: none).
        batch_docs, batch_chars: a batch ends at this many documents or characters.

    State keys: ``PARENT`` (``"parent"``: the reader's state at the current batch's start) and
    ``EMITTED`` (``"emitted"``: documents of that batch handed on; a restore re-reads the batch and
    skips them), both `BatchInFlight`'s, and ``ENCODED`` (documents encoded from text so far). A
    branch (role ``BRANCH``, pipes/graph.py): it carries ``ENCODED`` over an elastic resume.
    """

    ROLE = BRANCH
    ENCODED = "encoded"
    STATE_KEYS = (BatchInFlight.PARENT, BatchInFlight.EMITTED, ENCODED)

    def __init__(self, parent: Node[Doc], encoder: Encoder, *, bos: Optional[int], eos: Optional[int] = None,
                 batch_docs: int = 64, batch_chars: int = 32_768):
        super().__init__(parent)
        if batch_docs < 1 or batch_chars < 1:
            raise ValueError(f"{batch_docs=} and {batch_chars=} must be >= 1")
        self.parent, self.encoder, self.bos, self.eos, self.batch_docs = parent, encoder, bos, eos, batch_docs
        self.batch_chars = batch_chars
        self._encoded = 0  # documents encoded from text so far
        self._encoded_before = 0  # ... before the current batch

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._restore_batch(initial_state)
        self._encoded = 0 if initial_state is None else int(initial_state[self.ENCODED])
        self._encoded_before = self._encoded

    def _fill(self) -> None:
        self._untouched = False
        self._batch_state = self.parent.state_dict()
        docs: List[Doc] = []
        chars = 0
        # A restore must re-read at least the documents the saved batch had handed out.
        while len(docs) < self._skip or (len(docs) < self.batch_docs and chars < self.batch_chars):
            try:
                doc = self.parent.next()
            except StopIteration:
                break
            docs.append(doc)
            chars += len(doc.text)
        if not docs:
            raise StopIteration
        texts = [d.text for d in docs if not isinstance(d.text, Pretokenized)]
        encoded = iter(self.encoder.encode_batch(texts) if texts else ())
        self._encoded_before, self._encoded = self._encoded, self._encoded + len(texts)
        # One buffer for the batch, [BOS] ids [EOS] per document, each document a slice of it
        # (see the module docstring).
        bos = None if self.bos is None else np.array([self.bos], np.int32)
        eos = None if self.eos is None else np.array([self.eos], np.int32)
        pieces: List[np.ndarray] = []
        sizes = []
        for d in docs:
            t = d.text.ids if isinstance(d.text, Pretokenized) else next(encoded)
            if bos is not None:
                pieces.append(bos)
            pieces.append(t)
            if eos is not None:
                pieces.append(eos)
            sizes.append(len(t))
        extra = (bos is not None) + (eos is not None)
        flat = np.concatenate(pieces, dtype=np.int32, casting="unsafe")
        out = []
        at = 0
        for d, n in zip(docs, sizes):
            end = at + n + extra
            out.append(TokenDoc(flat[at:end], d.source, None, d.epoch, d.unit, d.pos, d.used))
            at = end
        self._out = out
        self._emitted, self._skip = self._skip, 0

    def next(self) -> TokenDoc:
        if self._emitted >= len(self._out):
            self._fill()
            if self._emitted >= len(self._out):  # a restore skipped the whole batch
                self._out = []
                return self.next()
        item = self._out[self._emitted]
        self._emitted += 1
        return item


    @property
    def encoded(self) -> int:
        """Documents encoded from text so far (restored with the state); recipes show it per
        source as ``tokenized`` in ``loader.stats()``."""
        return self._encoded

    def carry_encoded(self, encoded: int) -> None:
        """Continue the encoded count of an elastic resume (elastic.py)."""
        self._encoded = self._encoded_before = int(encoded)

    # --- the branch protocol (pipes/graph.py): what an elastic resume carries -----------------
    COUNTERS = "encoded"

    def counters(self) -> int:
        return self._encoded

    def counters_as_ints(self) -> List[int]:
        return [int(self._encoded)]

    def counters_from_ints(self, ints: List[int]) -> int:
        return int(ints[0])

    def carry(self, counters: int) -> None:
        self.carry_encoded(counters)

    def state_before_last(self) -> Dict[str, Any]:
        """The state as if the last document handed on had not been: its batch's start and one fewer
        handed on (a restore re-reads the batch and hands it on again). pieces.py keeps a long document's
        position so, instead of taking a state before every document."""
        if self._emitted < 1:
            raise RuntimeError("Tokenize.state_before_last: no document of the current batch was handed on yet")
        return {self.PARENT: self._batch_state, self.EMITTED: self._emitted - 1, self.ENCODED: self._encoded_before}

    def get_state(self) -> Dict[str, Any]:
        if self._emitted >= len(self._out):
            # At a batch boundary the next batch starts where the parent stands now.
            return {self.PARENT: self.parent.state_dict() if not self._skip else self._batch_state,
                    self.EMITTED: self._skip, self.ENCODED: self._encoded}
        return {self.PARENT: self._batch_state, self.EMITTED: self._emitted, self.ENCODED: self._encoded_before}
