"""Conversations -> token ids and a loss mask, through a chat template.

A conversation is ``[{"role": ..., "content": ...}, ...]``. A `ChatTemplate`
renders ``BOS`` then, per message, ``<role marker> content <end marker>``; the
mask marks the tokens a model is trained to produce: the assistant's content and
its end marker (so it learns to stop), nothing else. A marker is template text:
the special tokens it spells become their ids and the rest is encoded as text,
so ChatML's ``<|im_start|>user\n`` is 3 tokens where the tokenizer has
``<|im_start|>`` and ~8 where it does not. A `JinjaTemplate`
(pipes/chat_template.py) renders a Hugging Face chat template instead, and any
callable ``template(messages, encoder) -> (ids, mask)`` can replace both.

`choose_template` picks the default: the tokenizer's own chat template (a
tokenizer directory's ``tokenizer_config.json``), else the demo tokenizer's role
tokens when the tokenizer has them all, else ChatML.

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
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .base import Node
from .graph import Branch
from .items import BatchInFlight, Doc, TokenDoc, take
from .chat_template import ChatError, JinjaTemplate, encode_markup
from .roles import BRANCH
from .tokenizer import Encoder, _chat_template_text, _load_directory, _token_text  # a directory's reading rules

log = logging.getLogger(__name__)

LONG_POLICIES = ("truncate", "split", "drop")


#: The demo tokenizer's chat tokens: `ChatTemplate()`.
DEMO_ROLES = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
#: Names ``template=`` accepts besides a `ChatTemplate`, a `JinjaTemplate`, a path or a callable.
TEMPLATE_NAMES = ("chatml", "demo")


@dataclass
class ChatTemplate:
    """``BOS (<role marker> content <end marker>)*``; ``train_roles`` messages (and their end marker) are trained.

    A marker is text (the special tokens it spells become their ids, the rest is encoded as
    text) or a token id; ``bos`` is one token (a string or an id) or None."""

    roles: Mapping[str, Union[str, int]] = field(default_factory=lambda: dict(DEMO_ROLES))
    end: Union[str, int] = "<|end|>"
    bos: Union[str, int, None] = "<|bos|>"
    train_roles: Sequence[str] = ("assistant",)

    @classmethod
    def chatml(cls, bos: Union[str, int, None] = None, train_roles: Sequence[str] = ("assistant",)) -> "ChatTemplate":
        """``<|im_start|>role\n content <|im_end|>\n``: single tokens where the tokenizer has them, text elsewhere."""
        return cls({r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}, "<|im_end|>\n", bos,
                   train_roles)

    def resolve(self, encoder: Encoder) -> "_ResolvedTemplate":
        markers = list(self.roles.items()) + [("", self.end)]
        bad = [(r, m) for r, m in markers if not isinstance(m, (str, int, np.integer)) or m == ""]
        if bad:
            raise ValueError(f"chat template marker {bad[0][1]!r} (role {bad[0][0] or 'end'!r}) must be text or a token id")
        text = [m for _, m in markers if isinstance(m, str)]
        encoded = dict(zip(text, encode_markup(encoder, text)))
        ids = {}
        for r, m in markers:
            try:
                ids[r] = encoded[m] if isinstance(m, str) else np.array([encoder.token_id(m)], np.int32)
            except ValueError as e:
                raise ValueError(f"chat template: {e}") from None
        end = ids.pop("")
        bos = None
        if self.bos is not None:
            try:
                bos = encoder.token_id(self.bos)
            except ValueError:
                raise ValueError(
                    f"the chat template's bos={self.bos!r} is not a token of this tokenizer "
                    f"({encoder.origin or 'vocabulary size ' + str(encoder.vocab_size)}); pass bos= a token it has, "
                    "or choose another template: template='chatml' (its markers are text where they are not "
                    "tokens), a Jinja file, or a tokenizer directory with a chat_template") from None
        return _ResolvedTemplate(ids, end, bos, frozenset(self.train_roles))


@dataclass(frozen=True)
class _ResolvedTemplate:
    roles: Dict[str, np.ndarray]
    end: np.ndarray
    bos: Optional[int]
    train: frozenset

    def render_batch(self, messages: List[List[Dict[str, Any]]], wheres: List[str], encoder: Encoder
                     ) -> List[Optional[Tuple[np.ndarray, np.ndarray]]]:
        convs = [[(m["role"], m["content"]) for m in conv] for conv in messages]
        flat = [content for conv in convs for _, content in conv]
        encoded = encoder.encode_batch(flat) if flat else []
        out, k = [], 0
        for conv in convs:
            if not conv:
                out.append(None)
                continue
            pieces, masks = [], []
            if self.bos is not None:
                pieces.append(np.array([self.bos], np.int32))
                masks.append(np.zeros(1, bool))
            for role, _ in conv:
                ids = encoded[k]
                k += 1
                head = self.roles[role]
                pieces += [head, ids, self.end]
                # the role marker is a prompt, never a target
                masks += [np.zeros(len(head), bool), np.full(len(ids) + len(self.end), role in self.train, bool)]
            out.append((np.concatenate(pieces).astype(np.int32), np.concatenate(masks)))
        return out


def choose_template(template: Any, encoder: Encoder, bos: Union[str, int, None] = None) -> Any:
    """``sft(template=...)``: a `ChatTemplate`, a `JinjaTemplate`, a callable, a name in
    `TEMPLATE_NAMES`, or the path of a Jinja file, a ``tokenizer_config.json`` or a tokenizer
    directory. None: the tokenizer's own chat template, else `ChatTemplate()` where the tokenizer
    has the demo's role tokens, else `ChatTemplate.chatml` (BOS: ``bos``, else the tokenizer
    config's). ``bos`` (a token string or id) replaces the template's BOS."""
    if template is None:
        if encoder.chat_template is not None:
            template = JinjaTemplate(encoder.chat_template, bos_token=encoder.bos_token, eos_token=encoder.eos_token,
                                     name=f"{encoder.origin or 'tokenizer'} chat_template")
        elif all(t in encoder.special_tokens() for t in [*DEMO_ROLES.values(), "<|end|>", "<|bos|>"]):
            template = ChatTemplate()
        else:
            template = ChatTemplate.chatml(bos=encoder.bos_token)
    elif isinstance(template, (str, os.PathLike)):
        template = _template_from(os.fspath(template), encoder)
    if bos is None:
        return template
    if isinstance(template, ChatTemplate):
        return replace(template, bos=bos)
    if isinstance(template, JinjaTemplate):
        try:
            token = encoder.id_to_token(encoder.token_id(bos)) if isinstance(bos, (int, np.integer)) else bos
            encoder.token_id(token)
        except ValueError as e:
            raise ValueError(f"{bos=} for the chat template {template.name!r}: {e}") from None
        return JinjaTemplate(template.source, bos_token=token, eos_token=template.eos_token,
                             train_roles=template.train_roles, name=template.name)
    raise ValueError(f"{bos=} with a callable template {template!r:.60}: the callable writes the BOS itself; "
                     "drop bos=")


def _template_from(spec: str, encoder: Encoder) -> Any:
    if spec == "chatml":
        return ChatTemplate.chatml(bos=encoder.bos_token)
    if spec == "demo":
        return ChatTemplate()
    if os.path.isdir(spec):
        d = _load_directory(spec)
        if d.chat_template is None:
            raise ValueError(f"template={spec!r}: the directory has no chat_template (tokenizer_config.json or "
                             f"chat_template.jinja); pass one of {TEMPLATE_NAMES} or a .jinja file")
        return JinjaTemplate(d.chat_template, bos_token=d.bos_token, eos_token=d.eos_token, name=spec)
    if not os.path.isfile(spec):
        raise ValueError(f"template={spec!r} is neither a template name {TEMPLATE_NAMES} nor a file: pass one of "
                         "those, a .jinja file, a tokenizer_config.json or a tokenizer directory")
    with open(spec, encoding="utf-8") as f:
        text = f.read()
    if spec.endswith(".json"):
        import json

        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"template={spec!r} is not valid JSON: {e}") from None
        source = _chat_template_text(config.get("chat_template"), spec) if isinstance(config, dict) else None
        if source is None:
            raise ValueError(f"template={spec!r} has no chat_template; pass a file that has one, a .jinja file, "
                             f"or one of {TEMPLATE_NAMES}")
        return JinjaTemplate(source, name=spec, bos_token=_token_text(config.get("bos_token")),
                             eos_token=_token_text(config.get("eos_token")))
    return JinjaTemplate(text, bos_token=encoder.bos_token, eos_token=encoder.eos_token, name=spec)


def _check_messages(messages: Any, roles: Optional[Mapping[str, Any]], where: str) -> List[Dict[str, Any]]:
    """Plain dict copies of the messages; ``roles`` None: any role (a Jinja template decides)."""
    if not isinstance(messages, list):
        raise ChatError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ChatError(f"{where}: message {k} is {m!r:.80}; each message needs 'role' and 'content'")
        role, content = m["role"], m["content"]
        if roles is not None and role not in roles:
            raise ChatError(f"{where}: message {k} has unknown role {role!r}; the template knows {sorted(roles)}. "
                            "Map the role, or pass a template that knows it")
        if not isinstance(content, str):
            raise ChatError(f"{where}: message {k} content is {type(content).__name__}, not text")
        out.append(dict(m))
    return out


class RenderChat(BatchInFlight, Branch, Node[TokenDoc]):
    """Conversations to token ids and a loss mask, rendered ``batch_docs`` at a time through a chat
    template: a `TokenDoc` (ids and mask) each (see the module docstring).

    Args:
        parent: a node of `Doc` whose text is a conversation, a list of ``{"role", "content"}``.
        encoder: the `Encoder` the contents (and the template's text markers) are encoded with.
        template: a `ChatTemplate`, a `JinjaTemplate`, or a callable
            ``template(messages, encoder) -> (ids, mask)``; None: ``ChatTemplate()``.
        max_tokens: the bound on a conversation's tokens (a row); None: no bound.
        long: what a conversation over ``max_tokens`` gets: ``"truncate"`` (default), ``"split"``
            or ``"drop"``.
        batch_docs: conversations rendered per batched tokenizer call.
        where: a `Doc` -> where it is, for messages (default: source, unit and row).

    State keys: ``PARENT`` (``"parent"``: the reader's state at the current batch's start) and
    ``EMITTED`` (``"emitted"``: conversations of that batch handed on; a restore re-renders the batch
    and skips them), both `BatchInFlight`'s, and ``COUNTS`` (the ``COUNT_KEYS`` counts: empty,
    untrained, truncated and dropped conversations, and the tokens discarded). A branch (role
    ``BRANCH``, pipes/graph.py): it carries ``COUNTS`` over an elastic resume.
    """

    ROLE = BRANCH
    COUNTS = "counts"
    STATE_KEYS = (BatchInFlight.PARENT, BatchInFlight.EMITTED, COUNTS)
    #: Counted, never silent: conversations skipped or shortened, and tokens thrown away.
    COUNT_KEYS = ("empty", "untrained", "truncated", "dropped", "discarded_tokens")

    def __init__(self, parent: Node[Doc], encoder: Encoder, *,
                 template: Union[ChatTemplate, JinjaTemplate, Callable, None] = None,
                 max_tokens: Optional[int] = None, long: str = "truncate", batch_docs: int = 32,
                 where: Callable[[Doc], str] = lambda d: f"source {d.source!r}, unit {d.unit}, row {d.row}"):
        super().__init__(parent)
        if long not in LONG_POLICIES:
            raise ValueError(f"{long=} is not one of {LONG_POLICIES}")
        self.parent, self.encoder, self.max_tokens, self.long = parent, encoder, max_tokens, long
        self.batch_docs, self.where = batch_docs, where
        template = template if template is not None else ChatTemplate()
        templated = isinstance(template, (ChatTemplate, JinjaTemplate))
        self._custom = None if templated else template
        self._tpl = template.resolve(encoder) if templated else None
        self._counts = dict.fromkeys(self.COUNT_KEYS, 0)
        self._warned = False

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._restore_batch(initial_state)
        if initial_state is None:
            self._counts = dict.fromkeys(self.COUNT_KEYS, 0)
        else:
            self._counts = {k: int(initial_state[self.COUNTS][k]) for k in self.COUNT_KEYS}

    # --- rendering -------------------------------------------------------------------
    def _render_default(self, docs: List[Doc]) -> List[Optional[Tuple[np.ndarray, np.ndarray]]]:
        roles = self._tpl.roles if isinstance(self._tpl, _ResolvedTemplate) else None
        wheres = [self.where(d) for d in docs]
        convs = [_check_messages(d.text, roles, w) for d, w in zip(docs, wheres)]
        if isinstance(self._tpl, _ResolvedTemplate):
            return self._tpl.render_batch(convs, wheres, self.encoder)
        return self._tpl.render_batch(convs, wheres)

    def _fill(self) -> None:
        self._untouched = False
        self._batch_state = self.parent.state_dict()
        docs: List[Doc] = take(self.parent, self.batch_docs)
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

    # --- the branch protocol (pipes/graph.py): what an elastic resume carries -----------------
    COUNTERS = "chat"

    def counters(self) -> Dict[str, int]:
        return self.counts()

    def counters_as_ints(self) -> List[int]:
        return [int(self._counts[k]) for k in self.COUNT_KEYS]

    def counters_from_ints(self, ints: Sequence[int]) -> Dict[str, int]:
        return dict(zip(self.COUNT_KEYS, map(int, ints)))

    def carry(self, counters: Dict[str, int]) -> None:
        self.carry_counts(counters)
