"""What `pretrain` and `sft` report: `PackedStatsView` shapes the loader's summed counters into
packing figures, per-source shares and the round's progress (``loader.stats()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from tokenloom.pipes.pack.stats import PACK_STAT_KEYS

from .packed_graph import TOKENIZED


@dataclass
class PackedStatsView:
    """Shapes the loader's summed counters: packing figures at the top level, and per
    source tokens, documents, epochs, the target share at the current step, and the
    observed token share.

    Progress (issue 14): a finite epoch has no length, so the view says how far the round
    is. A source's ``passes`` is the rows it delivered in this round (document starts in
    batches plus rows skipped when read) over the rows this rank owns per pass (``rows``,
    exact from the shard bounds); ``progress["fraction"]`` combines them by the mixer's stop
    rule (never decreases, 1.0 at the round's last batch) and ``progress["batches_left"]``
    estimates the rest from tokens (see `_progress`; its accuracy, measured by
    tests/test_progress.py, is in docs/performance.md).
    """

    names: List[str]
    schedule: list
    #: Per source, the rows this rank reads in one pass (None: unknown, as in `tokenloom state`).
    rows: Optional[Dict[str, int]] = None
    epochs: Optional[int] = None
    stop: str = "never"
    cycle_exhausted: bool = True
    #: The sources the mixer can pick (a source never picked does not hold the stream open).
    active: Optional[List[str]] = None
    #: The loader passes this round's counters (``current=``) and whether this rank's data ended.
    takes_round = True

    @staticmethod
    def rank_rows(total_rows: int, rank: int, world_size: int, num_workers: int) -> int:
        """Rows of one pass read by this rank's shards ``rank*N .. rank*N + N - 1``: shard g owns
        ``[g*R//S, (g+1)*R//S)`` (pipes/shard.py), so the rank owns a contiguous block of them."""
        n = max(num_workers, 1)
        s = world_size * n
        return (rank + 1) * n * total_rows // s - rank * n * total_rows // s

    @staticmethod
    def pickable(names: List[str], schedule: list, mix: str, pattern: Optional[Sequence[str]]) -> List[str]:
        """The sources the mixer ever picks (`Mix._participates`): in the pattern, or weighted in some era."""
        if mix == "alternating" and pattern:
            return [n for n in names if n in pattern]
        if mix in ("interleave", "random"):
            return [n for n in names if any(w[n] > 0 for _, w in schedule)]
        return list(names)

    def _progress(self, current: Mapping[str, int], passes: Dict[str, float], steps: int,
                  ended: bool) -> Dict[str, Any]:
        """The round's fraction of rows delivered and the batches left, by the stop rule (pipes/mix.py).

        Batches follow tokens, not rows: the rows still to come are guessed at the tokens per
        row *read* so far, per source in proportion to what each delivered. Delivered rows alone
        lag while the packer holds documents back (best-fit hands out long ones first). The token guess is exact once the packer holds the rest, and may step back a
        little when a long document is read, so only ``fraction`` is promised never to drop.
        With cycling (or first_exhausted) the ending source's delivered rows decide, scaled by
        the same held-back correction: a source whose documents all still sit in the packer
        (buffer_size near a shard's rows) gives no estimate yet (None).
        """
        if self.epochs is None or self.rows is None:
            return {"fraction": None, "batches_left": None}
        if ended:  # this rank's data ended (rank_sync padding or the round is over)
            return {"fraction": 1.0, "batches_left": 0}
        epochs, names, active = self.epochs, self.names, self.active or self.names
        tokens = {n: current[f"source/{n}/tokens"] for n in names}
        rows = {n: passes[n] * self.rows[n] for n in names}  # delivered this round
        skipped = sum(current[f"source/{n}/skipped"] for n in names) + self._unattributed(current)
        delivered = sum(current[f"source/{n}/documents"] for n in names) + skipped
        read = current["documents"] + skipped
        placed, cut = sum(tokens.values()), current["discarded"]
        per_row_read = current["tokens_in"] / read if read else 0.0
        if len(names) == 1 or self.stop == "all_exhausted" and not self.cycle_exhausted:
            # Every source delivers its passes (and drops out): rows delivered over rows to deliver.
            f = delivered / (sum(self.rows[n] for n in active) * epochs)
            if placed:
                scale = per_row_read * delivered / placed  # tokens a row read holds over one delivered
                todo = sum(self.rows[n] * epochs * (scale * tokens[n] / rows[n] if tokens[n] and rows[n] else per_row_read)
                           for n in active)
                # 0 on a rank that took over only delivered counts in an elastic resume, before it read
                done = (placed + cut) / todo if todo else 0.0
            else:
                done = 0.0
        else:
            # Cycling: the slowest source ends the stream (all_exhausted), else the fastest.
            f = (min if self.stop == "all_exhausted" else max)(passes[n] for n in active) / epochs
            done = f * (placed + cut) / (per_row_read * delivered) if placed and per_row_read * delivered else 0.0
        f, done = min(max(f, 0.0), 1.0), min(max(done, 0.0), 1.0)
        left = None if done <= 0 or steps <= 0 else round(steps * (1 - done) / done)
        return {"fraction": f, "batches_left": left}

    @staticmethod
    def _unattributed(current: Mapping[str, int]) -> int:
        """Conversations read and left out (sft), counted over all sources, not per source."""
        return sum(current.get(f"conversations/{k}", 0) for k in ("empty", "untrained", "dropped"))

    def __call__(self, flat: Dict[str, int], step: int, *, current: Optional[Mapping[str, int]] = None,
                 ended: bool = False) -> Dict[str, Any]:
        out: Dict[str, Any] = {k: flat[k] for k in PACK_STAT_KEYS}
        out["skipped"] = sum(flat[f"source/{n}/skipped"] for n in self.names)
        era = max(i for i, (s, _) in enumerate(self.schedule) if s <= step)
        total = sum(flat[f"source/{n}/tokens"] for n in self.names)
        chat = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("conversations/")}
        if chat:
            out["conversations"] = chat
        passes: Dict[str, Any] = dict.fromkeys(self.names)
        if current is not None and self.rows is not None:
            single = self._unattributed(current) if len(self.names) == 1 else 0
            passes = {n: (current[f"source/{n}/documents"] + current[f"source/{n}/skipped"] + single) / self.rows[n]
                      for n in self.names}
        out["sources"] = {
            n: {
                "tokens": flat[f"source/{n}/tokens"],
                "documents": flat[f"source/{n}/documents"],
                "epochs": flat[f"source/{n}/epochs"],
                "skipped": flat[f"source/{n}/skipped"],
                "passes": passes[n],
                "target": self.schedule[era][1][n],
                "share": flat[f"source/{n}/tokens"] / total if total else 0.0,
                "readahead": {"bytes": flat[f"source/{n}/readahead_bytes"],
                              "peak_bytes": flat[f"source/{n}/readahead_peak_bytes"]},
            }
            for n in self.names
        }
        for n in self.names:
            if f"source/{n}/{TOKENIZED}" in flat:
                out["sources"][n][TOKENIZED] = flat[f"source/{n}/{TOKENIZED}"]
        out["progress"] = (self._progress(current, passes, step, ended) if current is not None
                           else {"fraction": None, "batches_left": None})
        return out
