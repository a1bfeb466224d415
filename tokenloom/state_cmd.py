"""``tokenloom state FILE``: a saved loader state, printed for a person.

A state is ``loader.state_dict()``: ``{"tokenloom": envelope, "loader": what
StatefulDataLoader saved}``. The envelope holds the format version, the
configuration a resume must match, the round, the batches handed to the loop
and each worker's statistics; the loader part holds one node-state tree per
worker (under ``_snapshot/_worker_snapshots/worker_i``, or directly under
``fetcher_state`` with 0 workers). The tree mirrors the graph (batcher ->
packer -> mixer -> per source tokenizer -> reader -> sharder), so each node is
recognised by its class's ``STATE_KEYS`` and summarized: batches built, the
packer's buffer, and per source the epoch, work slice and row. Positions under
the packer are its restore point, not the live read position: a packer saves
where its buffered documents came from and replays from there on load. A state is
small, positions and counters (docs/cli.md shows an example); ``--json`` prints it whole.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Mapping, Optional

from tokenloom.pipes.batch import Batch
from tokenloom.pipes.compat.torchdata import last_yielded_worker
from tokenloom.pipes.chat import RenderChat
from tokenloom.pipes.loader.elastic import unpack_slices, worker_trees
from tokenloom.pipes.sources.fingerprint import fingerprint_summary
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.pack.bestfit import BestFitPack
from tokenloom.pipes.pack.flat import FlatPack
from tokenloom.pipes.sources.parquet import ReadParquet
from tokenloom.pipes.schedule import normalize_schedule
from tokenloom.pipes.shard import ShardUnits
from tokenloom.pipes.stats import format_stats
from tokenloom.pipes.sources.text_files import ReadText
from tokenloom.pipes.tokenize import Tokenize
from tokenloom.recipes.packed_graph import stat_keys
from tokenloom.recipes.packed_stats import PackedStatsView

from .state_file import load_state

# Node kinds by their exact state keys (ReadJsonl shares ReadParquet's keys).
KINDS = {
    frozenset(Batch.STATE_KEYS): "batch",
    frozenset(BestFitPack.STATE_KEYS): "bestfit",
    frozenset(FlatPack.STATE_KEYS): "flat",
    frozenset(Mix.STATE_KEYS): "mix",
    frozenset(Tokenize.STATE_KEYS): "tokenize",
    frozenset(RenderChat.STATE_KEYS): "chat",
    frozenset(ReadParquet.STATE_KEYS): "reader",
    frozenset(ReadText.STATE_KEYS): "reader",
    frozenset(ShardUnits.STATE_KEYS): "shard",
}


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("state", parents=[common], help="print a saved loader state for a person",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a file torch.save(loader.state_dict()) wrote (or a checkpoint holding one)")
    p.add_argument("--json", action="store_true", help="print the whole state as JSON instead")
    p.set_defaults(run=show_state)


def kind(node: Any) -> Optional[str]:
    return KINDS.get(frozenset(node)) if isinstance(node, Mapping) else None


def branch_position(node: Any) -> str:
    """Where one source's branch (tokenizer -> reader -> sharder) stands."""
    epoch = slices = row = skipped = emitted = None
    while isinstance(node, Mapping):
        k = kind(node)
        if k in ("tokenize", "chat"):
            emitted = node["emitted"]
        elif k == "reader":
            row, skipped = node["row"], node.get("skipped", 0)
        elif k == "shard":
            epoch, slices = node["epoch"], node["index"]
        node = node.get("parent")
    parts = []
    if epoch is not None:
        parts.append(f"epoch {epoch}, {slices} work slice{'' if slices == 1 else 's'} started" if slices else f"epoch {epoch}, at its start")
    if row is not None and slices:
        parts.append(f"row {row} of the last" + (f" ({skipped} skipped)" if skipped else ""))
    if emitted:
        parts.append(f"+{emitted} document{'' if emitted == 1 else 's'} from the encode batch starting there")
    return ", ".join(parts) or "?"


def worker_lines(worker: int, tree: Any, names: List[str]) -> List[str]:
    """A few lines for one worker's node tree."""
    if not isinstance(tree, Mapping) or "node" not in tree:
        return [f"  worker {worker}: no graph state (the loader had not started this worker)"]
    node, batch, packer, mix = tree["node"], None, None, None
    while isinstance(node, Mapping):
        k = kind(node)
        if k == "batch":
            batch = node
        elif k in ("bestfit", "flat"):
            packer = (k, node)
        elif k == "mix":
            mix = node
            break
        elif k in ("tokenize", "chat"):
            break
        node = node.get("parent")
    head = f"  worker {worker}: round {tree.get('round', 0)}"
    if batch is not None:
        head += f", {batch['clock']['batches']} batches built"
    lines = [head]
    if packer is not None:
        mode, p = packer
        if mode == "flat":
            lines.append(f"    packer flat: {p['offset']} tokens into the current document")
        else:
            buffered = len(p["live"])
            lines.append(f"    packer bestfit: {p['pulled']} documents pulled, {buffered} buffered"
                         + (", stream ended" if p["ended"] else "")
                         + f"; restore point at pull {p['base']} (a load replays {p['pulled'] - p['base']})")
    if mix is not None:
        for i, name in enumerate(mix["children"]):
            lines.append(f"    {name:<12} {mix['tokens'][i]:,} tokens, {mix['documents'][i]:,} documents picked, "
                         f"pass {mix['passes'][i]}; {branch_position(mix['children'][name])}")
    elif node is not None:
        lines.append(f"    {(names or ['source'])[0]:<12} {branch_position(node)}")
    return lines


