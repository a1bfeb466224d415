"""``tokenloom inspect``: the first rows of the first batch, decoded for a person.

Takes the same sources, flags and ``--config`` as ``run`` and builds the same
loader, so what it shows is what training would get. Per row: the segments
(documents or chunks) and their lengths, then the text with `` ‖ `` between
segments, padding as ``<pad xN>``, newlines as ``↵``, and for ``sft`` the
trained span (tokens whose label is not -100) in ``[[ ]]``, or in green on a
terminal. The label after a row's last token is no token of the row (it is
``labels[:, -1]``): when it is trained, as when a row ends just before a
conversation's end token, ``sft`` rows end with ``→`` and that label. Long rows
are cut after ``--chars`` characters of text; a row's trailing padding and
last label are still shown.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, List, Tuple

from .cli_config import add_loader_arguments, build_loader, describe, merged_settings, settings_lines, tokenizer_path
from .summary import IGNORE

SEGMENT = " ‖ "
LAST_LABEL = " → "
GREEN, DIM, RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("inspect", parents=[common], help="decode the first rows of the first batch",
                       description=__doc__.split("\n\n")[0])
    add_loader_arguments(p, refuse={"steps": "is not used by inspect, which decodes the first batch only; "
                                             "use --rows N for more of its rows, or tokenloom run --steps N"})
    p.add_argument("--rows", type=int, default=4, help="rows to show (default: %(default)s)")
    p.add_argument("--chars", type=int, default=600, help="characters of text per row (default: %(default)s)")
    p.add_argument("--settings", action="store_true", help="print every setting the loader was built with first")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the trained span and markers (auto: when stdout is a terminal)")
    p.set_defaults(run=inspect_batch)


def _runs(segments: List[int], trained: List[bool]) -> List[Tuple[int, bool, int, int]]:
    """(segment id, trained, start, end) for each run of positions sharing both."""
    runs = []
    start = 0
    for i in range(1, len(segments) + 1):
        if i == len(segments) or (segments[i], trained[i]) != (segments[start], trained[start]):
            runs.append((segments[start], trained[start], start, i))
            start = i
    return runs


def render_row(decode, ids: List[int], labels: List[int], segments: List[int], *, show_trained: bool,
               chars: int, color: bool) -> str:
    """One row as text. Input token i is a training target when ``labels[i - 1]`` is
    not -100 (label i - 1 is token i); that is the span sft trains. The last label
    is the target after the row's last token: shown after ``→`` when it is trained."""
    text = _render_inputs(decode, ids, labels, segments, show_trained=show_trained, chars=chars, color=color)
    if show_trained and labels and labels[-1] != IGNORE:
        last = decode([labels[-1]]).replace("\n", "↵")
        mark = (lambda s: f"{DIM}{s}{RESET}") if color else (lambda s: s)
        text += mark(LAST_LABEL) + (f"{GREEN}{last}{RESET}" if color else f"[[{last}]]")
    return text


def _render_inputs(decode, ids: List[int], labels: List[int], segments: List[int], *, show_trained: bool,
                   chars: int, color: bool) -> str:
    trained = [show_trained and i > 0 and labels[i - 1] != IGNORE for i in range(len(ids))]
    mark = (lambda s: f"{DIM}{s}{RESET}") if color else (lambda s: s)
    out: List[str] = []
    budget = chars
    prev_seg = None
    runs = _runs(segments, trained)
    for k, (seg, is_trained, a, b) in enumerate(runs):
        if seg == 0:
            out.append(mark(f" <pad x{b - a}>"))
            continue
        if budget <= 0:
            rest = sum(e - s for sg, _, s, e in runs[k:] if sg != 0)
            more = len({sg for sg, _, _, _ in runs[k:] if sg not in (0, prev_seg)})
            out.append(mark(f"… (+{rest} tokens" + (f" in {more} more segments)" if more else ")")))
            if runs[-1][0] == 0:
                out.append(mark(f" <pad x{runs[-1][3] - runs[-1][2]}>"))
            return "".join(out)
        if prev_seg is not None and seg != prev_seg:
            out.append(mark(SEGMENT))
        prev_seg = seg
        text = decode(ids[a:b]).replace("\n", "↵")
        cut = len(text) > budget
        text = text[:budget]
        budget = -1 if cut else budget - len(text)
        if is_trained:
            text = f"{GREEN}{text}{RESET}" if color else f"[[{text}]]"
        out.append(text)
    if budget < 0:  # the last segment was cut and nothing followed to say so
        out.append(mark("…"))
    return "".join(out)


def row_header(r: int, segments: List[int], positions: List[int], trained: int, show_trained: bool) -> str:
    lengths = [segments.count(s) for s in sorted(set(segments)) if s != 0]
    shown = ", ".join(map(str, lengths[:12])) + (", ..." if len(lengths) > 12 else "")
    noun = "segment" if len(lengths) == 1 else "segments"
    text = f"row {r}: {len(lengths)} {noun} ({shown} tokens), {segments.count(0)} padding"
    if show_trained:
        text += f", {trained} trained"
    if positions and positions[0] != 0:
        text += ", starts inside a document"
    return text


def inspect_batch(args: argparse.Namespace) -> int:
    from tokenloom.pipes.tokenizer import load_encoder

    if args.rows < 1 or args.chars < 1:
        raise ValueError(f"--rows {args.rows} and --chars {args.chars} must be >= 1")
    settings = merged_settings(args)
    args.recipe_built = settings.get("recipe")  # names the recipe's flags in an error
    recipe, loader = build_loader(settings)
    print(describe(recipe, loader))
    if args.settings:
        print("settings:\n" + "\n".join(settings_lines(loader.settings)))
    batch = next(iter(loader), None)
    if batch is None:
        raise ValueError("the loader produced no batch; are the sources empty?")
    encoder = load_encoder(tokenizer_path(settings))
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    show_trained = recipe == "sft"
    B, T = batch["input_ids"].shape
    legend = "‖ between segments, <pad xN> = N padding tokens, ↵ = newline"
    if show_trained:
        legend += ", trained span in " + ("green" if color else "[[ ]]") + \
            ", → the trained label after a row's last token"
    print(f"first batch: {B} rows x {T} tokens; {legend}")
    for r in range(min(args.rows, B)):
        ids = batch["input_ids"][r].tolist()
        labels = batch["labels"][r].tolist()
        segments = batch["segment_ids"][r].tolist()
        trained = sum(1 for x in labels if x != IGNORE)
        print(row_header(r, segments, batch["position_ids"][r].tolist(), trained, show_trained))
        print("  " + render_row(encoder.decode, ids, labels, segments, show_trained=show_trained, chars=args.chars,
                                color=color))
    return 0
