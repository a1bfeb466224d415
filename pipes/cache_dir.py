"""Where tokenloom keeps what it can compute again: ``$TOKENLOOM_CACHE`` if set (``0``, ``off``,
``false``, ``no`` or an empty value: nowhere), else ``$XDG_CACHE_HOME/tokenloom`` or
``~/.cache/tokenloom``. The tokenizer cache (tokenizer_cache.py) keeps its entries in
``tokenizers/``, the host cache of remote listings (sources/host_cache.py) in ``remote/``."""

from __future__ import annotations

import os
from typing import Optional

#: Environment variable naming the cache directory (or switching it off).
ENV_CACHE = "TOKENLOOM_CACHE"


def cache_root() -> Optional[str]:
    """The cache directory, or None where it is switched off."""
    value = os.environ.get(ENV_CACHE)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "false", "no") else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenloom")
