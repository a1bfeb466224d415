"""Rows -> the training batch: a dict of tensors with the same shapes every step.

From ``B`` rows of ``C = T + 1`` tokens:

| key | shape, dtype | meaning |
|---|---|---|
| ``input_ids`` | (B, T) int64 | ``row[:-1]`` |
| ``labels`` | (B, T) int64 | ``row[1:]``; -100 where the target is padding or not trained (sft); ``end_label`` after a document's last token |
| ``position_ids`` | (B, T) int64 | restart at 0 at every segment start (and for a padding run) |
| ``segment_ids`` | (B, T) int32 | 1, 2, ... per segment in a row; 0 = padding |
| ``cu_seqlens`` | (B*T + 1,) int32 | FlashAttention varlen boundaries over the flattened (B*T) inputs; a padding run is its own sequence; trailing entries repeat B*T |
| ``max_seqlen`` | () int32 | longest sequence in ``cu_seqlens`` |
| ``num_seqs`` | () int32 | how many entries of ``cu_seqlens`` are real boundaries, minus one |

``cu_seqlens`` is padded to its upper bound (every input token its own
sequence) so its shape never changes: repeated trailing values are
zero-length sequences, which varlen kernels skip; ``cu_seqlens[:num_seqs + 1]``
gives the exact list when a dynamic shape is fine. FlexAttention document masks
need only ``segment_ids``.

Document ends: the packers cut a document only at the end of a row (flat: the
row is full; bestfit: a long document's chunk fills the row or the rest of it;
crop: the cropped document fills the rest of the row), so a segment followed by
anything inside its row, another segment or padding, is a whole document's end.
With ``end_label`` set, the label of that last token is ``end_label`` in every
mode: the BOS id (the recipes' ``predict_bos=True``: the model learns where a
document ends, whatever follows it in the row) or -100 (``predict_bos=False``:
nothing is trained across a document boundary). ``None`` keeps ``row[1:]``
there: the next document's first token, a continuing chunk's first token, or
-100 before padding, which is what a hand-built graph gets unless it chooses.
It is one vectorized comparison of ``segment_ids`` over the whole batch.

The batch is complete inside one ``next()``, so the batcher's state is just its
parent's. A finite stream's last batch is filled with padding rows (all labels
-100, ``segment_ids`` 0) so shapes stay fixed; ``stats`` count them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .base import Node
from .items import Row
from .roles import BATCH
from .schedule import StepClock

try:
    from . import _collatecore  # type: ignore[attr-defined]

    IMPLEMENTATION = "c"
except ImportError:  # built without a C compiler: the same tensors from numpy
    _collatecore = None
    IMPLEMENTATION = "numpy"

IGNORE_INDEX = -100


def collate_rows(rows: List[Row], *, batch_size: int, seq_len: int, pad_id: int,
                 end_label: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Build the batch dict from up to ``batch_size`` rows (missing rows are padding);
    ``end_label``: the label after every whole document's last token (see the module docstring).

    One pass over the rows in C (``_collatecore.c``) where the rows hold what the packers make
    (int32 tokens one row long, int32 or int64 segment lengths, a bool mask or None), else
    `collate_numpy`; the tensors are bitwise the same either way."""
    if _collatecore is not None:
        B, T = batch_size, seq_len
        input_ids, labels, pos_ids = (np.empty((B, T), np.int64) for _ in range(3))
        seg_ids = np.empty((B, T), np.int32)
        cu = np.empty(B * T + 1, np.int32)
        done = _collatecore.collate(rows if type(rows) is list else list(rows), input_ids, labels, pos_ids, seg_ids,
                                    cu, B, T, pad_id, end_label)
        if done is not None:
            max_seqlen, num_seqs = done
            return {
                "input_ids": torch.from_numpy(input_ids),
                "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos_ids),
                "segment_ids": torch.from_numpy(seg_ids),
                "cu_seqlens": torch.from_numpy(cu),
                "max_seqlen": torch.tensor(max_seqlen, dtype=torch.int32),
                "num_seqs": torch.tensor(num_seqs, dtype=torch.int32),
            }
    return collate_numpy(rows, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id, end_label=end_label)


