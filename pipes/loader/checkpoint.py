"""The loader in ``torch.distributed.checkpoint`` (DCP), and reading every rank's entry back.

The loader itself is the DCP ``Stateful``: ``dcp.save({"model": ..., "dataloader": loader})``
and ``dcp.load(...)`` with the same dict restore each rank exactly. That works because
``loader.state_dict()`` is ``{"tokenloom_rank_<data rank>": <JSON text with a digest>}``
(pipes/loader/bridge.py, `encode_state`): one ``str`` leaf per data rank. DCP keeps one copy of
an entry whose key is the same on several ranks (it takes it for a replicated value), so
a key per rank is what keeps the ranks' positions apart (ranks that share a data rank,
tensor parallel, share the key and the value, which is what de-duplication is for); and
one leaf instead of a nested dict means a load fills the saved state whole rather than
the structure a fresh loader happens to have. How DCP stores a ``str``: ``torch.save``
into a byte blob (``BytesStorageMetadata`` in ``.metadata``), read back with
``torch.load(weights_only=False)``; DCP's ``.metadata`` file is itself a pickle, so a
checkpoint directory must be trusted either way.

Another topology (elastic resume): a new rank's key is not the old ranks' keys, so it
cannot take its state from ``dcp.load``; `read_loader_states` reads every old rank's
entry from the checkpoint instead (the metadata lists them; no process group needed),
each checked against its digest, for ``loader.load_state_dict(read_loader_states(path))``.
It unpickles with ``weights_only=True`` (a str passes, an object is refused).

A rank's entry grows with its workers and its packer's buffer. ``dcp.load`` with the loader
itself first asks the fresh loader for its ``state_dict()`` (the destination), and a
StatefulDataLoader with workers starts them to answer: a worker start, once per resume.
Entry sizes and timings are in docs/performance.md.

`DCPLoaderState` is the earlier wrapper (the state as a JSON ``uint8`` tensor). It is kept so
checkpoints written with it still load, and `read_loader_states` reads its entries too; new
code puts the loader itself in the dict, and saving through the wrapper warns.

Usage::

    import torch.distributed.checkpoint as dcp
    from tokenloom.pipes.loader.checkpoint import read_loader_states

    dcp.save({"model": model.state_dict(), "dataloader": loader}, checkpoint_id=path)
    # same world size and num_workers:
    dcp.load({"model": model.state_dict(), "dataloader": loader}, checkpoint_id=path)
    # another world size or num_workers: the model through DCP, the loader from every old rank
    loader.load_state_dict(read_loader_states(path))
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import warnings
from typing import Any, Dict, List, Optional, Union

import torch

from .bridge import KEY_PREFIX, TokenLoomLoader, decode_state


def _reader(checkpoint: Any):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else checkpoint


def _metadata(checkpoint: Any):
    """DCP's table of entries of a checkpoint (path or StorageReader); errors name the checkpoint."""
    try:
        return _reader(checkpoint).read_metadata().state_dict_metadata
    except FileNotFoundError as e:
        raise ValueError(f"checkpoint {checkpoint!r} has no DCP metadata ({e}); pass the directory that "
                         "dcp.save(..., checkpoint_id=...) wrote") from e


