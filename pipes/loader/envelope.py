"""The envelope of a loader state: one JSON text per data rank, versioned and digested.

``loader.state_dict()`` is ``{"tokenloom_rank_<rank>": <JSON text>}``: the text holds the meta
(``META``: format, version, the configuration a resume must match, the round and statistics), the
inner StatefulDataLoader state (``LOADER``), and a digest over both (``DIGEST``). `decode_state`
checks the digest and that the key names the rank inside; an edited, damaged or stitched state is a
`ValueError`. See docs/state.md for the layout.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Mapping, Optional, Tuple

#: Bumped whenever the layout of a saved state changes incompatibly.
#: 2: per-source skipped counts in the statistics; best-fit max_wait = buffer_size.
#: 3: the round's phase (data / padding / over) is saved.
#: 4: the best-fit buffer ramps up and is bounded in tokens (buffer_tokens); crop starts rows with long documents.
#: 5: no segment starts in a row's label slot (flat, bestfit); the run's history (lineage) is saved.
#: 6: packers record their save point (pack/savepoint.py): an elastic resume reads no old shard again.
#: 7: with several sources, bestfit mixes long documents in pieces (pieces.py): a Pieces node above each branch.
#: 8: bestfit re-reads a document that came in pieces from its latest piece (its ``repull`` key), so its replay
#:    window no longer reaches back to the first piece.
STATE_VERSION = 8
#: The versions a loader loads: a version-7 state is a version-8 one without ``repull`` (re-read as it was saved).
STATE_VERSIONS_READ = (7, 8)
STATE_FORMAT = "tokenloom.loader"

#: The keys of the envelope's body: the meta and the inner StatefulDataLoader state.
META, LOADER = "tokenloom", "loader"
#: The keys of the meta: the format and version, the configuration a resume must match, the round, the
#: statistics seen per worker, the padding batches (over the run and in this round), the loop's batches
#: with data in this round, the counters of finished rounds, the round's phase, an elastic resume's plan
#: (None without one) and the run's history (see docs/state.md).
FORMAT, VERSION, CONFIG, ROUND, STATS = "format", "version", "config", "round", "stats"
PADDING_BATCHES, ROUND_PADDING, STEPS, EARLIER = "padding_batches", "round_padding", "steps", "earlier_rounds"
PHASE, ELASTIC, LINEAGE = "phase", "elastic", "lineage"
#: The phases of a round: this rank still has data; its data ended and it yields padding batches until
#: every rank's has (rank_sync); the round has ended.
DATA, PADDING, OVER = "data", "padding", "over"


#: The key of a loader's entry in its state dict: ``tokenloom_rank_<data rank>``.
KEY_PREFIX = "tokenloom_rank_"
DIGEST = "digest"


def lineage_of(*parts: Any) -> str:
    """A run history's id, derived from what it continued (the states' digests, the new topology
    or weights): every new rank loads the same list, so all derive the same id."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def digest_of(meta: Any, inner: Any) -> str:
    text = json.dumps([meta, inner], sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def encode_state(state: Mapping[str, Any], rank: int) -> Dict[str, str]:
    """The loader state as one JSON text under ``tokenloom_rank_<rank>``, with a digest.

    Why one text and not the nested dict: ``torch.distributed.checkpoint`` flattens a
    nested dict into one entry per leaf and keeps a single copy of every entry whose key
    is the same on all ranks (it takes them for replicated values), so the ranks' positions
    were mixed leaf by leaf; and a load asks the fresh loader for the structure to fill,
    which is not the saved one. One entry per data rank is stored and loaded whole. The
    digest (sha256 over the state) refuses a state that was edited or stitched together.
    Cost: a JSON dump and a hash per call (docs/performance.md).
    """
    meta, inner = state[META], state[LOADER]
    body = {META: meta, LOADER: inner, DIGEST: digest_of(meta, inner)}
    return {f"{KEY_PREFIX}{int(rank)}": json.dumps(body, separators=(",", ":"), allow_nan=False)}


def decode_state(state: Any) -> Dict[str, Any]:
    """The nested state (``{"tokenloom": ..., "loader": ...}``) from what ``state_dict()``
    returned, checking its digest; a nested state passes through unchanged."""
    return decode_with_digest(state)[0]


def decode_with_digest(state: Any) -> Tuple[Dict[str, Any], Optional[str]]:
    """`decode_state` and the digest it checked (None for a nested state, which has none)."""
    if isinstance(state, Mapping) and META in state and LOADER in state:
        return dict(state), None
    entries = {k: v for k, v in state.items() if str(k).startswith(KEY_PREFIX)} if isinstance(state, Mapping) else {}
    if len(entries) != 1 or len(state) != 1:
        what = f"keys {sorted(state)}" if isinstance(state, Mapping) else f"a {type(state).__name__}"
        raise ValueError(f"not a tokenloom loader state ({what}); pass the dict returned by loader.state_dict() "
                         f"(one key '{KEY_PREFIX}<rank>'), or for an elastic resume the list of every rank's")
    (key, text), = entries.items()
    try:
        body = json.loads(text) if isinstance(text, (str, bytes)) else None
    except json.JSONDecodeError as e:
        raise ValueError(f"loader state {key!r} is not valid JSON ({e}); the checkpoint is damaged") from e
    if not isinstance(body, dict) or set(body) != {META, LOADER, DIGEST}:
        raise ValueError(f"loader state {key!r} holds {type(body).__name__} {sorted(body) if isinstance(body, dict) else ''}, "
                         "not a tokenloom state; pass the dict returned by loader.state_dict()")
    meta, inner = body[META], body[LOADER]
    if digest_of(meta, inner) != body[DIGEST]:
        raise ValueError(f"loader state {key!r} does not match its digest: it was edited, damaged, or stitched "
                         "together from several ranks' states; load each rank's own state_dict() unchanged")
    config = meta.get(CONFIG, {}) if isinstance(meta, Mapping) else {}
    if isinstance(config, Mapping) and "rank" in config and key != f"{KEY_PREFIX}{config['rank']}":
        raise ValueError(f"loader state {key!r} holds the state of rank {config['rank']}; it was stored under "
                         "another rank's key")
    return {META: meta, LOADER: inner}, body[DIGEST]
