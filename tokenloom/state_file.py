"""Loader states on disk for the command line: ``run --save-state``, ``run --resume``, ``state``.

A state is what ``loader.state_dict()`` returns: plain data (dicts, lists, ints,
strings), so it is written with `torch.save` and read back with
``torch.load(weights_only=True)``, which refuses to run pickled code from a
file someone handed you. Writes go to a temporary name first and are renamed,
so an interrupted save never leaves a truncated state under the real name. A
trainer checkpoint that holds the state one level down (``{"model": ...,
"loader": state}``, as in the README) is read too. What is returned is the decoded
nested state (`decode_state`: digest checked).
"""

from __future__ import annotations

import os
from typing import Any, Dict

import torch

from tokenloom.pipes.loader.bridge import KEY_PREFIX, decode_state


def load_state(path: str, flag: str) -> Dict[str, Any]:
    """Read a saved loader state; ``flag`` names the option in error messages."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r}: no such file; give the file a `tokenloom run --save-state` "
                         "(or torch.save(loader.state_dict(), ...)) wrote")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # torch raises several types for "not a checkpoint"; its text is about model weights
        raise ValueError(f"{flag} {path!r}: not a file torch.save wrote, or it holds more than plain data "
                         f"({type(e).__name__}); give the file loader.state_dict() was saved to") from e
    if _is_loader_state(state):
        return decode_state(state)
    # A trainer checkpoint ({"model": ..., "step": ..., "loader": state}) holds it one level down.
    inside = [v for v in state.values() if _is_loader_state(v)] if isinstance(state, dict) else []
    if len(inside) == 1:
        return decode_state(inside[0])
    keys = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
    raise ValueError(f"{flag} {path!r}: not a tokenloom loader state (top-level keys {keys}); "
                     "give the file loader.state_dict() was saved to")


def _is_loader_state(obj: Any) -> bool:
    """What ``loader.state_dict()`` returns (one ``tokenloom_rank_<r>`` entry), or its decoded form."""
    if not isinstance(obj, dict):
        return False
    return (isinstance(obj.get("tokenloom"), dict) and "loader" in obj) or \
        (len(obj) == 1 and str(next(iter(obj))).startswith(KEY_PREFIX))


def save(path: str, obj: Any) -> None:
    """`torch.save` to ``path`` atomically (folders are created)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)
