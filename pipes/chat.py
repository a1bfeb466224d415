"""Conversations -> token ids and a loss mask, through a chat template.

A conversation is ``[{"role": ..., "content": ...}, ...]``. The default template
renders ``BOS`` then, per message, ``<role token> content <end token>``; the mask
marks the tokens a model is trained to produce: the assistant's content and its
end token (so it learns to stop), nothing else. Any callable
``template(messages, encoder) -> (ids, mask)`` can replace it.

`RenderChat` encodes the contents of ``batch_docs`` conversations with one
batched tokenizer call (all their messages at once) and assembles ids and masks
with numpy, so the per-token work stays in Rust and numpy.

Bad input: an unknown role raises with the source, unit and row and the roles
the template knows; an empty conversation, or one with no trained token, is
skipped and counted. Conversations longer than ``max_tokens`` (a row) follow
``long``: ``"truncate"`` (default: keep the first ``max_tokens`` tokens, count
the rest as discarded), ``"split"`` (leave it whole; the packer cuts it into
chunks that lose their context), or ``"drop"`` (skip and count it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .base import Node
from .items import Doc, TokenDoc
from .tokenizer import Encoder

log = logging.getLogger(__name__)

LONG_POLICIES = ("truncate", "split", "drop")


@dataclass
class ChatTemplate:
    """``BOS (<role> content <end>)*``; ``train_roles`` messages (and their end token) are trained.

    Tokens are given as strings (looked up in the tokenizer) or ids."""

    roles: Mapping[str, Union[str, int]] = field(default_factory=lambda: {
        "system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"})
    end: Union[str, int] = "<|end|>"
    bos: Union[str, int, None] = "<|bos|>"
    train_roles: Sequence[str] = ("assistant",)

    def resolve(self, encoder: Encoder) -> "_ResolvedTemplate":
        return _ResolvedTemplate(
            {r: encoder.token_id(t) for r, t in self.roles.items()}, encoder.token_id(self.end),
            None if self.bos is None else encoder.token_id(self.bos), frozenset(self.train_roles))


@dataclass(frozen=True)
class _ResolvedTemplate:
    roles: Dict[str, int]
    end: int
    bos: Optional[int]
    train: frozenset


class ChatError(ValueError):
    pass


def _check_messages(messages: Any, roles: Mapping[str, int], where: str) -> List[Tuple[str, str]]:
    if not isinstance(messages, list):
        raise ChatError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ChatError(f"{where}: message {k} is {m!r:.80}; each message needs 'role' and 'content'")
        role, content = m["role"], m["content"]
        if role not in roles:
            raise ChatError(f"{where}: message {k} has unknown role {role!r}; the template knows {sorted(roles)}. "
                            "Map the role, or pass a template that knows it")
        if not isinstance(content, str):
            raise ChatError(f"{where}: message {k} content is {type(content).__name__}, not text")
        out.append((role, content))
    return out


class RenderChat(Node[TokenDoc]):
    PARENT = "parent"
    EMITTED = "emitted"
    COUNTS = "counts"
    STATE_KEYS = (PARENT, EMITTED, COUNTS)
    #: Counted, never silent: conversations skipped or shortened, and tokens thrown away.
    COUNT_KEYS = ("empty", "untrained", "truncated", "dropped", "discarded_tokens")

    def __init__(self, parent: Node[Doc], encoder: Encoder, *, template: Union[ChatTemplate, Callable, None] = None,
                 max_tokens: Optional[int] = None, long: str = "truncate", batch_docs: int = 32,
                 where: Callable[[Doc], str] = lambda d: f"source {d.source!r}, unit {d.unit}, row {d.row}"):
        super().__init__()
        if long not in LONG_POLICIES:
            raise ValueError(f"{long=} is not one of {LONG_POLICIES}")
        self.parent, self.encoder, self.max_tokens, self.long = parent, encoder, max_tokens, long
        self.batch_docs, self.where = batch_docs, where
        template = template if template is not None else ChatTemplate()
        self._custom = None if isinstance(template, ChatTemplate) else template
        self._tpl = template.resolve(encoder) if isinstance(template, ChatTemplate) else None
        self._batch_state: Optional[Dict[str, Any]] = None
        self._out: List[TokenDoc] = []
        self._emitted = 0
        self._skip = 0
        self._counts = dict.fromkeys(self.COUNT_KEYS, 0)
        self._warned = False

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._out, self._emitted = [], 0
        if initial_state is None:
            self.parent.reset(None)
            self._batch_state, self._skip = None, 0
            self._counts = dict.fromkeys(self.COUNT_KEYS, 0)
        else:
            self._batch_state = initial_state[self.PARENT]
            self.parent.reset(self._batch_state)
            self._skip = int(initial_state[self.EMITTED])
            self._counts = {k: int(initial_state[self.COUNTS][k]) for k in self.COUNT_KEYS}

    # --- rendering -------------------------------------------------------------------
    def _render_default(self, docs: List[Doc]) -> List[Optional[Tuple[np.ndarray, np.ndarray]]]:
        tpl = self._tpl
        convs = [_check_messages(d.text, tpl.roles, self.where(d)) for d in docs]
        flat = [content for conv in convs for _, content in conv]
        encoded = self.encoder.encode_batch(flat) if flat else []
        out, k = [], 0
        for conv in convs:
            if not conv:
                out.append(None)
                continue
            pieces, masks = [], []
            if tpl.bos is not None:
                pieces.append(np.array([tpl.bos], np.int32))
                masks.append(np.zeros(1, bool))
            for role, _ in conv:
                ids = encoded[k]
                k += 1
                trained = role in tpl.train
                pieces.append(np.concatenate([[tpl.roles[role]], ids, [tpl.end]]).astype(np.int32))
                m = np.full(len(ids) + 2, trained, bool)
                m[0] = False  # the role token is a prompt, never a target
                masks.append(m)
            out.append((np.concatenate(pieces), np.concatenate(masks)))
        return out

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
        if self._custom is None:
            rendered = self._render_default(docs)
        else:
            rendered = [None if not d.text else self._custom(d.text, self.encoder) for d in docs]
        replay = self._skip
        out: List[TokenDoc] = []
        for d, r in zip(docs, rendered):
            # A batch re-rendered after a restore was counted when it was first rendered.
            kept = self._keep(d, r, count=replay == 0)
            if kept is not None:
                out.append(kept)
        self._out = out
        self._emitted, self._skip = replay, 0

    def _keep(self, d: Doc, r, count: bool) -> Optional[TokenDoc]:
        """Apply the skip and length policies (counting unless ``count`` is False)."""
        c = self._counts if count else dict.fromkeys(self.COUNT_KEYS, 0)
        if r is None:
            c["empty"] += 1
            self._warn(f"skipping an empty conversation at {self.where(d)} (further ones are counted)")
            return None
        ids, mask = np.asarray(r[0], np.int32), np.asarray(r[1], bool)
        if not mask.any():
            c["untrained"] += 1
            self._warn(f"skipping a conversation with nothing to train on at {self.where(d)}")
            return None
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            if self.long == "drop":
                c["dropped"] += 1
                c["discarded_tokens"] += len(ids)
                return None
            if self.long == "truncate":
                c["truncated"] += 1
                c["discarded_tokens"] += len(ids) - self.max_tokens
                ids, mask = ids[:self.max_tokens], mask[:self.max_tokens]
        return TokenDoc(ids, d.source, mask, d.epoch, d.unit, d.pos, d.used)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message)

    def next(self) -> TokenDoc:
        while self._emitted >= len(self._out):
            self._fill()
        item = self._out[self._emitted]
        self._emitted += 1
        return item

    def in_flight(self) -> List[TokenDoc]:
        """Conversations rendered but not handed on (see `Tokenize.in_flight`)."""
        if self._skip and self._emitted >= len(self._out):
            self._fill()
        return self._out[self._emitted:]

    def get_state(self) -> Dict[str, Any]:
        if self._emitted >= len(self._out):
            parent = self.parent.state_dict() if not self._skip else self._batch_state
            return {self.PARENT: parent, self.EMITTED: self._skip, self.COUNTS: dict(self._counts)}
        return {self.PARENT: self._batch_state, self.EMITTED: self._emitted, self.COUNTS: dict(self._counts)}

    def carry_counts(self, counts: Dict[str, int]) -> None:
        """Continue the counts of an elastic resume (elastic.py)."""
        self._counts = {k: int(counts[k]) for k in self.COUNT_KEYS}

    def counts(self) -> Dict[str, int]:
        return dict(self._counts)
