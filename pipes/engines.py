"""Which engine encodes a tokenizer.json: the fastest one that gives `tokenizers`' ids.

Three engines can encode a Hugging Face tokenizer.json: `tokenizers` itself (always right, the
reference), fastokens (fastokens_engine.py) and tiktoken (tiktoken_bpe.py), each used only where
its `verdict` says it gives the reference's ids on the file's structure and a sample. `choose` takes
the verdicts, fastest first, and says why it chose the engine and why the faster ones were not used
(the run summary shows it):

    fastokens  ->  tiktoken  ->  tokenizers

``TOKENLOOM_ENGINE`` (or the recipes' ``engine=``) forces one: ``auto`` (the default),
``fastokens``, ``tiktoken`` or ``tokenizers``. A forced engine whose verdict is no is refused with
its reason rather than run with other ids. ``TOKENLOOM_TIKTOKEN=0`` still keeps tiktoken out of the
automatic choice. Every engine gives the same ids, so the batches and the states do not depend on
the engine, and a resume may run on another one.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

#: Fastest first: the order of the automatic choice.
ENGINES = ("fastokens", "tiktoken", "tokenizers")
AUTO = "auto"
#: The environment variable that forces an engine.
ENV_ENGINE = "TOKENLOOM_ENGINE"


def first_difference(ours: Sequence[np.ndarray], reference: Any, texts: Sequence[str]) -> Optional[str]:
    """Where an engine's ids for ``texts`` first differ from ``reference``'s (a `tokenizers.Tokenizer`,
    special-token spellings as text), as a reason; None where every text gives the same ids."""
    theirs = reference.encode_batch_fast(list(texts), add_special_tokens=False)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a.tolist() != b.ids:
            at = next((j for j, (x, y) in enumerate(zip(a.tolist(), b.ids)) if x != y), min(len(a), len(b.ids)))
            return f"ids differ from tokenizers on sample text #{i} {texts[i][:40]!r} at token {at}"
    return None


def forced_engine(engine: Optional[str] = None) -> Tuple[Optional[str], str]:
    """(the engine asked for, or None for the automatic choice; where it was asked): ``engine`` (a
    recipe's ``engine=``; ``auto``: the automatic choice whatever the environment), else, where it is
    None, ``$TOKENLOOM_ENGINE``."""
    if engine == AUTO:
        return None, ""
    source, value = "engine", engine
    if value is None:
        value, source = os.environ.get(ENV_ENGINE, "").strip().lower() or None, ENV_ENGINE
    if value is None or value == AUTO:
        return None, ""
    if value not in ENGINES:
        raise ValueError(f"{source}={value!r} is not an engine: pass one of {(AUTO,) + ENGINES}")
    return value, f"{source}={value}"


def choose(verdicts: Mapping[str, Tuple[bool, str]], forced: Optional[str] = None, source: str = "",
           tiktoken_off: Optional[str] = None) -> Tuple[str, str]:
    """(engine, why) from the verdicts ``{engine: (gives the reference's ids, why)}`` of a
    tokenizer.json; ``forced`` (from `forced_engine`) picks one, refused with its reason where its
    verdict is no."""
    if forced == "tokenizers":
        return "tokenizers", f"forced by {source}"
    if forced is not None:
        ok, why = verdicts[forced]
        if not ok:
            raise ValueError(f"{source}: the {forced} engine cannot encode this tokenizer with tokenizers' ids: "
                             f"{why}; unset it (or pass engine='auto') to let tokenloom choose")
        return forced, f"{why}; forced by {source}"
    passed = []
    for name in ENGINES[:-1]:
        ok, why = verdicts[name]
        if name == "tiktoken" and tiktoken_off:
            ok, why = False, f"switched off by {tiktoken_off}"
        if ok:
            return name, why + (f" (not {'; '.join(passed)})" if passed else "")
        passed.append(f"{name}: {why}")
    return "tokenizers", "; ".join(passed)