def shaped_stats(meta: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The statistics as ``loader.stats()`` would return them, rebuilt from the envelope
    (the same sum over workers and finished rounds; a source's epochs are the least any worker
    completed, as the loader's ``stats_min_keys`` say); None for other loaders or layouts."""
    config = meta["config"]
    if "sources" not in config:
        return None
    names = list(config["sources"])
    keys = stat_keys(names, config.get("chat") is not None)
    vectors = [meta["earlier_rounds"], *meta["stats"].values()]
    if any(len(v) != len(keys) for v in vectors):
        return None  # saved by a tokenloom that counted other things; --json shows the raw vectors
    workers = list(meta["stats"].values())
    totals = dict(zip(keys, meta["earlier_rounds"]))
    for i, k in enumerate(keys):
        column = [vec[i] for vec in workers]
        if column:
            totals[k] += min(column) if k.endswith("/epochs") else sum(column)
    schedule = config.get("weights") or normalize_schedule(None, names)
    return PackedStatsView(names, schedule)(totals, meta["steps"])


def config_lines(config: Mapping[str, Any]) -> List[str]:
    c = dict(config)
    rows = []

    def row(label: str, text: str) -> None:
        rows.append((label, text))

    if "world_size" in c:
        row("ranks", f"world size {c.pop('world_size')}, rank {c.pop('rank', 0)}")
    if "seq_len" in c:
        buffer = c.pop("buffer_size", None)
        row("batches", f"{c.pop('num_workers', 0)} workers, seq_len {c.pop('seq_len')}, "
                       f"batch size {c.pop('batch_size')}, packing {c.pop('packing')}"
                       + (f" (buffer {buffer})" if buffer is not None else "")
                       + f", seed {c.pop('seed')}, epochs {c.pop('epochs')}")
    if "tokenizer" in c:
        row("tokenizer", str(c.pop("tokenizer")))
    sources = c.pop("sources", None) or {}
    for i, (name, fp) in enumerate(sources.items()):
        row("sources" if i == 0 else "", f"{name:<12} {fingerprint_summary(fp)}")
    weights = c.pop("weights", None)
    if weights:
        for i, (step, w) in enumerate(weights):
            row("weights" if i == 0 else "", f"from step {step}: " + ", ".join(f"{n} {x:.3f}" for n, x in w.items()))
    for key, value in c.items():  # mix, chat, and anything another recipe records
        if value is not None:
            row(key, str(value))
    # labels in one column, at least two spaces from their values (source_order is 12 characters)
    width = max([12] + [len(label) + 2 for label, _ in rows])
    return [f"  {label:<{width}}{text}" for label, text in rows]


def show_state(args: argparse.Namespace) -> int:
    state = load_state(args.file, "state")
    if args.json:  # the decoded state: the nested dict, not the JSON text it is stored as
        print(json.dumps(state, indent=1, default=repr))
        return 0
    meta, inner = state["tokenloom"], state["loader"]
    config = meta.get("config", {})
    lines = [f"loader state  {args.file} ({os.path.getsize(args.file) / 1024:.1f} KiB on disk)",
             f"format        {meta.get('format')} version {meta.get('version')}",
             "configuration (a resume must match it)"]
    lines += config_lines(config)
    lines.append("progress")
    lines.append(f"  round {meta['round']}, {meta['steps']} batches handed to the training loop"
                 + (f", {meta['padding_batches']} padding batches" if meta.get("padding_batches") else ""))
    phase = meta.get("phase")
    if phase == "over":
        lines.append("  saved after the round ran to its end: a resume starts the next round")
    elif phase == "padding":
        lines.append("  this rank's data had ended; a resume yields padding batches until every rank's has")
    last = last_yielded_worker(inner)
    if last is not None and config.get("num_workers"):
        lines.append(f"  the next batch comes from worker {(last + 1) % config['num_workers']}")
    elastic = meta.get("elastic")
    if elastic is not None:
        left = {w: sum(len(unpack_slices(src["prefix"])) for src in plan["sources"].values())
                for w, plan in elastic["shards"].items()}
        lines.append(f"  continued from a run of another shape (elastic resume in round {elastic['round']} at step "
                     f"{next(iter(elastic['shards'].values()))['step']}); slices handed over per worker: {left}")
    names = list(config.get("sources") or [])
    if not inner:
        lines.append("workers: not started when saved (a resume starts the round)")
    else:
        lines.append("workers (positions below the packer are its restore point)")
        for worker, tree in sorted(worker_trees(inner).items()):
            lines += worker_lines(worker, tree, names)
    stats = shaped_stats(meta)
    if stats is not None:
        lines.append("stats (summed over workers, as the training loop saw them)")
        lines += ["  " + line for line in format_stats(stats).splitlines()]
    elif meta.get("stats"):
        lines.append("stats: not in this tokenloom's layout (another version or recipe); --json shows them raw")
    print("\n".join(lines))
    return 0
