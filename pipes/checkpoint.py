"""A loader state inside `torch.distributed.checkpoint` (DCP), without pickle.

Encoding: the state is plain data (ints, floats, strings, bools, None, lists,
str-keyed dicts), so it is written as UTF-8 JSON into a 1-D ``uint8`` tensor.
Why not hand the dict to DCP as it is: DCP stores tensors with ``torch.save``
and reads them back with ``torch.load(weights_only=True)``, but every non-tensor
leaf (each int and str of a nested state) becomes a pickled ``BytesIO`` that it
reads back with ``torch.load(weights_only=False)``, i.e. unpickles. A JSON tensor
is only ever parsed by ``json.loads``. Python's JSON keeps ints of any size
exactly (a StatefulDataLoader base seed is a 63-bit int) and floats by their
shortest repr; NaN and infinities are refused rather than written as
non-standard JSON. (DCP's own ``.metadata`` file, the table of keys and tensor
sizes, is a pickle written by DCP; that is DCP's format, not the loader's.)

Keys per rank: DCP's default save planner de-duplicates an entry whose key
appears on several ranks (it assumes a replicated value, like DDP weights) and
writes one copy, so every rank would load rank 0's position. Loader states
differ per data rank, so the key carries the loader's rank
(``<your key>.tokenloom_rank_<r>``), as torchtitan keys its dataloader per
dp rank. Ranks that share a data rank (tensor parallel) share the key and the
value, which is what de-duplication is for.

Loading in place: DCP copies into a tensor the caller provides, and the sizes
must match; a state's JSON length varies with the position. `DCPLoaderState`
therefore reads the saved size from the checkpoint's metadata when it is built
for loading (``checkpoint_id=``). Trade-off: one extra small read of the
metadata per load, instead of padding every state to a guessed capacity or a
second DCP pass for a length key.

Measured (pretrain, 10 batches in; tests' synthetic corpus): 1.3 KiB of JSON
with 0 workers and 2.1 KiB with 2 at ``buffer_size=32``; 7.1 and 13.6 KiB at
``buffer_size=1000`` (each worker's packer lists where its buffered documents
came from), within 10% of the same state's ``torch.save`` file either way.

Usage::

    import torch.distributed.checkpoint as dcp
    from tokenloom.pipes.checkpoint import DCPLoaderState

    dcp.save({"model": model.state_dict(), "dataloader": DCPLoaderState(loader)}, checkpoint_id=path)
    ...
    state = {"model": model.state_dict(), "dataloader": DCPLoaderState(loader, checkpoint_id=path)}
    dcp.load(state, checkpoint_id=path)      # calls loader.load_state_dict(...) for you
    model.load_state_dict(state["model"])
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional, Union

import torch

#: The inner key of a rank's loader state; DCP names the entry ``<outer key>.<this>``.
KEY_PREFIX = "tokenloom_rank_"


def _check_plain(value: Any, path: str) -> None:
    """Raise `TypeError` naming the first value JSON would not give back unchanged."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{path} = {value!r}: NaN and infinities have no JSON form; store them as strings")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path} has the key {k!r} ({type(k).__name__}); JSON keys are strings")
            _check_plain(v, f"{path}[{k!r}]")
        return
    raise TypeError(f"{path} is a {type(value).__name__} ({value!r:.80}), not plain data (int, float, str, bool, "
                    "None, list, str-keyed dict); a tuple would come back as a list")


def state_to_tensor(state: Dict[str, Any]) -> torch.Tensor:
    """The state as UTF-8 JSON in a 1-D uint8 tensor; `TypeError` names a value that is not plain data."""
    _check_plain(state, "state")
    data = json.dumps(state, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _no_constants(name: str):
    raise ValueError(f"loader state JSON holds {name}, which state_to_tensor never writes; the tensor is corrupt")


def state_from_tensor(tensor: torch.Tensor) -> Dict[str, Any]:
    """Parse a tensor written by `state_to_tensor` (json.loads only: nothing is evaluated or unpickled)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        what = f"{tensor.dtype} tensor of shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) \
            else type(tensor).__name__
        raise ValueError(f"a loader state tensor is 1-D uint8, got a {what}; was it written by state_to_tensor?")
    data = tensor.detach().cpu().contiguous().numpy().tobytes()
    try:
        state = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"loader state tensor ({len(data)} bytes) is not UTF-8 JSON: {e}; "
                         "the checkpoint is corrupt or was not written by state_to_tensor") from e
    if not isinstance(state, dict):
        raise ValueError(f"loader state tensor holds a {type(state).__name__}, expected a dict")
    return state


def _metadata_sizes(checkpoint: Any) -> Dict[str, tuple]:
    """Key -> tensor shape of every tensor entry in a DCP checkpoint (path or StorageReader)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else checkpoint
    meta = reader.read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class DCPLoaderState:
    """A loader's state as a DCP ``Stateful``: put it in the dict you pass to
    ``dcp.save`` / ``dcp.load``, under any key.

    ``rank`` defaults to the loader's data rank (``loader.config["rank"]``).
    For loading, pass ``checkpoint_id`` (the path, or a DCP ``StorageReader``) so
    the entry has the saved size; DCP then calls `load_state_dict`, which
    restores the loader.
    """

    def __init__(self, loader: Any, rank: Optional[int] = None, *,
                 checkpoint_id: Union[str, os.PathLike, Any, None] = None):
        self.loader = loader
        self.rank = int(loader.config["rank"] if rank is None else rank)
        self.key = f"{KEY_PREFIX}{self.rank}"
        self._load_size: Optional[int] = None
        if checkpoint_id is not None:
            self._load_size = self._saved_size(checkpoint_id)

    def _saved_size(self, checkpoint_id: Any) -> int:
        sizes = _metadata_sizes(checkpoint_id)
        found = {k: s for k, s in sizes.items() if k == self.key or k.endswith("." + self.key)}
        if len(found) != 1:
            ranks = sorted(k for k in sizes if KEY_PREFIX in k)
            why = "none" if not found else f"several ({sorted(found)})"
            raise ValueError(f"checkpoint {checkpoint_id!r} has {why} loader state for rank {self.rank} "
                             f"(key '*.{self.key}'); loader entries present: {ranks}. Resume with the world size "
                             "it was saved with; with several loaders, save each in its own checkpoint")
        (shape,) = found.values()
        if len(shape) != 1:
            raise ValueError(f"checkpoint entry {next(iter(found))!r} has shape {shape}, not a 1-D JSON tensor")
        return int(shape[0])

    def state_dict(self) -> Dict[str, torch.Tensor]:
        if self._load_size is not None:
            # DCP asks for the destination before a load: an empty tensor of the saved size.
            return {self.key: torch.zeros(self._load_size, dtype=torch.uint8)}
        return {self.key: state_to_tensor(self.loader.state_dict())}

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        if self.key not in state_dict:
            raise ValueError(f"no loader state for rank {self.rank} (key {self.key!r}); got keys {sorted(state_dict)}")
        self.loader.load_state_dict(state_from_tensor(state_dict[self.key]))
        self._load_size = None  # from now on this object saves again
