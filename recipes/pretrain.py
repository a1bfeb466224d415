"""`pretrain(...)`: text sources in, packed fixed-shape token batches out, exactly resumable.

Graph per shard: per source ``ShardUnits -> Read -> Tokenize``, then ``Mix`` (several
sources), a packer, ``Batch``; see `recipes.packed` for the graph and the checks.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from tokenloom.pipes.check_args import check_loader_keywords
from tokenloom.pipes.loader.bridge import TokenLoomLoader
from tokenloom.pipes.loader.rank_sync import RankSync
from tokenloom.pipes.schedule import Weights
from tokenloom.pipes.sources.files import SourceSpec
from tokenloom.pipes.sources.retry import RetryPolicy

from .packed import packed_loader
from .settings import READ_BUDGET, PackedSpec


def pretrain(
    sources: Union[SourceSpec, Mapping[str, SourceSpec]],
    tokenizer: Any,
    seq_len: int = 2048,
    batch_size: int = 8,
    bos: Union[str, int, None] = None,
    weights: Optional[Weights] = None,
    packing: str = "bestfit",
    buffer_size: int = 1000,
    epochs: Optional[int] = None,
    num_workers: int = 0,
    seed: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    text_column: Union[str, Mapping[str, str]] = "text",
    eos: Union[str, int, None] = None,
    mix: str = "interleave",
    weights_unit: str = "tokens",
    stop: Optional[str] = None,
    cycle_exhausted: bool = True,
    pattern: Optional[Sequence[str]] = None,
    burst: int = 1,
    text_mode: Union[str, Mapping[str, str]] = "file",
    rank_sync: Optional[RankSync] = None,
    manifest: Union[str, Mapping[str, str], None] = None,
    predict_bos: bool = True,
    pad: Union[str, int, None] = None,
    buffer_tokens: Optional[int] = None,
    max_wait: Optional[int] = None,
    min_fill: int = 1,
    piece_rows: int = 1,
    cache: Any = None,
    cache_strict: bool = False,
    engine: Optional[str] = None,
    read_budget: Optional[int] = READ_BUDGET,
    retry: Optional[RetryPolicy] = None,
    **loader_kwargs: Any,
) -> TokenLoomLoader:
    """Build a loader of packed pretraining batches (see the README for every parameter).

    ``sources`` is one spec (path, glob, directory, URI, or a list of them) or
    ``{name: spec}``; with several names, ``weights`` (``{name: w}`` or a schedule
    ``[(step, {name: w}), ...]``) mixes them, counted in ``weights_unit``.
    Returns a `TokenLoomLoader` (a `StatefulDataLoader`): iterate it for batches,
    save ``loader.state_dict()`` with the model, and ``load_state_dict`` it into a
    loader built with the same arguments to continue with the exact next batch.
    ``text_column`` (parquet column, JSON field) and ``text_mode`` (text files: ``"file"`` or
    ``"paragraphs"``): one value for every source, or ``{name: value}`` naming each source
    (``text_column={"stories": "story", "web": "text"}``).
    ``manifest`` is the path of a parquet index ``tokenloom index --out`` wrote away from
    the data (``{name: path}`` with several sources); an index in the directory a source
    resolves under is used without it.
    ``predict_bos``: the label after every whole document's last token is the BOS id (True,
    GPT/nanochat style: the model learns where documents end) or -100 (False: nothing is
    trained across a document boundary), the same in every packing mode. ``pad``: the
    token string or id of padding ``input_ids`` (default: the BOS id). ``buffer_tokens``: the
    most tokens the best-fit buffer holds (default: 16 rows' worth; ``"bestfit-crop"``: half a row per
    document of ``buffer_size``), which bounds what a resume re-reads. ``max_wait``: the pulls a
    buffered document may wait before it starts the next rows (default: ``buffer_size``); with
    ``buffer_tokens`` it is the delay bound. ``"bestfit-crop"`` crops less the longer short
    documents may wait for a gap, and a resume re-reads more: raise both to trade resume time
    for tokens (benchmarks/RESULTS.md, "crop wait"). ``min_fill`` (``bestfit``): the least gap at a
    row's end that is filled by cutting a long document; a smaller gap is padded, so no document
    is cut into a piece shorter than ``min_fill`` at a row's end (default 1: every gap is filled).
    ``piece_rows`` (``bestfit``, several sources): a long document reaches the mixer in pieces of this many
    rows (default 1: the shares hold from the first batches); more rows cost the workers less with several
    sources (docs/performance.md, "Many sources"), the shares holding less tightly.
    ``engine``: what encodes a tokenizer.json (None: ``$TOKENLOOM_ENGINE``, else ``"auto"``, the fastest
    engine that gives `tokenizers`' ids: fastokens, tiktoken, `tokenizers`); every engine gives the same batches.
    ``cache``: the directory (path or URI) ``tokenloom tokenize --out`` wrote, or ``{name: directory}``:
    token ids are read from it instead of text, giving bitwise the same batches and states that load
    either way; a unit it lacks is tokenized (``stats()["sources"][name]["tokenized"]``), or refused
    with ``cache_strict=True``.
    ``read_budget``: bytes of decoded text a worker holds for reading, shared by the sources
    (default ``READ_BUDGET``): a parquet row group larger than ``read_budget / sources`` is decoded in
    windows of that size and shuffled within each window, each window reopening its row group (a larger
    budget: more memory, fewer decodes; None: whole row groups, memory then grows with the sources).
    ``retry``: how requests to ``https://`` and ``hf://`` sources are retried (`RetryPolicy`; None: its
    defaults).
    """
    check_loader_keywords(pretrain, loader_kwargs, also=TokenLoomLoader.USER_KEYWORDS)
    settings = {k: v for k, v in locals().items() if k in SETTINGS}
    return packed_loader(PackedSpec.of("pretrain", **settings), loader_kwargs)


#: pretrain's keywords that are settings (recipes/settings.py); the rest go to the DataLoader.
SETTINGS = frozenset(PackedSpec.keywords("pretrain"))
