"""Checking a saved state's configuration against the loader's: every setting that changed is named,
with what to do about it.

``check_config`` compares the saved and current configuration dicts key by key; ``CONFIG_HINTS`` says
what to tell the user per setting, ``CONFIG_CHECKS`` gives the settings whose comparison says more
than "differs" (the files that changed, the sources whose text column changed), and ``TOPOLOGY``
lists those an elastic resume may change.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

from ..check_args import per_source_changes
from ..sources.fingerprint import check_sources

#: What to tell the user when a setting differs from the one the state was saved with.
CONFIG_HINTS = {
    "world_size": "positions are per rank; resume with the same number of ranks, or pass load_state_dict the list "
                  "of every old rank's state, [state, ...], to continue on this topology (elastic resume)",
    "num_workers": "data is sharded per loader worker; pass the same num_workers to resume exactly, or pass "
                   "load_state_dict the list of every old rank's state, [state, ...], to continue with these workers "
                   "(elastic resume)",
    "seq_len": "rows are packed for one sequence length; resume with the same seq_len",
    "batch_size": "pass the same batch_size (positions count rows per batch)",
    "sources": "the files changed (names or sizes); resume on the same files, or start without the state",
    "tokenizer": "the tokenizer changed; resume with the same tokenizer, or start without the state",
    "packing": "pass the same packing mode",
    "buffer_size": "pass the same buffer_size",
    "buffer_tokens": "pass the same buffer_tokens",
    "seed": "pass the same seed",
    "rank": "each rank must load its own state",
    "epochs": "pass the same epochs",
    "max_wait": "pass the same max_wait (how long a buffered document may wait decides the rows)",
    "weights": "pass the same weights, or pass allow_weight_change=True to load_state_dict to switch mixtures at this point",
    "source_order": "the order of the sources decides the mix's ties and the sequence; pass them in the saved order",
    "text": "documents are read from this column (text files: split this way); pass the saved text_column= "
            "(sft: messages_field=) and text_mode=, per source as {name: value} where they differ",
}


#: Settings whose comparison says more than "differs": the sources name the files that changed
#: (and warn about text files with new modification times); the text column and mode, recorded per
#: source where the sources differ ({name: "column=... mode=..."}), name the sources whose changed.
#: A check returns the problems (empty: none), or None to leave the comparison to `check_config`.
CONFIG_CHECKS: Dict[str, Callable[[Any, Any], Optional[List[str]]]] = {
    "sources": lambda old, new: ([f"sources: {p}" for p in check_sources(old, new)]
                                 if isinstance(old, Mapping) and isinstance(new, Mapping) else None),
    "text": lambda old, new: per_source_changes("text", old, new, CONFIG_HINTS["text"]),
}


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any], *, ignore: tuple = ()) -> None:
    """Raise `ValueError` naming every setting that differs between a saved state and this loader.

    What the user changed comes first: a setting the recipe derives from others when it is not
    given (pretrain's and sft's ``buffer_tokens`` from ``seq_len``, ``packing`` and ``buffer_size``,
    recipes/packed.py; ``buffer_size``, None under ``packing="flat"``) is told on the line of the
    setting it follows from, as a consequence, rather than as a change of its own."""
    derived = {"buffer_tokens": ("seq_len", "packing", "buffer_size"), "buffer_size": ("packing",),
               "max_wait": ("buffer_size", "packing")}
    found: Dict[str, List[str]] = {}
    for key in sorted(set(saved) | set(current)):
        if key in ignore:
            continue
        old, new = saved.get(key, "<absent>"), current.get(key, "<absent>")
        check = CONFIG_CHECKS.get(key)
        lines = check(old, new) if check is not None else None
        if lines is None:
            lines = [] if old == new else [
                f"{key}: saved with {old!r}, this loader has {new!r} ({CONFIG_HINTS.get(key, 'use the saved value')})"]
        if lines:
            found[key] = lines

    def follows(key: str, cause: str) -> bool:
        # buffer_size changes with packing only to or from flat (None); buffer_tokens with any of its causes
        return cause in found and (key != "buffer_size" or None in (saved.get(key), current.get(key)))

    causes = {key: [c for c in derived.get(key, ()) if follows(key, c)] for key in found}
    problems = []
    for key, lines in found.items():
        if causes[key]:
            continue  # told on its cause's line
        told = [f"{k} differs as a consequence: saved with {saved.get(k, '<absent>')!r}, this loader has "
                f"{current.get(k, '<absent>')!r}" for k in found if causes[k] and causes[k][0] == key]
        problems += lines[:-1] + [lines[-1] + "".join(f" ({t})" for t in told)]
    if problems:
        raise ValueError("cannot load this loader state, the configuration changed:\n  " + "\n  ".join(problems))


#: The settings an elastic resume may change.
TOPOLOGY = ("world_size", "rank", "num_workers")
