"""Checks for the integer arguments of the recipes, at the call, with the fix in the message.

Without them a wrong type fails far from its cause: ``seq_len="2048"`` (a value read
from a config or an environment variable) reaches ``seq_len < 1`` and ends in
``TypeError: '<' not supported between instances of 'str' and 'int'``, naming neither
the argument nor the value. `check_int` says ``seq_len='2048' must be an int, not
str: pass seq_len=2048``.

What counts as an int: `int` and numpy integers (`numbers.Integral`), because sizes
computed with numpy are common and harmless. `bool` does not, although it is an
`int` subclass: ``batch_size=True`` is a mistake, not a batch of 1. Floats do not
either, even 2048.0: a float size is a division that was meant to be ``//``.
Trade-off: one ``isinstance`` per argument per loader built, nothing per batch.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence


def check_int(name: str, value: Any, minimum: Optional[int] = None, *, none_ok: bool = False,
              none_means: str = "") -> Optional[int]:
    """``value`` as a plain `int`, or raise naming ``name`` and the value.

    `TypeError` when it is not an integer (bool, str, float, ...), `ValueError` when it
    is below ``minimum``. With ``none_ok``, None is accepted and returned (``none_means``
    says what None does, for the message: ``"cycle forever"``).
    """
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = f"an int (or None: {none_means})" if none_ok and none_means else \
            "an int or None" if none_ok else "an int"
        hint = ""
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            hint = f": pass {name}={int(value)}"
        elif isinstance(value, float) and value.is_integer():
            hint = f": pass {name}={int(value)} (use // for sizes computed by division)"
        elif isinstance(value, bool):
            hint = f": pass a number, e.g. {name}={int(value)}"
        raise TypeError(f"{name}={value!r} must be {allowed}, not {type(value).__name__}{hint}")
    value = int(value)
    if minimum is not None and value < minimum:
        none = f" or None ({none_means})" if none_ok and none_means else " or None" if none_ok else ""
        raise ValueError(f"{name}={value!r} must be >= {minimum}{none}")
    return value


def per_source(name: str, value: Any, sources: Sequence[str], *, kind: type = str,
               what: str = "a column name") -> Dict[str, Any]:
    """A setting that may differ per source, as ``{source: value}``: one ``value`` for every
    source, or a mapping that names each source once (``text_column={"stories": "story",
    "web": "text"}``). A mapping with a missing or an unknown name is a `ValueError` naming it
    and the sources; a value that is not a ``kind`` is a `TypeError`."""
    sources = list(sources)
    if isinstance(value, Mapping):
        unknown = [n for n in value if n not in sources]
        missing = [n for n in sources if n not in value]
        if unknown or missing:
            wrong = "; ".join(([f"names unknown source(s) {unknown}"] if unknown else [])
                              + ([f"leaves out {missing}"] if missing else []))
            raise ValueError(f"{name}={dict(value)!r} {wrong}; the sources are {sources}: give one value for all of "
                             f"them, or {{source name: value}} for each")
        out = {n: value[n] for n in sources}
    else:
        out = dict.fromkeys(sources, value)
    for source, v in out.items():
        if not isinstance(v, kind):
            shown = f"{name}={value!r}" if not isinstance(value, Mapping) else f"{name}[{source!r}]={v!r}"
            raise TypeError(f"{shown} must be {what} ({kind.__name__}), or {{source name: {what}}} to set it per "
                            f"source; got a {type(v).__name__}")
    return out


def per_source_changes(key: str, old: Any, new: Any, hint: str) -> Optional[List[str]]:
    """For a loader's configuration: the sources whose setting ``key`` differs between a saved
    state and this loader, one line each, where either side records it per source
    (``{source: value}``; a single value stands for every source). None when neither does
    (the caller compares the values as they are)."""
    if not isinstance(old, Mapping) and not isinstance(new, Mapping):
        return None
    names = list(dict.fromkeys([*(old if isinstance(old, Mapping) else ()), *(new if isinstance(new, Mapping) else ())]))
    absent = "<absent>"
    lines = []
    for n in names:
        a = old.get(n, absent) if isinstance(old, Mapping) else old
        b = new.get(n, absent) if isinstance(new, Mapping) else new
        if a != b:
            lines.append(f"{key}: source {n!r}: saved with {a!r}, this loader has {b!r} ({hint})")
    return lines


def check_loader_keywords(recipe: Any, loader_kwargs: Mapping[str, Any], also: Sequence[str] = ()) -> None:
    """A recipe passes the keywords it does not take to its loader (``also``: the loader's own, such
    as ``stall_timeout``) and to torch's DataLoader; one none of them knows
    (``num_worker=2``) is a `TypeError` naming the recipe and the closest argument of either,
    here, rather than torch's ``__init__() got an unexpected keyword argument`` from deep inside."""
    import difflib
    import inspect

    from torchdata.stateful_dataloader import StatefulDataLoader

    def names(fn: Any) -> List[str]:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]

    loader_names = names(StatefulDataLoader.__init__) + list(also)
    unknown = [k for k in loader_kwargs if k not in loader_names]
    if not unknown:
        return
    decided = ("dataset", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last")  # by the node graph
    known = names(recipe) + [n for n in loader_names if n not in decided]
    lines = []
    for k in unknown:
        close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
        lines.append(f"{k}={loader_kwargs[k]!r}" + (f" (did you mean {close[0]}=?)" if close else ""))
    own = f" and the loader's ({', '.join(f'{a}=' for a in also)})" if also else ""
    raise TypeError(f"{recipe.__name__}() got unexpected keyword argument(s): {', '.join(lines)}; it takes its own "
                    f"arguments, those of torch's DataLoader (prefetch_factor=, pin_memory=, "
                    f"persistent_workers=, timeout=, ...){own}")
