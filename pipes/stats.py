"""Carry a worker's cumulative statistics inside each batch it produces.

The loader's main process sees batches in exactly the order the training loop
does, so statistics counted there are "what the loop has seen", with no extra
channel between processes. Each batch carries its worker's *cumulative* counters
(a tuple of a few ints under `STATS_KEY`, pickled with the batch's envelope rather
than sent as a tensor through the ring); the loader keeps the latest vector per worker
and sums them. Cumulative counters make this robust to the batches the loader
skips internally while resuming: the next batch a worker delivers brings the
right totals.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from .base import Node
from .items import STATS_KEY
from .roles import PASS


class WithStats(Node[Dict[str, Any]]):
    """Adds ``batch[STATS_KEY] = (worker, *counters())``; ``counters`` returns a list of
    ints in the order of ``keys`` (the loader sums them per key over workers).

    Args:
        parent: a node of batch dicts (a `Batch`).
        counters: called once a batch; returns the worker's cumulative counters, one int per key.
        keys: the counters' names, in the order ``counters`` returns them.
        worker: this worker's number, the first element of the tuple, so the loader keeps the
            latest counters per worker.

    State keys: ``PARENT`` (the parent's state; the counters are cumulative and belong to the
    nodes that count them, so nothing of them is saved here).
    """

    ROLE = PASS
    PARENT = "parent"
    STATE_KEYS = (PARENT,)

    def __init__(self, parent: Node, *, counters: Callable[[], Sequence[int]], keys: Sequence[str], worker: int):
        super().__init__(parent)
        self.parent, self.counters, self.keys, self.worker = parent, counters, tuple(keys), worker

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])

    def next(self) -> Dict[str, Any]:
        batch = next(self.parent)
        values = tuple(map(int, self.counters()))
        if len(values) != len(self.keys):
            raise RuntimeError(f"WithStats: counters() gave {len(values)} values for {len(self.keys)} keys")
        batch[STATS_KEY] = (self.worker, *values)
        return batch

    def get_state(self) -> Dict[str, Any]:
        return {self.PARENT: self.parent.state_dict()}


def format_stats(stats: Dict[str, Any]) -> str:
    """A plain-text table of `loader.stats()` for logs: packing figures, then per source
    tokens, documents, epochs, target share and observed share."""
    lines = []
    tokens_in, out, pad = stats.get("tokens_in", 0), stats.get("tokens_out", 0), stats.get("padding", 0)
    if tokens_in or out:
        lines.append(f"packing: {out:,} tokens in rows, padding {100 * pad / max(out + pad, 1):.3f}%, "
                     f"discarded {100 * stats.get('discarded', 0) / max(tokens_in, 1):.3f}%, "
                     f"{stats.get('documents', 0):,} documents, {stats.get('chunked', 0):,} cut")
    sources = stats.get("sources") or {}
    if sources:
        lines.append(f"{'source':<16}{'tokens':>14}{'documents':>12}{'epochs':>8}{'target':>9}{'share':>9}{'diff':>8}")
        for name, s in sources.items():
            diff = 100 * (s["share"] - s["target"])
            lines.append(f"{name:<16}{s['tokens']:>14,}{s['documents']:>12,}{s['epochs']:>8}"
                         f"{100 * s['target']:>8.2f}%{100 * s['share']:>8.2f}%{diff:>+7.2f}")
        ahead = {n: s["readahead"] for n, s in sources.items() if (s.get("readahead") or {}).get("peak_bytes")}
        if ahead:
            lines.append("read-ahead: " + ", ".join(f"{n} {a['bytes'] / 2**20:.1f} MiB held ({a['peak_bytes'] / 2**20:.1f} "
                                                    "peak)" for n, a in ahead.items()))
    return "\n".join(lines)
