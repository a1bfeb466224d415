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
Trade-off: one ``isinstance`` per argument per loader built (~1 µs), nothing per batch.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional


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
