"""The tokenizer node: documents in, int32 token arrays (BOS first, optional EOS) out.

Documents are encoded ``batch_docs`` at a time with the tokenizer's batched call
(``encode_batch_fast`` for Hugging Face tokenizers, which runs in Rust without
the GIL); one call per 64 documents amortises the Python overhead to well under
1% of encoding time.

State is a position, not the encoded batch: the upstream state taken just before
the batch was read, plus how many documents of the batch were handed out. A
restore re-reads and re-encodes that one batch (at most ``batch_docs``
documents) and skips what was already emitted.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from .base import Node
from .items import Doc, TokenDoc
from .tokenizer import Encoder


class Tokenize(Node[TokenDoc]):
    PARENT = "parent"
    EMITTED = "emitted"
    STATE_KEYS = (PARENT, EMITTED)

    def __init__(self, parent: Node[Doc], encoder: Encoder, *, bos: Optional[int], eos: Optional[int] = None,
                 batch_docs: int = 64):
        super().__init__()
        if batch_docs < 1:
            raise ValueError(f"{batch_docs=} must be >= 1")
        self.parent, self.encoder, self.bos, self.eos, self.batch_docs = parent, encoder, bos, eos, batch_docs
        self._batch_state: Optional[Dict[str, Any]] = None
        self._out: List[TokenDoc] = []
        self._emitted = 0
        self._skip = 0

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._out, self._emitted = [], 0
        if initial_state is None:
            self.parent.reset(None)
            self._batch_state, self._skip = None, 0
        else:
            self._batch_state = initial_state[self.PARENT]
            self.parent.reset(self._batch_state)
            self._skip = int(initial_state[self.EMITTED])

    def _fill(self) -> None:
        self._batch_state = self.parent.state_dict()
        docs: List[Doc] = []
        for _ in range(self.batch_docs):
            try:
                docs.append(next(self.parent))
            except StopIteration:
                break
        if not docs:
            raise StopIteration
        ids = self.encoder.encode_batch([d.text for d in docs])
        head = 0 if self.bos is None else 1
        tail = 0 if self.eos is None else 1
        out = []
        for d, t in zip(docs, ids):
            arr = np.empty(len(t) + head + tail, dtype=np.int32)
            if head:
                arr[0] = self.bos
            arr[head:head + len(t)] = t
            if tail:
                arr[-1] = self.eos
            out.append(TokenDoc(arr, d.source, None, d.epoch))
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

    def get_state(self) -> Dict[str, Any]:
        if self._emitted >= len(self._out):
            # At a batch boundary the next batch starts where the parent stands now.
            return {self.PARENT: self.parent.state_dict() if not self._skip else self._batch_state,
                    self.EMITTED: self._skip}
        return {self.PARENT: self._batch_state, self.EMITTED: self._emitted}
