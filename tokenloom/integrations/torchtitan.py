"""torchtitan's dataloader protocol over tokenloom's loader: `TitanLoader`.

torchtitan's trainer iterates ``(input_dict, labels)`` pairs (``input_dict["input"]`` the token
ids; every other key becomes a keyword argument of the model's forward, ``positions`` among them:
RoPE positions and, for Flex/varlen attention, the document masks) and checkpoints the loader
through DCP as a ``Stateful`` whose state is keyed per data-parallel rank, so ranks never share
an entry. tokenloom's loader state already is such an entry (``tokenloom_rank_<dp rank>``, see
pipes/loader/checkpoint.py), so the adapter only reshapes batches:

    dataloader = TitanLoader(pretrain(..., rank=dp_rank, world_size=dp_degree), dp_rank, dp_degree)

``positions`` restart at 0 at every document (``position_ids``), so each document attends to
itself; labels are already shifted, -100 where nothing is trained (torchtitan's cross entropy
ignores -100).

A resume on the same data-parallel degree is torchtitan's own checkpoint load. On another degree
(an elastic resume) a new rank's entry does not exist: exclude the dataloader from torchtitan's
load (``checkpoint.exclude_from_loading = ["dataloader"]``) and call
``dataloader.load_elastic(step_folder)``, which reads every old rank's entry; every document of
the interrupted epoch then comes once.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torchtitan.components.dataloader import BaseDataLoader

from tokenloom.pipes.loader.checkpoint import read_loader_states


class TitanLoader(BaseDataLoader):
    """A tokenloom loader as a torchtitan ``BaseDataLoader`` (see the module docstring)."""

    def __init__(self, loader: Any, dp_rank: Optional[int] = None, dp_world_size: Optional[int] = None):
        rank, world = int(loader.config["rank"]), int(loader.config["world_size"])
        if (dp_rank, dp_world_size) != (None, None) and (dp_rank, dp_world_size) != (rank, world):
            raise ValueError(f"the loader was built for rank {rank} of {world}, torchtitan's data-parallel rank is "
                             f"{dp_rank=} of {dp_world_size=}; pass rank=dp_rank, world_size=dp_degree to pretrain or sft")
        self.loader, self.dp_rank, self.dp_world_size = loader, rank, world

    def __iter__(self) -> Iterator[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            yield {"input": batch["input_ids"], "positions": batch["position_ids"]}, batch["labels"]

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict:  # torchtitan: an empty state is valid (nothing saved yet)
            self.loader.load_state_dict(state_dict)

    def load_elastic(self, checkpoint_id: Any, key: str = "dataloader") -> None:
        """Continue from every old rank's entry of a DCP checkpoint (another data-parallel degree
        or number of loader workers): ``key`` is the name torchtitan saved the loader under."""
        self.loader.load_state_dict(read_loader_states(checkpoint_id, key=key))