def _plain_bytes_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainBytesLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner for a flat dict of placeholders (no flattening, so ``self.state_dict``
        is the dict DCP hands back), but non-tensor entries are read with
        ``torch.load(weights_only=True)``: a str comes back, a pickled object is refused."""

        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                # Not raised here: DCP would wrap it in a CheckpointException with a traceback per rank.
                self.refused[fqn] = str(e).splitlines()[0]

    planner = PlainBytesLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.refused = {}
    return planner


def read_loader_states(checkpoint_id: Union[str, os.PathLike, Any], key: str = "dataloader") -> List[Dict[str, Any]]:
    """Every old rank's loader state in the DCP checkpoint ``checkpoint_id`` (a path or a
    ``StorageReader``), sorted by rank: what each rank's ``loader.state_dict()`` returned
    when ``dcp.save({key: loader, ...})`` ran. For an elastic resume, on every new rank:
    ``loader.load_state_dict(read_loader_states(path))``.

    Reads the entries ``<key>.tokenloom_rank_<r>`` (from the loader itself, or from
    `DCPLoaderState`) without a process group; checks each one's digest and that the ranks
    0 .. world_size-1 of the run that saved them are all there. `ValueError` names the
    checkpoint and what is missing.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = _metadata(checkpoint_id)
    pattern = re.compile(re.escape(f"{key}.{KEY_PREFIX}") + r"(\d+)")
    found = {int(m.group(1)): k for k in meta if (m := pattern.fullmatch(k))}
    if not found:
        elsewhere = sorted(k for k in meta if KEY_PREFIX in k)
        raise ValueError(f"checkpoint {checkpoint_id!r} holds no loader state under '{key}.{KEY_PREFIX}<rank>'; "
                         + (f"loader entries present: {elsewhere}: pass key= the name you saved the loader under"
                            if elsewhere else f"it holds {sorted(meta)[:8]}: was the loader in the dict given to dcp.save?"))
    places: Dict[str, Any] = {}
    for k in found.values():
        md = meta[k]
        if isinstance(md, BytesStorageMetadata):
            places[k] = ""  # DCP replaces it with the stored str
        elif isinstance(md, TensorStorageMetadata) and len(md.size) == 1:
            places[k] = torch.zeros(md.size, dtype=torch.uint8)  # a DCPLoaderState JSON tensor
        else:
            raise ValueError(f"checkpoint {checkpoint_id!r} entry {k!r} is a {type(md).__name__} "
                             f"{getattr(md, 'size', '')}, not a loader state")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        planner = _plain_bytes_planner()
        dcp.load(places, storage_reader=_reader(checkpoint_id), planner=planner, no_dist=True)
    if planner.refused:
        k, why = min(planner.refused.items())
        raise ValueError(f"checkpoint {checkpoint_id!r}: entry {k!r} is not the str a loader's state_dict() holds: "
                         f"torch.load(weights_only=True) refused it ({why})")

    states, world = [], {}
    for rank in sorted(found):
        k = found[rank]
        value = places[k]
        try:
            state = state_from_tensor(value) if isinstance(value, torch.Tensor) else {f"{KEY_PREFIX}{rank}": value}
            config = decode_state(state)[TokenLoomLoader.META][TokenLoomLoader.CONFIG]
        except ValueError as e:
            raise ValueError(f"checkpoint {checkpoint_id!r} entry {k!r}: {e}") from e
        if int(config["rank"]) != rank:
            raise ValueError(f"checkpoint {checkpoint_id!r} entry {k!r} holds the state of rank {config['rank']}")
        world[rank] = int(config["world_size"])
        states.append(state)
    sizes = sorted(set(world.values()))
    if len(sizes) != 1:
        raise ValueError(f"checkpoint {checkpoint_id!r} holds loader states of runs with different world sizes "
                         f"(rank: world_size {world}); was the directory written by two runs?")
    missing = [r for r in range(sizes[0]) if r not in world]
    extra = [r for r in world if r >= sizes[0]]
    if missing or extra:
        raise ValueError(
            f"checkpoint {checkpoint_id!r} was saved with world_size={sizes[0]} but holds loader states of ranks "
            f"{sorted(world)}: " + (f"ranks {missing} missing (keys {[f'{key}.{KEY_PREFIX}{r}' for r in missing]}); "
                                    "did every rank take part in dcp.save?" if missing else
                                    f"ranks {extra} do not belong to it"))
    return states


# --- the earlier wrapper: the state as a JSON uint8 tensor --------------------------------

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


class DCPLoaderState:
    """Compatibility: a loader's state as a JSON ``uint8`` tensor under ``tokenloom_rank_<r>``,
    as checkpoints were written before the loader itself was a DCP ``Stateful``.

    Loading a checkpoint written with it: ``DCPLoaderState(loader, checkpoint_id=path)`` in the
    dict given to ``dcp.load`` (the entry gets the saved size from the checkpoint's metadata),
    or `read_loader_states`. Saving through it still works but warns: put the loader itself in
    the dict. ``rank`` defaults to the loader's data rank (``loader.config["rank"]``).
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
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = _metadata(checkpoint_id)
        found = {k: v for k, v in meta.items() if k == self.key or k.endswith("." + self.key)}
        if len(found) != 1:
            ranks = sorted(k for k in meta if KEY_PREFIX in k)
            why = "none" if not found else f"several ({sorted(found)})"
            raise ValueError(f"checkpoint {checkpoint_id!r} has {why} loader state for rank {self.rank} "
                             f"(key '*.{self.key}'); loader entries present: {ranks}. Resume with the world size "
                             "it was saved with; with several loaders, save each in its own checkpoint")
        (name, md), = found.items()
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"checkpoint entry {name!r} was saved from the loader itself, not by DCPLoaderState: "
                             "put the loader itself in the dict given to dcp.load")
        if len(md.size) != 1:
            raise ValueError(f"checkpoint entry {name!r} has shape {tuple(md.size)}, not a 1-D JSON tensor")
        return int(md.size[0])

    def state_dict(self) -> Dict[str, torch.Tensor]:
        if self._load_size is not None:
            # DCP asks for the destination before a load: an empty tensor of the saved size.
            return {self.key: torch.zeros(self._load_size, dtype=torch.uint8)}
        warnings.warn("DCPLoaderState is kept to read older checkpoints; put the loader itself in the dict given "
                      "to dcp.save ({'dataloader': loader})", DeprecationWarning, stacklevel=2)
        return {self.key: state_to_tensor(self.loader.state_dict())}

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        if self.key not in state_dict:
            raise ValueError(f"no loader state for rank {self.rank} (key {self.key!r}); got keys {sorted(state_dict)}")
        self.loader.load_state_dict(state_from_tensor(state_dict[self.key]))
        self._load_size = None  # from now on this object saves again
