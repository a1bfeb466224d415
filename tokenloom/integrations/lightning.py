"""PyTorch Lightning with tokenloom's loader: `TokenLoomDataModule`.

``trainer.fit(model, datamodule=TokenLoomDataModule(loader))``: the loader's state goes into
Lightning's own checkpoint (the datamodule's entry) and comes back with ``fit(ckpt_path=...)``.

Why a datamodule and not the loader as ``train_dataloader``: Lightning's training loop fetches
one batch ahead (to know whether the current one is the last), so when ``ModelCheckpoint`` saves
after step k the loader has already produced batch k+1, and the state Lightning saves from the
loader itself resumes one batch late (batch k+1 is never trained). The datamodule keeps the
loader's state after every batch it hands out and saves the one of the batch the training
step last consumed (counted in ``on_before_batch_transfer``, which Lightning calls for the batch
it is about to train on, not for the one fetched ahead). Cost: one ``state_dict()`` per batch
(a few KB of JSON, ~0.1 ms). Lightning does not wrap it either: the datamodule hands Lightning
an iterable, not a DataLoader, so ``use_distributed_sampler`` does not re-create anything
(tokenloom shards per rank itself). Fabric has no fetch-ahead: save ``loader.state_dict()``
in Fabric's state dict as in a loop of your own.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator

import lightning.pytorch as pl


class _Tracked:
    """The loader's batches, each with the loader's state after it kept until it was trained on."""

    def __init__(self, module: "TokenLoomDataModule"):
        self.module = module

    def __iter__(self) -> Iterator[Any]:
        module, loader = self.module, self.module.loader
        module._handed = module._consumed = 0
        module._states = {0: loader.state_dict()}
        for batch in loader:
            module._handed += 1
            module._states[module._handed] = loader.state_dict()
            yield batch


class TokenLoomDataModule(pl.LightningDataModule):
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
