"""`sft(...)`: conversations in, packed batches with a loss mask out, exactly resumable.

Conversations are ``{"messages": [{"role", "content"}, ...]}`` records in jsonl or
parquet (a list-of-struct column). Each is rendered by a chat template into token
ids and a mask that trains the assistant's tokens and their end-of-turn marker,
nothing else; ``labels`` are -100 wherever the target is not trained. The
template is the tokenizer's own (a tokenizer directory with a chat template,
rendered with Jinja2 as transformers does), else the demo tokenizer's role
tokens where the tokenizer has them, else ChatML with text markers where the
tokenizer lacks its tokens (pipes/chat.py `choose_template`). Rows are
packed best-fit with padding, so a conversation is never cut in the middle unless
it is longer than a row, which ``long_conversations`` decides and counts
(``"truncate"`` by default, ``"split"`` or ``"drop"``). Everything else is as in
`pretrain`: named sources, weights, schedules, workers, ranks, exact resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from tokenloom.pipes.chat import ChatTemplate, choose_template
from tokenloom.pipes.chat_template import JinjaTemplate
from tokenloom.pipes.check_args import check_loader_keywords
from tokenloom.pipes.loader.bridge import TokenLoomLoader
from tokenloom.pipes.loader.rank_sync import RankSync
from tokenloom.pipes.schedule import Weights
from tokenloom.pipes.sources.files import SourceSpec
from tokenloom.pipes.sources.retry import RetryPolicy
from tokenloom.pipes.tokenizer import load_encoder

from .packed import packed_loader
from .settings import READ_BUDGET, PackedSpec


def sft(
    sources: Union[SourceSpec, Mapping[str, SourceSpec]],
    tokenizer: Any,
    seq_len: int = 2048,
    batch_size: int = 8,
    template: Union[ChatTemplate, JinjaTemplate, str, Callable, None] = None,
    weights: Optional[Weights] = None,
    packing: str = "bestfit",
    buffer_size: int = 1000,
    epochs: Optional[int] = None,
    num_workers: int = 0,
    seed: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    messages_field: Union[str, Mapping[str, str]] = "messages",
    long_conversations: str = "truncate",
    mix: str = "interleave",
    weights_unit: str = "tokens",
    stop: Optional[str] = None,
    cycle_exhausted: bool = True,
    pattern: Optional[Sequence[str]] = None,
    burst: int = 1,
    rank_sync: Optional[RankSync] = None,
    manifest: Union[str, Mapping[str, str], None] = None,
    pad: Union[str, int, None] = None,
    bos: Union[str, int, None] = None,
    buffer_tokens: Optional[int] = None,
    max_wait: Optional[int] = None,
    min_fill: int = 1,
    piece_rows: int = 1,
    engine: Optional[str] = None,
    read_budget: Optional[int] = READ_BUDGET,
    retry: Optional[RetryPolicy] = None,
    **loader_kwargs: Any,
) -> TokenLoomLoader:
    """Build a loader of packed conversation batches (see the module docstring and the README).

    ``template``: None (the tokenizer's own chat template, else ``<|bos|> (<|role|> content <|end|>)*``
    where the tokenizer has those tokens, as the shipped one does, else ChatML), a `ChatTemplate`, a
    `JinjaTemplate`, ``"chatml"`` or ``"demo"``, the path of a Jinja file, a ``tokenizer_config.json``
    or a tokenizer directory, or a callable ``(messages, encoder) -> (ids, mask)``. ``bos``: a token
    string or id that replaces the template's BOS (a Jinja template's ``bos_token``). ``messages_field``:
    the field or list column of the conversations, for every source, or ``{name: field}`` naming each.
    The label after a conversation's last token is always -100 (`pretrain`'s ``predict_bos=False``):
    the template's trained end token is the stop signal, and nothing is trained across
    conversations. ``pad``: the token string or id of padding ``input_ids`` (default: 0).
    """
    check_loader_keywords(sft, loader_kwargs, also=TokenLoomLoader.USER_KEYWORDS)
    spec = PackedSpec.of("sft", **{k: v for k, v in locals().items() if k in SETTINGS}).validate()
    encoder = load_encoder(tokenizer, engine)
    chat = choose_template(template, encoder, bos)
    if hasattr(chat, "resolve"):
        chat.resolve(encoder)  # a missing token or a template that cannot give a mask fails here, not in a worker
    resolved = dataclasses.replace(spec, data=dataclasses.replace(spec.data, tokenizer=encoder),
                                   text=dataclasses.replace(spec.text, template=chat))
    return packed_loader(resolved, loader_kwargs)


#: sft's keywords that are settings (recipes/settings.py); the rest go to the DataLoader.
SETTINGS = frozenset(PackedSpec.keywords("sft"))
