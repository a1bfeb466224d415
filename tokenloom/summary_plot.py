"""A PNG of the end-of-run summary: throughput over the run, share against target
per source, and packing waste.

matplotlib is optional (the ``plots`` extra) and imported only here, when a plot
is asked for; it is drawn on a bare `Figure` with the Agg canvas, so no pyplot
state or global backend is touched. Most of the drawing time is the import.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from .summary import Trace

MISSING = "matplotlib is not installed (pip install 'tokenloom[plots]'); skipping the PNG"


def plot_summary(path: str, trace: Trace, stats: Dict[str, Any], *, title: str,
                 state_size: Optional[int] = None) -> str:
    """Write the PNG if matplotlib is there; returns the line to print either way."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MISSING
    write_summary_png(path, trace, stats, title=title, state_size=state_size)
    return f"  {'plot':<15}{path}"


def write_summary_png(path: str, trace: Trace, stats: Dict[str, Any], *, title: str,
                      state_size: Optional[int] = None) -> None:
    """Write the three panels to ``path`` (directories are created)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_share, ax_pack = fig.subplots(1, 3)

    # Over a window of 1/20 of the run: start-up and stalls show, batch-to-batch jitter does not.
    w = max(1, trace.batches // 20)
    steps = range(w + 1, trace.batches + 1)
    rates = [(trace.tokens[i] - trace.tokens[i - w]) / max(trace.seconds[i] - trace.seconds[i - w], 1e-9) / 1e3
             for i in range(w, trace.batches)]
    ax_rate.plot(steps, rates, color="tab:blue", label=f"over {w} batches")
    ax_rate.axhline(trace.rate() / 1e3, color="tab:gray", linestyle="--", label="whole run, with start-up")
    ax_rate.set(title=f"throughput: {trace.rate() / 1e3:.1f}k target tokens/s", xlabel="batch",
                ylabel="k target tokens/s")
    ax_rate.legend(loc="lower right")
    ax_rate.set_ylim(bottom=0)
    ax_rate.grid(alpha=0.3)

    sources = stats.get("sources") or {}
    names = list(sources)
    xs = range(len(names))
    ax_share.bar([x - 0.2 for x in xs], [100 * sources[n]["target"] for n in names], width=0.4,
                 label="target", color="tab:gray")
    bars = ax_share.bar([x + 0.2 for x in xs], [100 * sources[n]["share"] for n in names], width=0.4,
                        label="observed", color="tab:orange")
    ax_share.bar_label(bars, fmt="%.1f%%")
    ax_share.set_xticks(list(xs), names)
    ax_share.set(title="share of tokens per source", ylabel="%")
    ax_share.set_ylim(0, 115)  # room for the labels above a 100% bar
    ax_share.legend()

    out, pad = stats.get("tokens_out", 0), stats.get("padding", 0)
    waste = {"padding": 100 * pad / max(out + pad, 1),
             "discarded": 100 * stats.get("discarded", 0) / max(stats.get("tokens_in", 0), 1)}
    bars = ax_pack.bar(list(waste), list(waste.values()), color=["tab:purple", "tab:red"])
    ax_pack.bar_label(bars, fmt="%.3f%%")
    ax_pack.set(title=f"packing waste ({stats.get('documents', 0):,} documents)", ylabel="% of tokens")
    ax_pack.set_ylim(0, max(1.0, 1.3 * max(waste.values())))

    size = f", loader state {state_size / 1024:.1f} KiB" if state_size is not None else ""
    fig.suptitle(f"{title}{size}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
