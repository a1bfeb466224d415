"""What `TokenLoomDataModule` does, for both Lightning packages (``lightning.pytorch`` and
``pytorch_lightning``, whose ``LightningDataModule`` classes differ): see lightning.py. Imports no
Lightning: each package's module mixes this into its own ``LightningDataModule``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator


class _Tracked:
    """The loader's batches, each with the loader's state after it kept until it was trained on."""

    def __init__(self, module: "DataModuleMixin"):
        self.module = module

    def __iter__(self) -> Iterator[Any]:
        module, loader = self.module, self.module.loader
        module._handed = module._consumed = 0
        module._states = {0: loader.state_dict()}
        for batch in loader:
            module._handed += 1
            module._states[module._handed] = loader.state_dict()
            yield batch


class DataModuleMixin:
    """Feeds ``loader`` to ``trainer.fit`` and saves its state at the batch last trained on."""

    KEY = "loader"

    def __init__(self, loader: Any):
        super().__init__()
        self.loader = loader
        self._states: Dict[int, Dict[str, str]] = {}
        self._handed = self._consumed = 0

    def train_dataloader(self) -> _Tracked:
        return _Tracked(self)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training and not trainer.sanity_checking:
            self._consumed += 1
            for n in [n for n in self._states if n < self._consumed]:
                del self._states[n]  # older than the batch being trained on: never saved
        return batch

    def state_dict(self) -> Dict[str, Any]:
        state = self._states.get(self._consumed)
        return {self.KEY: state if state is not None else self.loader.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict[self.KEY])
