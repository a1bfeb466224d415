"""What a command-line run measured, and the end-of-run summary that tells it.

`take` pulls batches from a loader's iterator, counts target tokens (labels that
are not -100: the tokens a model is trained on) and records when each batch
arrived, so throughput includes worker start-up, as a training loop feels it.
`summary_lines` turns that trace, ``loader.stats()`` and the saved state's size
into the text `tokenloom demo` and `tokenloom run` print; the per-source table
is `tokenloom.pipes.format_stats`'s, so logs and the command line read the same.
Two document counts differ and the summary says which is which: the packer
counts documents *read into* it, the table counts documents that *begin in the
batches delivered*; the difference is what waits in the packers' buffers (up to
``buffer_size`` per worker). A loader state's size grows with the workers and the
packers' buffers, not with the corpus size.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from tokenloom.pipes.stats import format_stats

from .progress import Progress

IGNORE = -100


@dataclass
class Trace:
    """Per batch: seconds since the iterator was asked for its first batch, and the
    cumulative target-token count."""

    t0: float = field(default_factory=time.perf_counter)
    seconds: List[float] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)

    @property
    def batches(self) -> int:
        return len(self.seconds)

    @property
    def elapsed(self) -> float:
        return self.seconds[-1] if self.seconds else 0.0

    @property
    def target_tokens(self) -> int:
        return self.tokens[-1] if self.tokens else 0

    def rate(self) -> float:
        return self.target_tokens / self.elapsed if self.elapsed > 0 else 0.0


def target_tokens(batch: Dict[str, Any]) -> int:
    return int((batch["labels"] != IGNORE).sum())


def take(it: Iterator[Dict[str, Any]], n: Optional[int], trace: Trace, progress: Progress,
         on_batch: Optional[Callable[[int, Dict[str, Any]], None]] = None) -> int:
    """Pull up to ``n`` batches (all, if None) into ``trace``; returns how many arrived."""
    got = 0
    while n is None or got < n:
        try:
            batch = next(it)
        except StopIteration:
            break
        total = trace.target_tokens + target_tokens(batch)
        trace.seconds.append(time.perf_counter() - trace.t0)
        trace.tokens.append(total)
        if on_batch is not None:
            on_batch(trace.batches - 1, batch)
        got += 1
        progress.update(trace.batches, total)
    return got


def batch_digest(batch: Dict[str, Any]) -> str:
    """A SHA-256 over every tensor's name, dtype, shape and bytes: equal digests mean
    bitwise-equal batches, without holding hundreds of batches in memory."""
    h = hashlib.sha256()
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.numpy().tobytes())
        else:
            h.update(f"{key}:{value!r}".encode())
    return h.hexdigest()


def state_bytes(state: Dict[str, Any]) -> int:
    """Size of ``state`` as torch.save writes it: what a checkpoint pays per rank."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def _row(label: str, text: str) -> str:
    return f"  {label:<15}{text}"


def packing_lines(stats: Dict[str, Any]) -> List[str]:
    """Tokens in rows, padding, discarded and cut documents, then the two document counts
    (see the module docstring); nothing for a loader that does not pack (multiplex)."""
    tokens_in, out, pad = stats.get("tokens_in", 0), stats.get("tokens_out", 0), stats.get("padding", 0)
    if not (tokens_in or out):
        return []
    pulled, cut = stats.get("documents", 0), stats.get("chunked", 0)
    lines = [_row("packing", f"{out:,} tokens in rows, padding {100 * pad / max(out + pad, 1):.3f}%, "
                             f"discarded {100 * stats.get('discarded', 0) / max(tokens_in, 1):.3f}%, "
                             f"{cut:,} documents cut across rows")]
    sources = stats.get("sources") or {}
    text = f"{pulled:,} read into the packer"
    if sources:
        begun = sum(s["documents"] for s in sources.values())
        text += f", {begun:,} of them begin in these batches (the table below), {pulled - begun:,} still buffered"
    return lines + [_row("documents", text)]


def encoder_of(loader: Any) -> Any:
    """The `Encoder` a pretrain or sft loader tokenizes with; None for multiplex."""
    return getattr(getattr(getattr(loader, "dataset", None), "factory", None), "encoder", None)


def summary_lines(trace: Trace, stats: Dict[str, Any], state_size: Optional[int] = None,
                  encoder: Any = None) -> List[str]:
    """The end-of-run summary: batches and time, target tokens/s, which engine tokenized
    (and why), packing waste, the per-source share against its target, and the loader state's size."""
    lines = ["summary"]
    first = f", first after {trace.seconds[0]:.1f}s" if trace.seconds else ""
    lines.append(_row("batches", f"{trace.batches} in {trace.elapsed:.1f}s{first}"))
    lines.append(_row("throughput", f"{trace.rate() / 1e3:.1f}k target tokens/s "
                                    f"({trace.target_tokens:,} tokens with a label)"))
    if encoder is not None:
        lines.append(_row("tokenizer", f"encoded by {encoder.engine} ({encoder.engine_note})"))
    if state_size is not None:
        lines.append(_row("loader state", f"{state_size / 1024:.1f} KiB (torch.save), plain data"))
    lines += packing_lines(stats)
    lines += ["  " + line for line in format_stats(stats).splitlines() if not line.startswith("packing: ")]
    chat = stats.get("conversations")
    if chat:
        lines.append(_row("conversations", ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in chat.items())))
    return lines