def collate_numpy(rows: List[Row], *, batch_size: int, seq_len: int, pad_id: int,
                  end_label: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """`collate_rows` in numpy, for rows of any dtype (and where the C core is not built).

    Vectorized over the whole batch: each row is cut into pieces (its segments, then its
    padding run if any), and the pieces of all rows, which tile the (B, C) block exactly,
    give segment and position ids with one ``np.repeat`` each: a fixed number of numpy calls
    a batch whatever B is, not a number per row."""
    B, T, C = batch_size, seq_len, seq_len + 1
    R = len(rows)
    tokens = np.full((B, C), pad_id, dtype=np.int64)
    if R:
        tokens[:R] = np.stack([r.tokens for r in rows])
    lens = [r.seg_lens for r in rows]
    k = np.zeros(B, np.int64)
    k[:R] = [len(x) for x in lens]
    seg_len = np.concatenate(lens).astype(np.int64) if R else np.zeros(0, np.int64)
    seg_row = np.repeat(np.arange(B), k)
    real = np.bincount(seg_row, weights=seg_len, minlength=B).astype(np.int64)
    pad = C - real
    # Piece p of row b sits at first[b] + its index in the row: segments first, then padding.
    per_row = k + (pad > 0)
    first = np.cumsum(per_row) - per_row
    n_pieces = int(per_row.sum())
    piece_len = np.empty(n_pieces, np.int64)
    piece_id = np.zeros(n_pieces, np.int32)  # 1, 2, ... per segment in its row; 0 = padding
    idx = np.arange(len(seg_len)) - np.repeat(np.cumsum(k) - k, k)  # a segment's index in its row
    seg_at = np.repeat(first, k) + idx
    piece_len[seg_at] = seg_len
    piece_id[seg_at] = idx + 1
    padded = np.flatnonzero(pad > 0)
    piece_len[first[padded] + k[padded]] = pad[padded]
    seg_ids = np.repeat(piece_id, piece_len).reshape(B, C)
    piece_start = np.cumsum(piece_len) - piece_len  # in the flattened (B*C) block
    pos_ids = (np.arange(B * C) - np.repeat(piece_start, piece_len)).reshape(B, C)
    target = seg_ids > 0
    for b, row in enumerate(rows):
        if row.mask is not None:
            target[b, :real[b]] = row.mask[:real[b]]
    # Boundaries of the inputs (first T tokens of each row): piece starts below T, then B*T.
    piece_row = np.repeat(np.arange(B), per_row)
    in_row = piece_start - piece_row * C
    inside = in_row < T
    starts = in_row[inside]
    max_seqlen = int((np.minimum(starts + piece_len[inside], T) - starts).max())
    cu = np.append(starts + piece_row[inside] * T, B * T).astype(np.int32)
    labels = tokens[:, 1:].copy()
    labels[~target[:, 1:]] = IGNORE_INDEX
    if end_label is not None:
        # An input whose next token is in another segment or padding ends a segment inside the
        # row, so it is its document's last token (see the module docstring).
        labels[(seg_ids[:, :T] > 0) & (seg_ids[:, 1:] != seg_ids[:, :T])] = end_label
    cu_full = np.full(B * T + 1, B * T, dtype=np.int32)
    cu_full[: len(cu)] = cu
    return {
        "input_ids": torch.from_numpy(tokens[:, :-1].copy()),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(pos_ids[:, :-1].copy()),
        "segment_ids": torch.from_numpy(seg_ids[:, :-1].copy()),
        "cu_seqlens": torch.from_numpy(cu_full),
        "max_seqlen": torch.tensor(max_seqlen, dtype=torch.int32),
        "num_seqs": torch.tensor(len(cu) - 1, dtype=torch.int32),
    }


class Batch(Node[Dict[str, torch.Tensor]]):
    """Collects ``batch_size`` rows per batch; a final partial batch is completed
    with padding rows, never dropped.

    ``end_label`` is the label after every whole document's last token (the BOS id, -100,
    or None for the row's next token; see the module docstring).

    It also counts, per declared source (``sources=``, a fixed set so the state has
    the same keys at every step), the tokens and the document starts it delivers
    (``counts()``: what the training loop will see; a document whose first token is only a row's
    last label did not start in the batch and is not counted: no packer here places one there, a
    hand-built one might), and advances a `StepClock`
    when one is shared with a mixer's weights schedule; both are part of its state.

    Args:
        parent: a node of `Row` (a packer).
        batch_size: rows a batch holds (>= 1); a final partial batch is filled with padding rows.
        seq_len: a row holds ``seq_len + 1`` tokens; the batch's tensors are ``(batch_size, seq_len)``.
        pad_id: the id padding rows are filled with.
        sources: the source names whose delivered tokens and document starts are counted
            (a fixed set: the saved counts must be for the same names).
        clock: a `StepClock` shared with a mixer's weights schedule, advanced once a batch (None: none).
        end_label: the label after every whole document's last token (the BOS id, -100, or None:
            the row's next token).

    State keys: ``PARENT`` (the parent's state: a batch is complete inside one ``next()``),
    ``COUNTS`` (per source, ``[tokens, document starts]`` delivered so far; a start counts only where
    it is an input, not in a row's label slot) and ``CLOCK`` (the
    shared `StepClock`'s state, None without one). A restore loads the clock before the parent
    replays, because the mixer reads it.
    """
    ROLE = BATCH

    PARENT = "parent"
    COUNTS = "counts"
    CLOCK = "clock"
    STATE_KEYS = (PARENT, COUNTS, CLOCK)

    def __init__(self, parent: Node[Row], *, batch_size: int, seq_len: int, pad_id: int = 0,
                 sources: Sequence[str] = (), clock: Optional[StepClock] = None, end_label: Optional[int] = None):
        super().__init__(parent)
        if batch_size < 1:
            raise ValueError(f"{batch_size=} must be >= 1")
        self.parent, self.batch_size, self.seq_len, self.pad_id = parent, batch_size, seq_len, pad_id
        self.end_label = end_label
        self.sources = list(sources)
        self.clock = clock
        self._counts: Dict[str, List[int]] = {}
        self._counted: set = set()  # sources whose counts changed since the last state was taken
        self._count_state: Dict[str, List[int]] = {}  # the counts as of the last state, a list per source

    def _counts_loaded(self) -> None:
        self._count_state = {n: list(c) for n, c in self._counts.items()}
        self._counted = set()

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is None:
            self.parent.reset(None)
            self._counts = {n: [0, 0] for n in self.sources}
            self._counts_loaded()
            if self.clock is not None:
                self.clock.load(None)
            return
        saved = initial_state[self.COUNTS]
        if sorted(saved) != sorted(self.sources):
            raise ValueError(f"Batch: saved counts are for sources {sorted(saved)}, this batcher counts "
                             f"{sorted(self.sources)}")
        self._counts = {n: [int(t), int(d)] for n, (t, d) in saved.items()}
        self._counts_loaded()
        if self.clock is not None:
            self.clock.load(initial_state[self.CLOCK])
        # The clock must hold its saved value before the parent replays (the mixer reads it).
        self.parent.reset(initial_state[self.PARENT])

    def next(self) -> Dict[str, torch.Tensor]:
        rows: List[Row] = []
        for _ in range(self.batch_size):
            try:
                rows.append(self.parent.next())
            except StopIteration:
                break
        if not rows:
            raise StopIteration
        counts, T, counted = self._counts, self.seq_len, self._counted
        for row in rows:
            counted.update(row.sources)
            starts = row.starts
            off = 0
            for k, (src, n) in enumerate(zip(row.sources, row.seg_lens.tolist())):
                c = counts.get(src)
                if c is not None:
                    c[0] += n
                    # A segment that starts in the label slot (crop's one-token crop, before issue 42) holds
                    # no input:
                    # its document is not in the batch, so it is not counted as delivered.
                    c[1] += 1 if (starts is None or starts[k]) and off < T else 0
                off += n
        if self.clock is not None:
            self.clock.batches += 1
        return collate_rows(rows, batch_size=self.batch_size, seq_len=self.seq_len, pad_id=self.pad_id,
                            end_label=self.end_label)

    def carry_counts(self, counts: Dict[str, List[int]]) -> None:
        """Continue the delivered counts of an elastic resume (elastic.py)."""
        self._counts = {n: [int(t), int(d)] for n, (t, d) in counts.items()}
        self._counts_loaded()

    def counts(self) -> Dict[str, List[int]]:
        """Per source: [tokens, document starts] delivered in batches so far."""
        return {n: list(c) for n, c in self._counts.items()}

    def count_columns(self) -> Tuple[List[int], List[int]]:
        """`counts` as two lists in the order of ``sources``: tokens, document starts (a batch's
        statistics take them at every batch, without a list per source)."""
        zero, got = (0, 0), self._counts.get
        counts = [got(n, zero) for n in self.sources]
        return [c[0] for c in counts], [c[1] for c in counts]

    def get_state(self) -> Dict[str, Any]:
        if self._counted:
            # Only the sources in the rows since the last state changed: the others' lists are kept (and
            # shared with the states taken before, which nobody changes).
            state, counts = self._count_state, self._counts
            for n in self._counted:
                c = counts.get(n)
                if c is not None:
                    state[n] = list(c)
            self._counted.clear()
        return {self.PARENT: self.parent.state_dict(), self.COUNTS: dict(self._count_state),
                self.CLOCK: self.clock.state() if self.clock is not None else None}
