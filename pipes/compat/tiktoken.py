"""tiktoken's encoder core, reached past its public wrapper.

`ordinary_encoder` gives ``text -> int32 ids`` with special-token spellings encoded as text
(``encode_ordinary``'s ids). Through the core (``Encoding._core_bpe``, tiktoken 0.5-0.12) the ids
are written into one buffer (``encode_to_tiktoken_buffer``, tiktoken >= 0.8) instead of a list of
Python ints, and a text with a lone surrogate raises, as `tokenizers` does, where the public
``encode_ordinary`` repairs it. Fallback, where the core is not as expected: the public
``encode_ordinary``, after a strict UTF-8 check that raises on the same texts
(tests/test_compat.py forces it).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def ordinary_encoder(enc: Any) -> Callable[[str], np.ndarray]:
    """``text -> int32 ids`` for a tiktoken ``Encoding`` (module docstring)."""
    core = getattr(enc, "_core_bpe", None)
    to_buffer = getattr(core, "encode_to_tiktoken_buffer", None)
    if to_buffer is not None:
        none: frozenset = frozenset()
        # ids are < 2**31, so the uint32 buffer is read as int32 without a copy
        return lambda text: np.frombuffer(to_buffer(text, none), dtype=np.int32)
    if core is not None and hasattr(core, "encode_ordinary"):  # tiktoken < 0.8
        return lambda text: np.asarray(core.encode_ordinary(text), dtype=np.int32)
    return lambda text: public_ordinary(enc, text)


def public_ordinary(enc: Any, text: str) -> np.ndarray:
    """The fallback: ``encode_ordinary``, refusing a text that is not valid UTF-8 (a lone surrogate)."""
    text.encode("utf-8")  # raises UnicodeEncodeError where the core would
    return np.asarray(enc.encode_ordinary(text), dtype=np.int32)
