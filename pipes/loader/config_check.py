"""Checking a saved state's configuration against the loader's: every setting that changed is named,
with what to do about it.

``check_config`` compares the saved and current configuration dicts key by key. What to tell the
user per setting (``hints``) and which settings derive from others (``follows``) come from whoever
built the loader: a recipe reads them from its settings' declarations (recipes/settings.py); the
topology's hints (`TOPOLOGY_HINTS`) are the loader's own. ``CONFIG_CHECKS`` gives the records whose
comparison says more than "differs" (the files that changed, the sources whose text column
changed), and ``TOPOLOGY`` lists the settings an elastic resume may change.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..check_args import per_source_changes
from ..sources.fingerprint import check_sources

#: What to tell the user when the topology differs from the one the state was saved with.
TOPOLOGY_HINTS = {
    "world_size": "positions are per rank; resume with the same number of ranks, or pass load_state_dict the list "
                  "of every old rank's state, [state, ...], to continue on this topology (elastic resume)",
    "num_workers": "data is sharded per loader worker; pass the same num_workers to resume exactly, or pass "
                   "load_state_dict the list of every old rank's state, [state, ...], to continue with these workers "
                   "(elastic resume)",
    "rank": "each rank must load its own state",
}


#: Settings whose comparison says more than "differs": the sources name the files that changed
#: (and warn about text files with new modification times); the text column and mode, recorded per
#: source where the sources differ ({name: "column=... mode=..."}), name the sources whose changed.
#: A check returns the problems (empty: none), or None to leave the comparison to `check_config`.
CONFIG_CHECKS: Dict[str, Callable[[Any, Any, str], Optional[List[str]]]] = {
    "sources": lambda old, new, hint: ([f"sources: {p}" for p in check_sources(old, new)]
                                       if isinstance(old, Mapping) and isinstance(new, Mapping) else None),
    "text": lambda old, new, hint: per_source_changes("text", old, new, hint),
}


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any], *, ignore: tuple = (),
                 hints: Optional[Mapping[str, str]] = None,
                 follows: Optional[Mapping[str, Tuple[Tuple[str, ...], bool]]] = None,
                 absent: Optional[Mapping[str, Any]] = None) -> None:
    """Raise `ValueError` naming every setting that differs between a saved state and this loader.

    ``hints``: what to tell the user per setting; ``follows``: per setting, ``(causes, when_absent)``:
    the settings its recorded value derives from (pretrain's ``buffer_tokens`` from ``seq_len``,
    ``packing`` and ``buffer_size``), and whether it follows them only where one side records None
    (``buffer_size``, None under ``packing="flat"`` and given otherwise). What the user changed comes
    first: a derived setting is told on the line of the setting it follows from, as a consequence,
    rather than as a change of its own. ``absent``: per setting added later, the value a side that
    does not record it stands for (recorded only where it differs)."""
    hints = {**(hints or {}), **TOPOLOGY_HINTS}
    derived = dict(follows or {})
    found: Dict[str, List[str]] = {}
    for key in sorted(set(saved) | set(current)):
        if key in ignore:
            continue
        missing = (absent or {}).get(key, "<absent>")
        old, new = saved.get(key, missing), current.get(key, missing)
        check = CONFIG_CHECKS.get(key)
        lines = check(old, new, hints.get(key, "")) if check is not None else None
        if lines is None:
            lines = [] if old == new else [
                f"{key}: saved with {old!r}, this loader has {new!r} ({hints.get(key, 'use the saved value')})"]
        if lines:
            found[key] = lines

    def follows(key: str, cause: str) -> bool:
        # buffer_size changes with packing only to or from flat (None); buffer_tokens with any of its causes
        causes, when_absent = derived[key]
        return cause in causes and cause in found and (not when_absent or None in (saved.get(key), current.get(key)))

    causes = {key: [c for c in derived.get(key, ((), False))[0] if follows(key, c)] for key in found}
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
